"""The built-in pair `make demo` prepares (`pipeline/prepare.py`), at toy step counts: a teacher and a student that
share a tokenizer, each built once and then reused (keyed by its settings), an interrupted preparation redone."""

import json
import pathlib

import pytest

from opdjax.config import TrainConfig, load
from opdjax.pipeline.prepare import _DONE, prepare_builtin
from opdjax.models import ModelConfig
from opdjax.models.tiny import load_tokenizer


@pytest.mark.slow
def test_builtin_pair_is_prepared_once_reused_and_keyed_by_its_settings(tmp_path):
    overrides = ["task.options={digits: 1}", "prepare.teacher_size=tiny", "prepare.teacher_steps=3",
                 "prepare.student_steps=2", "prepare.batch_size=8", f"prepare.cache_dir={tmp_path}"]
    cfg = load(TrainConfig, None, overrides)
    said = []
    out = prepare_builtin(cfg, log=said.append)
    for role in ("teacher", "student"):
        done = json.loads((pathlib.Path(out[role]) / _DONE).read_text())  # written last: complete or absent
        assert done["role"] == role and done["heldout_accuracy"] == out[f"{role}_acc"]
        assert ModelConfig.from_dir(out[role]).vocab_size > 0 and not pathlib.Path(out[role] + ".partial").exists()
    assert load_tokenizer(out["teacher"]).get_vocab() == load_tokenizer(out["student"]).get_vocab()
    assert sum("preparing the" in x for x in said) == 2
    said.clear()
    again = prepare_builtin(cfg, log=said.append)  # reused: nothing trains
    assert again == out and sum("reusing the prepared" in x for x in said) == 2
    said.clear()
    other = load(TrainConfig, None, [*overrides, "prepare.student_steps=3"])
    third = prepare_builtin(other, log=said.append)  # only the student's settings changed
    assert third["teacher"] == out["teacher"] and third["student"] != out["student"]
    assert [x.split(" (")[0] for x in said if "prepar" in x][:2] == [f"reusing the prepared teacher {out['teacher']}",
                                                                    "preparing the student"]

"""Issue 38 rows 2-4 at the run's level: resume guards that fail closed, a damaged newest checkpoint that gives way
to the newest good one, and a loss that turns NaN stopping the run before it is saved.

Before: `echo '{' > config.json` let a resume with another lr and loss through ("nothing to compare"), invalid UTF-8
in metrics.jsonl was a traceback, a torn last metrics line was dropped without a word, and a checkpoint with 64
bytes overwritten resumed into NaN weights, a NaN summary, and a rotation that removed the good step-2 checkpoint.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from opdjax.config import to_dict
from opdjax.learner import latest_step
from opdjax.models import load_state
from opdjax.pipeline import loop as pipeline
from opdjax.pipeline import rundir
from tests.pipeline.test_loop import _cfg, _lines


def _previous_run(pair, tmp_path, config: bytes | None, metrics: bytes = b'{"step": 0, "eval/accuracy": 0.0}\n'):
    """A run directory as a run leaves it (config.json, metrics.jsonl), with the given bytes."""
    out = tmp_path / "run"
    out.mkdir()
    if config is not None:
        (out / "config.json").write_bytes(config)
    (out / "metrics.jsonl").write_bytes(metrics)
    return out


@pytest.mark.parametrize("config", [b"{", b"\xff\xfe{}", b"[1, 2]", None], ids=["cut", "not_utf8", "a_list", "missing"])
def test_a_resume_over_an_unreadable_config_json_is_refused_naming_the_file(pair, tmp_path, config):
    out = _previous_run(pair, tmp_path, config)
    why = r"(is unreadable \(.*\)|holds a JSON list, not an object|is missing)"
    with pytest.raises(rundir.RunDirError, match=rf"run/config.json {why}: a resume cannot check"):
        pipeline.train(_cfg(pair, tmp_path, "pipeline.resume=true", "optim.lr=0.1", "loss.name=reverse_kl_sampled"),
                       log=lambda s: None)
    assert (out / "config.json").read_bytes() == config if config is not None else not (out / "config.json").exists()
    assert not (out / "config_changes.jsonl").exists()


@pytest.mark.parametrize("metrics, where", [
    (b'{"step": 0}\n{"step": 1, "loss": 1.\xff}\n', r": not UTF-8 \(byte \d+\)"),
    (b'{"step": 0}\n{"step": 1, "lo\n{"step": 2}\n', r":2: not a JSON record"),
], ids=["not_utf8", "a_cut_line_inside"])
def test_a_resume_over_a_damaged_metrics_file_is_refused_naming_it(pair, tmp_path, metrics, where):
    cfg = _cfg(pair, tmp_path, "pipeline.resume=true")
    out = _previous_run(pair, tmp_path, json.dumps(to_dict(cfg)).encode(), metrics)
    with pytest.raises(rundir.RunDirError, match=rf"run/metrics.jsonl{where}"):
        pipeline.train(cfg, log=lambda s: None)
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "lo')
    said = []
    assert rundir.truncate_metrics(path, 2, said.append) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    assert len(said) == 1 and "last line was cut off" in said[0] and "step 2" in said[0]
    said.clear()
    assert rundir.truncate_metrics(path, 1, said.append) == 2 and said == []  # a whole file: no warning


@pytest.mark.slow  # a 3-step run (about 13 s from a cold compilation cache)
def test_a_loss_that_turns_nan_stops_the_run_before_it_is_saved(pair, tmp_path, monkeypatch):
    from opdjax.core.errors import NonFiniteError

    real, calls = pipeline.train_on, []

    def diverging(parts, state, batch, examples):
        state, m = real(parts, state, batch, examples)
        calls.append(1)
        return state, ({**m, "loss": float("nan"), "grad_norm": float("inf")} if len(calls) == 3 else m)
    monkeypatch.setattr(pipeline, "train_on", diverging)
    with pytest.raises(NonFiniteError, match=r"step 3: loss nan, grad_norm inf: the run is stopped before these "
                                             r"weights are published or saved \(the newest checkpoint is step 2\)"):
        pipeline.train(_cfg(pair, tmp_path, "pipeline.checkpoint_every=2", "pipeline.eval_every=0"),
                       log=lambda s: None)
    assert latest_step(tmp_path / "run" / "checkpoints") == 2 and not (tmp_path / "run" / "summary.json").exists()


def _corrupt_like_the_issue(step_dir) -> None:
    """64 bytes written over the middle of the largest data file (`dd conv=notrunc`)."""
    f = max((step_dir / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        fh.write(b"\x7f" * 64)


@pytest.mark.slow  # a 4-step run and its resume to 6
def test_a_corrupted_newest_checkpoint_resumes_from_the_previous_one_with_finite_weights(pair, tmp_path):
    args = ("pipeline.checkpoint_every=2", "pipeline.eval_every=2")
    pipeline.train(_cfg(pair, tmp_path, *args), log=lambda s: None)
    ck = tmp_path / "run" / "checkpoints"
    _corrupt_like_the_issue(ck / "4")
    said = []
    summary = pipeline.train(_cfg(pair, tmp_path, *args, "pipeline.steps=6", "pipeline.resume=true"), log=said.append)
    warned = [s for s in said if "failed its check" in s]
    assert len(warned) == 1 and "step 4: " in warned[0] and "resuming from step 2" in warned[0], said
    assert any("resumed from" in s and "at step 2" in s for s in said)
    assert summary["steps"] == 6 and all(math.isfinite(v) for v in summary["final"].values())
    for x in jax.tree.leaves(load_state(tmp_path / "run" / "student_final")[1]):
        assert np.isfinite(np.asarray(x)).all()
    assert sorted(p.name for p in ck.iterdir()) == ["4", "6", "damaged-4"]
    assert [x["step"] for x in _lines(tmp_path) if "loss" in x] == [1, 2, 3, 4, 5, 6]

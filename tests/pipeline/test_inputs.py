"""Bounded input (issue 38 row 4): a prompt file is checked against the student's context before any line is
tokenized and before any model loads (`check_inputs`); too few distinct prompts are refused up front, in one line."""

import json
import re
import time
import tracemalloc

import pytest

from opdjax.cli.main import main
from opdjax.config import TrainConfig, load
from opdjax.core.errors import InputError
from opdjax.pipeline import inputs


def _cfg(pair, prompts, *extra):
    return load(TrainConfig, None, [f"student={pair[0]}", f"teacher={pair[1]}", f"prompts={prompts}",
                                    "rollout.batch_size=4", *extra])


def _rows(n, split="train", start=0):
    return [json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "split": split}) for i in range(start, start + n)]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _file_with_a_huge_line(path, megabytes):
    """8 training rows, 1 held-out row, then line 10: one prompt of `megabytes` MiB, written in chunks."""
    chunk = "7" * (1 << 20)
    with open(path, "w") as f:
        f.write("\n".join(_rows(8) + _rows(1, "heldout", 8)) + "\n")
        f.write('{"prompt": "')
        for _ in range(megabytes):
            f.write(chunk)
        f.write('"}\n')
    return path


def test_a_50mb_prompt_line_is_refused_before_tokenizing_in_seconds_and_little_memory(pair, tmp_path):
    """Issue 38 row 5: a 50 MB line reached 16.5 GB in 85 s (the whole line was tokenized first). Now: refused
    naming file:line and the bound, before any model loads, under 5 s and 500 MB (Python's allocations)."""
    f = _file_with_a_huge_line(tmp_path / "p.jsonl", 50)
    cfg = _cfg(pair, f)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(InputError, match=re.escape(f"{f}:10: ")) as e:
            inputs.check_inputs(cfg)
    finally:
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert seconds < 5 and peak < 500e6, (seconds, peak)
    assert "bytes" in str(e.value) and "\n" not in str(e.value)


def test_a_prompt_over_the_byte_bound_of_the_context_is_refused_without_tokenizing(pair, tmp_path, monkeypatch):
    """A row under the reader's cap but over (positions - max_new_tokens) x BYTES_PER_TOKEN bytes is refused by its
    byte length, naming file:line and the bound; the tokenizer is never called on it."""
    f = tmp_path / "p.jsonl"
    _write(f, _rows(8) + _rows(1, "heldout", 8) + [json.dumps({"prompt": "9" * 100_000, "split": "train"})])
    cfg = _cfg(pair, f)
    bound = (2048 - cfg.rollout.max_new_tokens) * inputs.BYTES_PER_TOKEN  # the tiny pair has 2048 positions
    with pytest.raises(InputError, match=re.escape(f"{f}:10: a prompt of 100,000 bytes")) as e:
        inputs.check_inputs(cfg)
    assert f"{bound:,} bytes" in str(e.value)

    def no_tokenizer(*a, **k):
        raise AssertionError("tokenized")

    task = inputs.check_inputs(_cfg(pair, _write(tmp_path / "ok.jsonl", _rows(8) + _rows(1, "heldout", 8)))).task
    big = _write(tmp_path / "big.jsonl", _rows(8) + _rows(1, "heldout", 8) + [json.dumps({"prompt": "9" * 70_000})])
    with pytest.raises(InputError, match=re.escape(f"{big}:10: a prompt of 70,000 bytes")):
        inputs.check_lengths(cfg, type(task)(str(big)), no_tokenizer, 2048)


@pytest.mark.parametrize("case", ["duplicates", "too_few", "no_heldout"])
def test_too_few_distinct_prompts_are_refused_before_the_run_directory(pair, tmp_path, capsys, case):
    """Issue 38 row 7: a file of only duplicate prompts was refused only after the models loaded. The training
    split needs at least rollout.batch_size distinct prompts, the held-out split at least one row: refused by
    check_inputs, in one line, before the run directory is claimed."""
    f = tmp_path / "p.jsonl"
    lines = {"duplicates": [json.dumps({"prompt": "1+1=", "answer": "2"})] * 50,
             "too_few": _rows(3) * 5 + _rows(2, "heldout", 3),
             "no_heldout": _rows(20)}[case]
    _write(f, lines)
    out = tmp_path / "r"
    assert main(["train", f"student={pair[0]}", f"teacher={pair[1]}", f"prompts={f}", "rollout.batch_size=4",
                 f"pipeline.out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0], err
    words = {"duplicates": "split", "too_few": "3 distinct training prompts", "no_heldout": "'heldout'"}[case]
    assert words in err[0], err
    assert not out.exists()  # refused before the run directory (and so before any model loads)


def test_enough_distinct_prompts_pass(pair, tmp_path):
    f = _write(tmp_path / "p.jsonl", _rows(4) * 3 + _rows(1, "heldout", 4))
    assert inputs.check_inputs(_cfg(pair, f)).task.name == "jsonl"

"""Issue 38 row 6: a write the machine refuses (disk full, permission denied, ...) ends a command in one line naming
the path and the cause, with exit code 74 (EX_IOERR), not the 2 of bad input; the last good checkpoint is intact.
Before: hundreds of lines of orbax/asyncio tracebacks and exit 1."""

from __future__ import annotations

import argparse
import errno
import os

import pytest

from opdjax.cli.common import EXIT_INPUT, EXIT_MACHINE, guard
from opdjax.cli.main import main
from opdjax.core.errors import InputError, MachineFaultError


def _run(exc: BaseException, capsys) -> tuple[int, list[str]]:
    def command(args):
        raise exc
    code = guard(command)(argparse.Namespace(command="train", debug=False))
    return code, capsys.readouterr().err.splitlines()


def test_exit_codes_tell_bad_input_from_a_fault_of_the_machine(capsys):
    assert EXIT_MACHINE not in (0, EXIT_INPUT, 130)
    assert _run(InputError("bad key"), capsys) == (EXIT_INPUT, ["opdjax train: error: InputError: bad key"])
    fault = MachineFaultError("checkpoint step 2 not saved: /x: No space left on device (ENOSPC)")
    assert _run(fault, capsys) == (EXIT_MACHINE, [f"opdjax train: error: MachineFaultError: {fault}"])
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/metrics.jsonl")
    assert _run(full, capsys) == (EXIT_MACHINE, ["opdjax train: error: OSError: /runs/x/metrics.jsonl: No space left "
                                                 "on device (ENOSPC)"])
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/runs/x/summary.json")
    assert _run(denied, capsys)[0] == EXIT_MACHINE
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        _run(ZeroDivisionError(), capsys)


@pytest.mark.slow  # a 2-step run through `opdjax train` (about 9 s)
def test_a_full_disk_during_a_checkpoint_ends_train_in_one_line_and_keeps_the_last_checkpoint(pair, tmp_path, capsys,
                                                                                              monkeypatch):
    from opdjax.learner import latest_step, manifest

    real, calls = manifest.write_manifest, []

    def full_on_the_second(step_dir, step):
        calls.append(step)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(step_dir / "state" / "_METADATA"))
        real(step_dir, step)
    monkeypatch.setattr(manifest, "write_manifest", full_on_the_second)
    out = tmp_path / "run"
    code = main(["train", f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}",
                 "rollout.batch_size=8", "rollout.max_new_tokens=4", "pipeline.steps=3", "pipeline.checkpoint_every=1",
                 "pipeline.eval_every=0", "pipeline.eval_prompts=8", "pipeline.progress=false",
                 "pipeline.tensorboard=false", f"pipeline.out_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_MACHINE, err
    assert err[-1].startswith("opdjax train: error: MachineFaultError: checkpoint step 2 not saved: ")
    assert f"{out}/checkpoints/2/state/_METADATA: No space left on device (ENOSPC)" in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert latest_step(out / "checkpoints") == 1 and manifest.damage(out / "checkpoints" / "1") is None


def test_a_full_disk_while_writing_metrics_or_a_run_file_names_that_file(tmp_path, monkeypatch, capsys):
    """The OS reports ENOSPC on a write or an fsync without a file name; the one-line report still names the file
    (metrics.jsonl through the logger, summary.json / config.json through the atomic writer)."""
    from opdjax.pipeline import rundir
    from opdjax.pipeline.logger import MetricsLogger

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with MetricsLogger(tmp_path, tensorboard=False, resume=False) as m:
        m.log(1, {"loss": 1.0})
        monkeypatch.setattr(m, "f", type("Full", (), {"name": str(tmp_path / "metrics.jsonl"), "write": full,
                                                      "flush": full, "close": lambda self: None})())
        with pytest.raises(OSError) as e:
            m.log(2, {"loss": 0.5})
    code, err = _run(e.value, capsys)
    assert code == EXIT_MACHINE and err == [f"opdjax train: error: OSError: {tmp_path / 'metrics.jsonl'}: No space "
                                            f"left on device (ENOSPC)"]
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        rundir.write_json(tmp_path / "summary.json", {"steps": 2})
    assert e.value.filename == str(tmp_path / "summary.json") and not list(tmp_path.glob(".summary.json.*"))

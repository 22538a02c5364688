"""Issue 29: Ctrl-C during `opdjax train` ends with one line and exit code 130 (it was a 44-line traceback), and
the run it leaves resumes."""

import json
import signal
import subprocess
import sys
import time

import pytest


def _interactive_sigint() -> None:
    """In the child before exec: SIGINT as a terminal gives it (default, unblocked). A child inherits an ignored
    or blocked SIGINT, and an earlier test in this pytest worker may have left one behind; a process that starts
    with SIGINT ignored keeps ignoring it (as a background job should)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow
def test_ctrl_c_during_train_prints_one_line_and_exits_130(pair, tmp_path):
    out = tmp_path / "run"  # far more steps than run before the signal, even on a loaded machine
    args = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
            "rollout.max_new_tokens=4", "pipeline.eval_every=0", "pipeline.eval_prompts=8", "pipeline.steps=1000",
            "pipeline.checkpoint_every=1", "pipeline.progress=false", "pipeline.tensorboard=false",
            f"pipeline.out_dir={out}"]
    p = subprocess.Popen([sys.executable, "-m", "opdjax.cli", "train", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, preexec_fn=_interactive_sigint)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
        if any("loss" in json.loads(x) for x in lines if x.strip()):
            break
        time.sleep(0.1)
    # One press. A checkpoint every step keeps the run inside orbax's save most of the time, so the press lands in a
    # save (held until the checkpoint is whole: `sigint_deferred`).
    p.send_signal(signal.SIGINT)
    try:
        err = p.communicate(timeout=90)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"Ctrl-C was ignored: still training 90 s later\n{p.communicate()[1][-3000:]}")
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "opdjax train: interrupted", err[-3000:]
    from opdjax.learner import latest_step

    assert latest_step(out / "checkpoints") >= 1  # what it leaves is a whole checkpoint to resume from

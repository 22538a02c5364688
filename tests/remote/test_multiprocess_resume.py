"""A learner process killed mid-run stops the job, and the resumed job continues exactly (two JAX processes under
jax.distributed, gloo on CPU, as separate OS processes)."""

import json
import os
import signal
import time

import pytest

from opdjax.learner import latest_step
from tests.remote.test_multiprocess import _learners, _wait

pytestmark = pytest.mark.slow  # real `opdjax train` processes under jax.distributed


def test_a_dead_learner_process_stops_the_job_and_a_resumed_job_continues_exactly(pair, tmp_path):
    # 3 devices per process: 8 rows do not divide over the 6-device mesh, so the batch is replicated (to_global
    # gathers every process's rows first). The kill comes just after the first checkpoint (step 8); the run must
    # still have many steps to go then (a step takes ~40 ms here): with 8 steps in all and a checkpoint at 4,
    # process 0 once finished the last 4 before its peer was gone (exit 0, nothing to resume).
    steps = ("pipeline.steps=40", "pipeline.checkpoint_every=8")
    straight = tmp_path / "straight"
    reference = _learners(pair, straight, *steps, devices=3)  # the uninterrupted job, alongside (it only reads)
    out = tmp_path / "run"
    procs = _learners(pair, out, *steps, devices=3)
    deadline = time.time() + 300
    while latest_step(out / "checkpoints") is None and time.time() < deadline and procs[1].poll() is None:
        time.sleep(0.2)
    time.sleep(0.1)
    os.kill(procs[1].pid, signal.SIGKILL)
    (rc0, _, err0), _ = _wait(procs)
    # Stopped, by our handler (a collective failed) or by JAX's coordination service (its heartbeat timeout).
    ours = rc0 == 3 and "lost a peer" in err0 and "pipeline.resume=true" in err0
    assert ours or (rc0 != 0 and "another task died" in err0), err0[-2000:]
    for rc, _, err in _wait(_learners(pair, out, *steps, "pipeline.resume=true", devices=3)):
        assert rc == 0, err[-3000:]
    for rc, _, err in _wait(reference):
        assert rc == 0, err[-3000:]
    a = json.loads((straight / "summary.json").read_text())
    b = json.loads((out / "summary.json").read_text())
    assert b["steps"] == 40 and a["final"] == b["final"]

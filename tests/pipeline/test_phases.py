"""The run clock: training and evaluation seconds apart, continued from a checkpoint's figures."""

import pytest

from opdjax.pipeline import phases


def test_run_clock_counts_evaluation_apart_and_continues(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(phases.time, "perf_counter", lambda: now[0])
    clock = phases.RunClock(train=7.0, eval=2.0)  # resumed: 7 s of training, 2 s of evaluation before
    now[0] += 3.0                                  # 3 s of training
    with clock.evaluating():
        now[0] += 5.0                              # 5 s of evaluation
    now[0] += 1.0
    assert clock.state() == {"train": pytest.approx(11.0), "eval": pytest.approx(7.0)}
    assert clock.seconds() == {"time/elapsed_train": pytest.approx(11.0), "time/elapsed_eval": pytest.approx(7.0)}
    with pytest.raises(RuntimeError), clock.evaluating():
        now[0] += 2.0
        raise RuntimeError("an evaluation that fails still took its time")
    assert clock.state()["eval"] == pytest.approx(9.0)

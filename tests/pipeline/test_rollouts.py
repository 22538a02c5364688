"""The rollout source both modes share, and the phase timer: seeds, staleness, drops, worker errors, stop on close."""

import threading
import time
import types

import numpy as np
import pytest

from opdjax.pipeline import rollouts
from opdjax.pipeline.opd import rollout_seed
from opdjax.pipeline.phases import Phases


class _Stream:
    """A prompt stream of integers: `next(n)` hands out the next n, `position` counts them."""

    def __init__(self):
        self.position = 0

    def next(self, n):
        out = list(range(self.position, self.position + n))
        self.position += n
        return out


PARTS = types.SimpleNamespace(engine=None, tokenizer=None, sampling=None, samples_per_prompt=1)


def _engine(monkeypatch, version=lambda: 0, fail_at=None):
    """`rollouts.generate` replaced by a sampler that records its seeds and stamps `version()` on its rows."""
    seeds = []

    def generate(engine, tokenizer, examples, sampling, *, seed, samples_per_prompt=1):
        seeds.append(seed)
        if fail_at is not None and len(seeds) == fail_at:
            raise OSError("engine lost")
        return types.SimpleNamespace(version_B=np.full(len(examples), version()))
    monkeypatch.setattr(rollouts, "generate", generate)
    return seeds


def test_the_on_demand_source_samples_each_step_at_its_seed_and_never_drops(monkeypatch):
    seeds = _engine(monkeypatch, version=lambda: 1)
    with rollouts.RolloutSource(PARTS, _Stream(), batch_size=4, run_seed=7) as source:
        a, b = source.next(3), source.next(9)
    assert seeds == [rollout_seed(7, 3), rollout_seed(7, 9)]
    assert (a.examples, a.stream_end, b.examples, b.stream_end) == ([0, 1, 2, 3], 4, [4, 5, 6, 7], 8)
    # An engine that serves older weights (rollout.stale_versions) is measured, not dropped.
    assert (a.staleness, a.dropped, b.staleness, b.dropped) == (2, False, 8, False)
    assert set(a.seconds) == {"time/generate"}


def test_the_ahead_source_samples_at_most_queue_size_ahead_and_drops_rollouts_older_than_max_staleness(monkeypatch):
    seeds = _engine(monkeypatch)  # every rollout sampled with version 0
    with rollouts.AheadSource(PARTS, _Stream(), batch_size=2, run_seed=7, first_step=5, queue_size=2,
                              max_staleness=1) as source:
        deadline = time.time() + 10
        while len(seeds) < 2 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # room for a third sample, were the worker to start one before the learner takes
        assert seeds == [rollout_seed(7, 5) + i for i in range(2)]  # two ahead, none started beyond them
        first = source.next(1)
        while len(seeds) < 3 and time.time() < deadline:  # taking one frees a slot: the third starts
            time.sleep(0.01)
        second = source.next(2)
        assert seeds[:3] == [rollout_seed(7, 5) + i for i in range(3)]
    assert (first.staleness, first.dropped, first.stream_end) == (1, False, 2)
    assert (second.staleness, second.dropped, second.stream_end) == (2, True, 4)
    assert not any(t.name == "opdjax-rollout" for t in threading.enumerate())  # close stopped and joined the worker


def test_a_failing_worker_raises_its_error_on_the_learner_thread(monkeypatch):
    _engine(monkeypatch, fail_at=1)
    with rollouts.AheadSource(PARTS, _Stream(), batch_size=2, run_seed=0, first_step=0, queue_size=1,
                              max_staleness=0) as source:
        with pytest.raises(RuntimeError, match="rollout worker failed") as info:
            source.next(0)
    assert isinstance(info.value.__cause__, OSError)


def test_phases_record_each_block_under_its_metric_name():
    phases = Phases()
    with phases.time("wait"):
        time.sleep(0.02)
    with phases.time("publish"):
        pass
    with pytest.raises(ValueError), phases.time("train"):
        raise ValueError("a failed phase records nothing")
    assert list(phases.seconds) == ["time/wait", "time/publish"]
    assert phases.seconds["time/wait"] >= 0.02 > phases.seconds["time/publish"] >= 0

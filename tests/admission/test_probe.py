"""The admission probe: M on the engine's own samples, with a bootstrap CI, without training."""

import numpy as np
import pytest

from opdjax.admission.probe import bootstrap_ci, per_sequence_terms, probe
from opdjax.config import TrainConfig, load
from opdjax.core import mismatch


def test_per_sequence_terms_sum_to_the_token_mean_of_mismatch_metrics():
    rng = np.random.RandomState(0)
    s, r = -rng.rand(6, 9), -rng.rand(6, 9)
    mask = rng.rand(6, 9) < 0.7
    for metric in ("k1", "k2", "k3"):
        sums, counts = per_sequence_terms(metric, s, r, mask)
        want = float(mismatch.metrics(s.astype(np.float32), r.astype(np.float32), mask)[metric])
        assert sums.sum() / counts.sum() == pytest.approx(want, rel=1e-4, abs=1e-7)
    lo, hi = bootstrap_ci(sums, counts)
    assert lo <= sums.sum() / counts.sum() <= hi
    with pytest.raises(ValueError, match="not supported"):
        per_sequence_terms("chi2", s, r, mask)


def test_probe_is_zero_for_the_clean_engine_and_positive_for_simulated_fp8(pair):
    base = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8"]
    clean = probe(load(TrainConfig, None, base), batches=2, log=lambda s: None)
    fp8 = probe(load(TrainConfig, None, base + ["rollout.recipe=fp8_w8a8_kv"]), batches=2, log=lambda s: None)
    assert clean.m < 1e-9 and clean.tokens > 0
    assert fp8.m > 10 * max(clean.m, 1e-12) and fp8.ci_low <= fp8.m <= fp8.ci_high
    assert fp8.metrics["k3"] == pytest.approx(fp8.m, rel=1e-3)


def test_staleness_probe_serves_k_versions_behind_a_warmed_up_learner(pair):
    base = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
            "optim.warmup_steps=2", "optim.lr=0.01"]
    stale = probe(load(TrainConfig, None, base + ["rollout.stale_versions=2"]), batches=2, log=lambda s: None)
    assert stale.staleness == 2 and stale.m > 1e-6
    fresh = probe(load(TrainConfig, None, base), batches=2, log=lambda s: None)
    assert fresh.staleness == 0 and fresh.m < 1e-9

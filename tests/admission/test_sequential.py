"""The sequential admission probe on synthetic M streams with known truth: error rates under optional stopping stay
below the risk, far candidates stop early, near ones hit the cap."""

import math

import numpy as np
import pytest

from opdjax.admission import sequential as seq

B = 0.01  # the budget


def _stream(true_m: float, seed: int, batch: int = 8, shape: float = 0.5):
    """Per-sequence (sums, counts): 1-8 tokens per sequence, each token's term Gamma(shape) with mean true_m
    (right-skewed like k3 terms), so the ratio of sums estimates true_m."""
    rng = np.random.default_rng(seed)

    def next_batch(b):
        counts = rng.integers(1, 9, batch)
        terms = rng.gamma(shape, true_m / shape, counts.sum())
        sums = np.add.reduceat(terms, np.r_[0, np.cumsum(counts)[:-1]])
        return sums, counts

    return next_batch


def _verdicts(true_m, n, alpha=0.05, max_batches=16, shape=0.5):
    return [seq.run_sequential(_stream(true_m, s, shape=shape), B, alpha=alpha, max_batches=max_batches)
            for s in range(n)]


def test_look_levels_spend_at_most_the_risk():
    assert sum(seq.look_alpha(0.05, j) for j in range(1, 100_000)) < 0.05
    assert seq.look_alpha(0.05, 1) == pytest.approx(0.05 * 6 / math.pi ** 2)
    for bad in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="risk"):
            seq.look_alpha(bad, 1)
    with pytest.raises(ValueError, match="min_sequences"):
        seq.run_sequential(_stream(B, 0), B, max_batches=2, min_sequences=2)
    with pytest.raises(ValueError, match="risk"):
        seq.run_sequential(_stream(B, 0), B, alpha=1.5)


def test_ratio_bounds_match_the_skew_corrected_delta_method_by_hand():
    s, c = np.array([1.0, 2.0, 0.0, 3.0, 9.0]), np.array([2, 2, 0, 4, 2])  # the empty sequence is ignored
    r, lo, hi = seq.ratio_bounds(s, c, 0.025)
    assert r == pytest.approx(15 / 10)
    z = np.array([1 - 3.0, 2 - 3.0, 3 - 6.0, 9 - 3.0]) / 2.5  # (s - R c) / mean(c)
    se = math.sqrt((z ** 2).sum() / 3) / 2
    g = np.mean(z ** 3) / np.mean(z ** 2) ** 1.5
    t = 3.182446305284263  # t_{0.975, 3}
    assert g > 0 and hi - r == pytest.approx(se * (t + g * (1 + 2 * t * t) / 12))  # right skew widens the top
    assert r - lo == pytest.approx(se * t)  # ... and never narrows the bottom
    # Left skew (mirror image): the lower bound is widened, the upper one is plain t.
    s2, c2 = np.array([3.0, 2.0, 9.0, -3.0]), np.array([2, 2, 4, 2])
    r2, lo2, hi2 = seq.ratio_bounds(s2, c2, 0.025)
    z2 = (s2 - r2 * c2) / 2.5
    assert np.mean(z2 ** 3) < 0 and hi2 - r2 == pytest.approx(math.sqrt((z2 ** 2).sum() / 3) / 2 * t)
    assert r2 - lo2 > hi2 - r2


def test_bounds_always_contain_the_estimate_even_with_one_huge_sequence():
    # 200 near-zero sequences and one enormous one: skewness is extreme, yet lo <= R <= hi.
    s = np.r_[np.full(200, 1e-4), 50.0]
    c = np.full(201, 5)
    for a in (0.3, 0.05, 0.001):
        r, lo, hi = seq.ratio_bounds(s, c, a)
        assert lo <= r <= hi
    assert seq.ratio_bounds(np.array([1.0, 2.0]), np.array([3, 1]), 0.05)[1:] == (-math.inf, math.inf)


@pytest.mark.slow  # 4,000 simulated probes per risk level (~25 s each)
@pytest.mark.parametrize("alpha", [0.05, 0.2])
def test_false_admits_stay_below_the_risk_at_and_just_beyond_the_budget(alpha):
    # The hardest truths for a false ADMIT: M exactly B and just beyond it, 1,000 probes each, skewed terms.
    for shape in (0.5, 0.2):  # skewed and very skewed token terms
        for true_m in (B, 1.05 * B):
            admits = sum(r.verdict == "ADMIT" for r in _verdicts(true_m, 1000, alpha=alpha, shape=shape))
            assert admits / 1000 <= alpha, (shape, true_m, admits)


def test_false_rejects_stay_below_the_risk_just_within_the_budget():
    rejects = sum(r.verdict == "REJECT" for r in _verdicts(0.95 * B, 1000, alpha=0.05))
    assert rejects / 1000 <= 0.05


def test_far_candidates_stop_early_and_near_ones_reach_the_cap():
    far_in = _verdicts(0.2 * B, 50)
    far_out = _verdicts(5 * B, 50)
    assert all(r.verdict == "ADMIT" for r in far_in) and all(r.verdict == "REJECT" for r in far_out)
    # decided at the first look: 4 batches of 8 = min_sequences
    assert {r.batches for r in far_in} == {r.batches for r in far_out} == {4}
    near = _verdicts(1.01 * B, 20)
    assert sum(r.verdict == "UNCERTAIN" and r.batches == 16 for r in near) >= 15
    assert "at the cap of 16 batches" in near[0].reason or near[0].verdict != "UNCERTAIN"
    assert "upper bound" in far_in[0].reason and "lower bound" in far_out[0].reason


def test_against_b_interval_a_candidate_inside_it_stops_uncertain_and_ones_beyond_it_are_decided():
    """B's interval [0.5 B, 2 B]: M = B sits inside it and stops UNCERTAIN at a look, before the cap (no batch can
    decide it); M = 0.2 B is still ADMITted and 5 B REJECTed; 0.7 B (below B, above the interval's lower end) is
    never ADMITted."""
    run = lambda m, s: seq.run_sequential(_stream(m, s), 0.5 * B, budget_high=2 * B)  # noqa: E731
    inside = [run(B, s) for s in range(20)]
    assert all(r.verdict == "UNCERTAIN" and r.batches < 16 for r in inside)
    assert "inside B's interval" in inside[0].reason and "no number of batches" in inside[0].reason
    assert all(run(0.2 * B, s).verdict == "ADMIT" for s in range(20))
    assert all(run(5 * B, s).verdict == "REJECT" for s in range(20))
    assert not any(run(0.7 * B, s).verdict == "ADMIT" for s in range(50))
    assert seq.judge(0.6 * B, 1.9 * B, 0.5 * B, 2 * B) == "UNCERTAIN" and seq.judge(0.4 * B, B, 0.5 * B, 2 * B) is None
    with pytest.raises(ValueError, match="budget <= budget_high"):
        seq.run_sequential(_stream(B, 0), 2 * B, budget_high=B)


def test_a_larger_risk_trades_uncertain_for_decisions():
    strict = _verdicts(0.7 * B, 200, alpha=0.01)
    loose = _verdicts(0.7 * B, 200, alpha=0.3)
    und = lambda rs: sum(r.verdict == "UNCERTAIN" for r in rs)  # noqa: E731
    assert und(loose) < und(strict)
    assert np.mean([r.batches for r in loose]) < np.mean([r.batches for r in strict])

"""benchmarks/bench_disaggregated.py's table (time/steps to quality per mode, paired speed-ups, the phase bound) on
synthetic records with known answers, and benchmarks/predict_time_to_quality.py's modelled inputs."""

import pytest

from tests.benchmarks.conftest import load_benchmark


@pytest.fixture(scope="module")
def disagg():
    return load_benchmark("bench_disaggregated")


@pytest.fixture(scope="module")
def predict():
    return load_benchmark("predict_time_to_quality")


def _record(mode, seed, secs_per_step, reach_step):
    """A run whose reverse KL falls from 10 to 1 linearly until `reach_step`, then stays; 8 evaluations 10 steps
    apart, `secs_per_step` of training per step."""
    curve = [[k, 10 - 9 * min(k / reach_step, 1.0), 0.5, k * secs_per_step] for k in range(0, 80, 10)]
    phases = {"time/wait": 0.01, "time/generate": 0.2, "time/score": 0.1, "time/train": 0.3, "time/publish": 0.05,
              "step": secs_per_step}
    return {"mode": mode, "seed": seed, "eval_curve": curve, "time": {"elapsed_train": curve[-1][3]},
            "phases": phases, "dropped": 0, "staleness_mean": 0.0 if mode == "sync" else 1.0}


def test_the_table_gives_paired_speedups_and_the_phase_bound(disagg):
    recs = [_record("sync", s, 1.0, 40) for s in range(4)] + [_record("async1", s, 0.5, 50) for s in range(4)]
    t = disagg.disaggregated_table(recs)
    row = next(r for r in t["rows"] if r["mode"] == "async1" and r["fraction"] == "0.9")
    # 90% of the way from 10 to 1 = 1.9: sync reaches it at step 40 (36.0 -> evaluated at 40, 40 s), async at 50
    assert row["reached"] == 4 and row["step"]["mean"] == 50 and row["seconds"]["mean"] == 25.0
    assert row["seconds"]["speedup_vs_sync"] == pytest.approx([40 / 25] * 3)
    assert row["step"]["speedup_vs_sync"] == pytest.approx([40 / 50] * 3)
    bound = t["phases"]["bound"]
    assert bound["per_step_speedup_max"] == pytest.approx((0.2 + 0.45) / 0.45)


def test_the_prediction_models_fp8_decode_and_async_overlap(predict):
    r = predict.decode_speedup("qwen3-1.7b", "h100-sxm", 40, 2048)
    assert r == pytest.approx(2.07, abs=0.01)  # docs/results/fp8-decode.md's modelled ratio
    rows = {t.candidate: t for t in predict.modelled_times(["rollout.recipe=fp8_w8a8_kv", "rollout.stale_versions=1"],
                                                           0.6, 2.0)}
    assert rows["rollout.recipe=fp8_w8a8_kv"].generate == pytest.approx(0.3)
    assert rows["rollout.stale_versions=1"].generate == pytest.approx(0.6)
    assert rows["baseline"].learner == pytest.approx(0.4)


@pytest.fixture(scope="module")
def fits():
    return load_benchmark("fit_heldout")


def test_held_out_fits_recover_a_hinge_and_isotonic_pools_violators(fits):
    import numpy as np

    assert fits._isotonic(np.array([0, 1, 2.0]), np.array([1.0, 3.0, 2.0]), np.ones(3)).tolist() == [1.0, 2.5, 2.5]
    rng = np.random.default_rng(0)
    levels = {"baseline": -27.0, "a": -1.0, "b": 0.5, "c": 1.5, "d": 2.5, "e": 3.0}
    x = np.concatenate([np.full(8, v) for v in levels.values()])
    g = [k for k in levels for _ in range(8)]
    y = -2.0 + 0.8 * np.maximum(0.0, x - 0.0) + rng.normal(0, 0.02, x.size)  # a hinge at ln M = 0
    held = [k != "c" for k in g]
    for model in ("hinge", "isotonic", "logistic"):
        pred = fits.predict(model, x[held], y[held], [k for k in g if k != "c"], 1.5)
        assert pred == pytest.approx(-2.0 + 0.8 * 1.5, abs={"hinge": 0.1, "isotonic": 0.45, "logistic": 0.25}[model]), model

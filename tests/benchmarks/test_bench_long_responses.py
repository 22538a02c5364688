"""benchmarks/bench_long_responses.py at toy lengths: both JaxEngine cache layouts decode every requested token, the
learner part reports the padding it trims, and the tables and JSON come out (vLLM is left to the real run)."""

import json

import numpy as np
import pytest

from tests.benchmarks.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_long_responses")


def test_response_lengths_stay_between_a_tenth_and_all_of_max(bench):
    rng = np.random.default_rng(0)
    for spread in bench.SPREADS:
        lens = bench.response_lengths(rng, 1000, 500, spread)
        assert lens.min() >= 50 and lens.max() <= 500
    assert np.median(bench.response_lengths(rng, 1000, 500, "lognormal")) == pytest.approx(150, rel=0.15)
    with pytest.raises(ValueError, match="unknown spread"):
        bench.response_lengths(rng, 4, 10, "normal")


def test_engine_and_learner_parts_at_toy_lengths(bench, tmp_path):
    bench.make_checkpoint(tmp_path / "m", "tiny", 64)
    eng = {k: bench.engine_times(k, tmp_path / "m", [12, 40], batch=2, prompt=5, repeats=1)
           for k in ("jax-full", "jax")}
    assert all(r[N]["tokens"] == 2 * N for r in eng.values() for N in (12, 40))  # no EOS: every token decoded
    learn = bench.learner_times(tmp_path / "m", [40], batch=4, prompt=5, repeats=1)
    r = learn[(40, "lognormal")]
    assert r["T_full"] == 45 and r["T_trimmed"] <= 45 and r["waste_trimmed"] <= r["waste_full"] < 1
    assert len(r["full"]) == len(r["trimmed"]) == 1
    text = bench.report({"engine": eng, "learner": learn})
    assert "| 40 | " in text and "jax / jax-full" in text and "| 40 | uniform | 45 |" in text
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps({"engine": eng, "learner": {f"{N} {s}": v for (N, s), v in learn.items()}}))
    assert bench.report(bench.load_result(str(saved))) == text  # --report re-renders a saved result

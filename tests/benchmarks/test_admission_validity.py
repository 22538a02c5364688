"""benchmarks/admission_validity.py's pure parts: the seeds of the full-run verdicts and the knee candidates."""

import pathlib

import pytest

from opdjax.study.study_config import load_study
from tests.benchmarks.conftest import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("admission_validity")


def test_truth_seeds_extend_the_study_seeds_past_their_largest(bench):
    assert bench.truth_seeds((0, 1, 2, 3), None) == [0, 1, 2, 3]
    assert bench.truth_seeds((0, 1, 2, 3), 8) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert bench.truth_seeds((3, 9), 4) == [3, 9, 10, 11]
    assert bench.truth_seeds((0, 1, 2, 3), 2) == [0, 1]
    with pytest.raises(SystemExit, match="--seeds must be >= 1"):
        bench.truth_seeds((0, 1), 0)


def test_knee_candidates_carry_the_study_noise_kind(bench):
    points = [{"knob": "baseline", "value": 0, "m_probe": 0.0},
              {"knob": "weight_noise", "value": 0.01, "m_probe": 1e-3},
              {"knob": "weight_noise", "value": 0.02, "m_probe": 4e-3}]
    bj = {"points": points, "budget": 1e-3}
    fixed = load_study(ROOT / "configs" / "budget_cpu.yaml")
    assert bench.knee_candidates(bj, fixed) == ["rollout.weight_noise=0.005", "rollout.weight_noise=0.0141",
                                                "rollout.weight_noise=0.03"]
    kind = load_study(ROOT / "configs" / "budget_cpu.yaml", ["base.rollout.noise_mode=rounding"])
    assert all(c.endswith(",rollout.noise_mode=rounding") for c in bench.knee_candidates(bj, kind))


def test_m_coverage_counts_candidates_at_a_third_of_b_and_at_three_times_b(bench):
    rows = [{"candidate": "a", "m": 0.1}, {"candidate": "b", "m": 1 / 3}, {"candidate": "c", "m": 1.0},
            {"candidate": "d", "m": 3.0}, {"candidate": "e", "m": 2.9}]
    assert bench.m_coverage(rows, 1.0) == {"below_b_over_3": ["a", "b"], "above_3b": ["d"], "max_m": 3.0}

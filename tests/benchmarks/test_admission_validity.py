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


def test_truth_seeds_disjoint_from_the_study_are_refused_when_they_overlap(bench):
    study = load_study(ROOT / "configs" / "budget_sort_cpu.yaml")
    assert bench.disjoint_seeds("100-103", study) == [100, 101, 102, 103]
    assert bench.disjoint_seeds("40,41", study) == [40, 41]
    with pytest.raises(SystemExit, match=r"seeds \[7, 8\] are the study's"):
        bench.disjoint_seeds("7-8", study)


def test_each_candidate_has_one_kind_and_a_combination_is_its_own(bench):
    assert bench.kind_of("rollout.stale_versions=3") == "staleness"
    assert bench.kind_of("rollout.recipe=fp8_w8a8_kv") == "recipe"
    assert bench.kind_of("rollout.recipe=mxfp4_w4a16") == "4-bit"
    assert bench.kind_of("rollout.weight_noise=0.35") == "noise"
    assert bench.kind_of("rollout.weight_noise=0.5,rollout.noise_mode=per_version") == "noise:per_version"
    assert bench.kind_of("rollout.recipe=mxfp4_w4a16,rollout.stale_versions=4") == "combination"


def test_harshness_is_the_calibration_knobs_m_for_the_same_loss_over_the_candidates_m(bench):
    # hinge in ln(RKL + 0.1): plateau a, slope 1 beyond the knee at M = 1, so a loss q sits at M_eq = 1 + q
    bj = {"bracket": {"fit": {"a": -1.0, "b": 1.0, "k": 0.0}}}
    h = bench.harshness(bj, 0.5, 1.0, (0.5, 3.0), "reverse_kl")
    assert h["harshness"] == pytest.approx(2.0 / 0.5)  # the knob needs M = 2 for what this does at M = 0.5
    assert h["harshness_ci"] == pytest.approx([1.5 / 0.5, 4.0 / 0.5])
    none = bench.harshness(bj, 4.0, -0.1, (-0.3, 0.1), "reverse_kl")  # no loss: at most the knee's M over M
    assert none["harshness"] == pytest.approx(0.25) and none["harshness_ci"] == pytest.approx([0.0, 1.1 / 4.0])


def test_the_do_nothing_rules_score_what_the_runs_decided(bench):
    rows = [{"runs_verdict": v} for v in ("admit", "admit", "reject", "admit")]
    assert bench.trivial_scores(rows) == {"always_admit": 3, "always_reject": 1}

"""`opdjax bench` / `opdjax plan`: the steps factor from a study's points (measured and by M, with its bootstrap
interval), the per-step cost model, the table, and a real bench of the baseline and a candidate."""

import json

import numpy as np
import pytest

from opdjax.admission import plan as plan_mod
from opdjax.admission.budget import AdmissionError
from opdjax.admission.plan import PhaseTimes, bench, format_plan, plan, step_cost, steps_factor
from opdjax.cli.main import main


def _point(pid, knob, value, m, steps, total=80, group="sweep"):
    """A budget.json point whose seeds reached fraction 0.9 at `steps` (None: never reached)."""
    return {"id": pid, "group": group, "knob": knob, "value": value, "m_probe": m,
            "seeds": [{"seed": i, "steps_to_quality": {"0.5": 10, "0.9": s}, "train_steps": total}
                      for i, s in enumerate(steps)]}


POINTS = [_point("baseline", "baseline", 0, 1e-9, [20, 20, 30, 30]),
          _point("staleness=1", "staleness", 1, 0.02, [30, 30, 30, 30]),
          _point("weight_noise=0.5", "weight_noise", 0.5, 2.0, [40, 50, 50, 60]),
          _point("weight_noise=1.0", "weight_noise", 1.0, 20.0, [60, None, 70, 70])]


def test_the_steps_factor_of_a_trained_knob_is_the_ratio_of_mean_steps_with_a_bootstrap_interval():
    s, (lo, hi), source = steps_factor(POINTS, "rollout.stale_versions=1", m=0.5)
    assert s == pytest.approx(30 / 25) and source == "measured"  # measured: the candidate's M is not used
    assert 30 / 30 <= lo < s < hi <= 30 / 20


def test_the_steps_factor_of_another_candidate_is_interpolated_in_log_m_and_flags_censored_seeds():
    m = np.sqrt(2.0 * 20.0)  # halfway in log M between the two noise points
    s, _, source = steps_factor(POINTS, "rollout.recipe=fp8_w8a8", m=m)
    assert s == pytest.approx((0.5 * 50 + 0.5 * (60 + 80 + 70 + 70) / 4) / 25)  # the unreached seed counts 80 steps
    assert source == "by M + censored"
    s_low, _, src = steps_factor(POINTS, "rollout.recipe=fp8_w8a8", m=1e-12)  # below every point: the baseline
    assert (s_low, src) == (pytest.approx(1.0), "by M")
    with pytest.raises(AdmissionError, match="no steps-to-quality"):
        steps_factor([{**POINTS[0], "seeds": [{"seed": 0}]}], "rollout.recipe=fp8_w8a8", m=1.0)


def test_the_per_step_cost_is_sync_sum_or_the_ideal_async_overlap():
    base = PhaseTimes("baseline", generate=0.6, learner=0.4, step=1.0, steps=6)
    fp8 = PhaseTimes("rollout.recipe=fp8_w8a8", generate=0.3, learner=0.4, step=0.7, steps=6)
    assert step_cost(fp8, base, fp8.candidate) == (pytest.approx(0.7), "sync")
    stale = PhaseTimes("rollout.stale_versions=1", generate=0.6, learner=0.4, step=1.0, steps=6)
    assert step_cost(stale, base, stale.candidate) == (pytest.approx(0.6), "async (max_staleness 1)")
    both = "rollout.recipe=fp8_w8a8,rollout.stale_versions=2"
    assert step_cost(PhaseTimes(both, 0.3, 0.4, 0.7, 6), base, both)[0] == pytest.approx(0.4)


def test_plan_multiplies_the_two_factors_and_refuses_an_untimed_candidate():
    times = [PhaseTimes("baseline", 0.6, 0.4, 1.0, 6), PhaseTimes("rollout.stale_versions=1", 0.6, 0.4, 1.0, 6)]
    (row,) = plan([{"candidate": "rollout.stale_versions=1", "verdict": "ADMIT", "m": 0.02}], POINTS, times)
    assert row.ttq_factor == pytest.approx(1.2 * 0.6) and row.mode == "async (max_staleness 1)"
    assert row.ttq_factor_ci[0] < row.ttq_factor < row.ttq_factor_ci[1]
    assert "1.39x" in format_plan([row])  # speed-up 1 / 0.72
    with pytest.raises(AdmissionError, match="was not timed"):
        plan([{"candidate": "rollout.recipe=fp8_w8a8", "verdict": "ADMIT", "m": 0.1}], POINTS, times)


def test_the_plan_command_reads_the_three_reports(tmp_path, capsys):
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"metric": "k3", "budget": 5.0, "points": POINTS}))
    (tmp_path / "admit.json").write_text(json.dumps({"candidates": [
        {"candidate": "rollout.stale_versions=1", "verdict": "ADMIT", "m": 0.02},
        {"candidate": "rollout.weight_noise=1.0", "verdict": "REJECT", "m": 20.0}]}))
    (tmp_path / "bench.json").write_text(json.dumps({"rows": [
        {"candidate": "baseline", "generate": 0.6, "learner": 0.4, "step": 1.0, "steps": 6},
        {"candidate": "rollout.stale_versions=1", "generate": 0.6, "learner": 0.4, "step": 1.0, "steps": 6}]}))
    args = ["plan", "--study", str(budget), "--admission", str(tmp_path / "admit.json"), "--bench",
            str(tmp_path / "bench.json"), "--out", str(tmp_path / "plan.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rollout.stale_versions=1" in out and "weight_noise" not in out  # REJECT is not planned
    assert json.loads((tmp_path / "plan.json").read_text())["rows"][0]["ttq_factor"] == pytest.approx(0.72)
    (tmp_path / "bench.json").write_text(json.dumps({"rows": [{"candidate": "baseline"}]}))
    assert main(args) == 2
    assert "not `opdjax bench` output" in capsys.readouterr().err


def test_bench_times_the_baseline_and_a_candidate_through_the_pipeline(pair, tmp_path):
    over = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
            "rollout.max_new_tokens=4"]
    times = bench(["rollout.weight_noise=0.1"], overrides=over, steps=4, log=lambda s: None)
    assert [t.candidate for t in times] == ["baseline", "rollout.weight_noise=0.1"]
    for t in times:
        assert t.steps == 2 and t.generate > 0 and t.learner > 0 and t.step >= t.learner
    with pytest.raises(AdmissionError, match="--steps must be >= 3"):
        bench([], overrides=over, steps=2)
    assert plan_mod.LEARNER_PHASES == ("time/score", "time/train", "time/publish")

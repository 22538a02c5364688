"""Time-to-quality, steps-to-quality and AUC of synthetic evaluation curves, against closed-form values."""

import math

import pytest

from opdjax.pipeline.quality import quality_figures, to_quality

# (step, training seconds, reverse KL): 10 -> 6 -> 2 -> 1 -> 0 over 40 s; own final reference 0.
CURVE = [(0, 0.0, 10.0), (2, 10.0, 6.0), (4, 20.0, 2.0), (6, 30.0, 1.0), (8, 40.0, 0.0)]


def test_thresholds_and_auc_of_a_monotone_curve():
    q = to_quality(CURVE, 0.0)
    th = q["thresholds"]
    # progress p = (q - 10) / (0 - 10): 0, 0.4, 0.8, 0.9, 1.0
    assert (th["0.5"]["step"], th["0.5"]["seconds"]) == (4, 20.0)
    assert (th["0.8"]["step"], th["0.8"]["seconds"]) == (4, 20.0)
    assert (th["0.9"]["step"], th["0.9"]["seconds"]) == (6, 30.0)
    assert (th["0.95"]["step"], th["0.95"]["seconds"]) == (8, 40.0)
    assert th["0.9"]["quality"] == pytest.approx(1.0) and th["0.9"]["reached"] == "reached"
    # trapezoids of width 10: (0+.4)/2 + (.4+.8)/2 + (.8+.9)/2 + (.9+1)/2 = 2.6, times 10, over 40 s
    assert q["auc"] == pytest.approx(26.0 / 40.0)
    assert q["reference_from"] == "own final" and q["initial"] == 10.0 and q["train_seconds"] == 40.0


def test_a_threshold_beyond_the_curve_is_not_reached():
    q = to_quality(CURVE, -10.0, reference_from="baseline final")  # the baseline went twice as far
    th = q["thresholds"]
    assert th["0.5"]["step"] == 8 and th["0.5"]["seconds"] == 40.0  # p = 0.5 only at the end
    for f in ("0.8", "0.9", "0.95"):
        assert th[f] == {"quality": pytest.approx(10.0 - 20.0 * float(f)), "reached": "not reached",
                         "step": None, "seconds": None}
    # p = 0, .2, .4, .45, .5: (0.2 + 0.6 + 0.85 + 0.95) / 2 * 10 / 40
    assert q["auc"] == pytest.approx(13.0 / 40.0)


def test_the_first_crossing_counts_on_a_non_monotone_curve():
    curve = [(0, 0.0, 10.0), (1, 5.0, 0.5), (2, 10.0, 8.0), (3, 15.0, 0.0)]
    q = to_quality(curve, 0.0)
    assert q["thresholds"]["0.95"]["step"] == 1 and q["thresholds"]["0.95"]["seconds"] == 5.0
    # p = 0, .95, .2, 1
    assert q["auc"] == pytest.approx((0.95 + 1.15 + 1.2) / 2 * 5 / 15)


def test_progress_is_clipped_in_the_area_and_higher_is_better_works():
    curve = [(0, 0.0, 0.2), (1, 1.0, 1.0), (2, 2.0, 0.0)]  # accuracy overshoots, then falls below the start
    q = to_quality(curve, 0.6, lower_is_better=False)
    assert q["thresholds"]["0.5"]["step"] == 1  # p = 0, 2, -0.5 -> clipped 0, 1, 0
    assert q["auc"] == pytest.approx(0.5)


def test_a_reference_no_better_than_the_start_defines_no_threshold():
    q = to_quality([(0, 0.0, 1.0), (1, 3.0, 2.0)], 2.0)  # reverse KL went up
    assert q["auc"] is None and "not better" in q["why"]
    assert all(t["reached"] == "undefined" and t["step"] is None for t in q["thresholds"].values())


def test_quality_figures_skip_ungraded_accuracy_and_curves_without_clocks():
    rows = [[0, 10.0, math.nan, 0.0], [2, 5.0, math.nan, 4.0], [4, 0.0, math.nan, 8.0]]
    figs = quality_figures(rows)
    assert list(figs) == ["eval/reverse_kl"] and figs["eval/reverse_kl"]["thresholds"]["0.5"]["step"] == 2
    graded = [[0, 10.0, 0.0, 0.0], [2, 5.0, 0.5, 4.0], [4, 0.0, 0.5, 8.0]]
    figs = quality_figures(graded, {"eval/reverse_kl": 0.0, "eval/accuracy": 1.0}, reference_from="baseline final")
    assert figs["eval/accuracy"]["thresholds"]["0.5"]["step"] == 2
    assert figs["eval/accuracy"]["thresholds"]["0.8"]["reached"] == "not reached"
    assert quality_figures([[0, 10.0, 0.0, math.nan], [2, 5.0, 0.5, math.nan]]) == {}

"""benchmarks/refit_budget.py: a finished study refitted on its own quality and delta gives its own B and interval
back (the committed qwen3 sort-8 study of the 40-step instrument); on accuracy it gives another budget, from the same runs."""

import json
import pathlib

import pytest

from tests.benchmarks.conftest import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]
STUDY = ROOT / "docs" / "results" / "budget_sort_cpu_40steps" / "budget.json"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("refit_budget")


def test_refit_on_the_study_own_quality_returns_its_budget(bench):
    result = json.loads(STUDY.read_text())
    r = bench.refit(result, result["config"]["study"]["quality"], result["delta"])
    assert r["runs"] == 64 and r["resolved"]
    assert r["budget"] == pytest.approx(result["budget"], rel=1e-12)
    assert r["interval"] == pytest.approx(result["budget_interval"], rel=1e-12)


def test_refit_on_accuracy_is_another_budget_and_the_cli_prints_it(bench, capsys):
    r = bench.refit(json.loads(STUDY.read_text()), "accuracy", 0.05)
    assert r["resolved"] and 1.0 < r["budget"] < 10.0 and r["interval"][0] <= r["budget"] <= r["interval"][1]
    assert bench.main([str(STUDY), "--quality", "accuracy", "--delta", "0.05"]) == 0
    assert "accuracy delta 0.05, 64 runs: B = " in capsys.readouterr().out

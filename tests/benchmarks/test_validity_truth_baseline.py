"""benchmarks/validity_truth_baseline.py: re-judging a validity run against the study's own baseline gives back its
committed q_loss, CI, verdicts and agreement; against another baseline the losses move and the verdicts follow."""

import json
import pathlib

import pytest

from tests.benchmarks.conftest import load_benchmark

OUT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "budget_scaling" / "sort16_qwen3"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("validity_truth_baseline")


@pytest.mark.parametrize("validity", ["validity.json", *(f"validity_fresh{s}/validity.json" for s in (
    "", "2", "3", "_trainview", "2_trainview", "3_oldrule"))])
def test_rejudging_against_the_study_baseline_gives_back_the_committed_truth(bench, validity):
    v = json.loads((OUT / validity).read_text())
    bj = json.loads((OUT / "budget.json").read_text())
    rows = bench.rejudge(v["rows"], bj["baseline"], bj["delta"])
    for new, old in zip(rows, v["rows"]):
        assert new["q_loss"] == pytest.approx(old["q_loss"], rel=1e-9), old["candidate"]
        assert new["q_loss_ci"] == pytest.approx(old["q_loss_ci"], rel=1e-9), old["candidate"]
        assert (new["runs_verdict"], new["agree"]) == (old["runs_verdict"], old["agree"]), old["candidate"]


def test_a_worse_baseline_shrinks_every_loss(bench):
    v = json.loads((OUT / "validity.json").read_text())
    bj = json.loads((OUT / "budget.json").read_text())
    worse = dict(bj["baseline"], reverse_kl_seeds=[x + 0.1 for x in bj["baseline"]["reverse_kl_seeds"]])
    rows = bench.rejudge(v["rows"], worse, bj["delta"])
    assert all(new["q_loss"] < old["q_loss"] for new, old in zip(rows, v["rows"]))

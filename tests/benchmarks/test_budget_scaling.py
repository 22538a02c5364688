"""benchmarks/budget_scaling.py: the committed variants give back the committed laws, and a variant's overrides
are the instrument's with its length, family, size, levels and seeds."""

import json
import pathlib

import pytest

from tests.benchmarks.conftest import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "results" / "budget_scaling"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("budget_scaling")


def test_a_variant_overrides_the_instrument_with_its_own_knobs(bench):
    v = bench.Variant(16, "llama", levels=(0.25, 0.5), seeds=2, baseline_seeds=4, staleness=(2, 4))
    assert v.name == "sort16_llama" and bench.Variant(8, size="tiny").name == "sort8_qwen3_tiny"
    assert v.overrides() == ["seeds=[0, 1]", "baseline_seeds=[0, 1, 2, 3]", "base.task.options.length=16",
                             "base.rollout.max_new_tokens=40", "base.prepare.family=llama",
                             "base.prepare.teacher_size=small", "weight_noise=[0,0.25,0.5]", "staleness=[2, 4]"]


def test_the_committed_variants_give_back_the_committed_length_law(bench):
    committed = json.loads((OUT / "fit.json").read_text())
    vs = [bench.load_variant(f) for f in sorted(OUT.iterdir()) if (f / "candidates.json").is_file()]
    law = next(x for x in committed["laws"] if x["axis"] == "length" and x["label"] == "family=qwen3 size=small")
    members = [v for v in vs if f"family={v['family']} size={v['size']}" == law["label"]]
    fitted, _ = bench.budget_law(members, "L")
    assert fitted["slope"] == pytest.approx(law["slope"], rel=1e-9)
    assert fitted["slope_ci"] == pytest.approx(law["slope_ci"], rel=1e-9)
    assert law["slope_ci"][1] < 0  # B falls as responses lengthen, on the committed data

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


def test_the_committed_variants_give_back_every_committed_law(bench):
    committed = json.loads((OUT / "fit.json").read_text())
    vs = [bench.load_variant(f) for f in sorted(OUT.iterdir()) if (f / "candidates.json").is_file()]
    assert {(x["axis"], x["label"]) for x in committed["laws"]} >= {("length", "family=qwen3 size=small")}
    for law in committed["laws"]:
        fixed = dict(kv.split("=") for kv in law["label"].split())
        members = [v for v in vs if all(str(v[k]) == val for k, val in fixed.items())]
        fitted, _ = bench.budget_law(members, law["key"])
        assert fitted["slope"] == pytest.approx(law["slope"], rel=1e-9), law["label"]
        assert fitted["slope_ci"] == pytest.approx(law["slope_ci"], rel=1e-9), law["label"]
    qwen3 = next(x for x in committed["laws"] if x["axis"] == "length" and x["label"] == "family=qwen3 size=small")
    assert qwen3["slope_ci"][1] < 0  # B falls as responses lengthen, on the committed data

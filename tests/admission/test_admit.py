"""Admission check, recipe search and capacity accounting: verdict logic, exit codes, greedy search with a fake
probe whose M is a known function of the recipe, vLLM settings, capacity vs closed form, and one real probe on
tiny random models."""

import argparse
import dataclasses
import hashlib
import json
import math
import pathlib

import pytest

from opdjax import quant
from opdjax.admission import admit, records, search
from opdjax.admission import budget as bio
from opdjax.admission import probe as probe_mod
from opdjax.admission.budget import AdmissionError, Budget, load_budget
from opdjax.cli import admission as cli_admission
from opdjax.core import layout
from opdjax.models import presets
from opdjax.models.tiny import tiny_config

# ------------------------------------------------------------------------------------------------------ fakes


@dataclasses.dataclass
class FakeResult:
    metric: str
    m: float
    ci_low: float
    ci_high: float
    metrics: dict
    seconds: float = 0.01
    tokens: int = 100
    batches: int = 1
    reason: str = ""


MCFG = tiny_config("qwen3", "small")  # 4 layers


def fake_m(cfg) -> float:
    """M of the engine config: each FP8-quantized layer i adds 0.01 * 2**-i, the FP8 KV cache adds 0.004,
    weight noise sigma adds sigma; known, additive, and independent of sampling."""
    r = cfg.rollout
    recipe = quant.as_recipe(r.recipe)
    m = r.weight_noise
    for i in range(MCFG.num_layers):
        if quant.module_spec(recipe, f"model.layers.{i}.mlp.down_proj") is not None:
            m += 0.01 * 2.0 ** -i
    if recipe.kv_cache is not None:
        m += 0.004
    return m


class FakeProbe:
    def __init__(self, half_width=0.1):
        self.calls = []
        self.half_width = half_width

    def __call__(self, cfg, budget=None, *, batches=4, metric="k3", seed=0, log=print, **sequential):
        self.calls.append(cfg)
        m = fake_m(cfg)
        return FakeResult(metric, m, m * (1 - self.half_width), m * (1 + self.half_width), {metric: m})


def write_budget(tmp_path, **d):
    p = tmp_path / "budget.json"
    p.write_text(json.dumps({"metric": "k3", "budget": 0.01, "delta": 0.25, "points": [], **d}))
    return str(p)


def parser():
    p = argparse.ArgumentParser(prog="opdjax")
    sub = p.add_subparsers(dest="command", required=True)
    cli_admission.add_admission_commands(sub)
    return p


def run_cli(argv, monkeypatch, probe=None):
    if probe is not None:
        monkeypatch.setattr(probe_mod, "probe", probe)
        monkeypatch.setattr(probe_mod, "probe_sequential", probe)
    args = parser().parse_args(argv)
    return args.func(args)


# ------------------------------------------------------------------------------------------------------ verdict


@pytest.mark.parametrize("lo,hi,v", [(0.001, 0.009, "ADMIT"), (0.001, 0.01, "ADMIT"), (0.011, 0.02, "REJECT"),
                                     (0.005, 0.02, "UNCERTAIN"), (0.01, 0.02, "UNCERTAIN"),
                                     (float("nan"), float("nan"), "UNCERTAIN")])
def test_verdict_compares_the_whole_ci_with_the_budget(lo, hi, v):
    assert admit.verdict(lo, hi, 0.01) == v


# B's interval [0.008, 0.012]: ADMIT needs M's upper bound at or below its lower end, REJECT M's lower bound beyond
# its upper end; everything between (M's bounds overlapping B's) is UNCERTAIN.
@pytest.mark.parametrize("lo,hi,v", [(0.001, 0.008, "ADMIT"), (0.001, 0.0081, "UNCERTAIN"),
                                     (0.0121, 0.02, "REJECT"), (0.012, 0.02, "UNCERTAIN"),
                                     (0.0101, 0.0119, "UNCERTAIN"), (0.009, 0.011, "UNCERTAIN")])
def test_verdict_against_b_interval_decides_only_beyond_its_edges(lo, hi, v):
    assert admit.verdict(lo, hi, 0.008, 0.012) == v
    assert admit.verdict(lo, hi, 0.01) == ("ADMIT" if hi <= 0.01 else "REJECT" if lo > 0.01 else "UNCERTAIN")


def test_admit_decides_against_the_budgets_interval_and_reports_it(tmp_path, monkeypatch, capsys):
    """A candidate beyond the point B but inside B's upper uncertainty is not REJECTed, and one below B but above
    its lower end is not ADMITted (the qwen3 case: M 9.0 inside B's [4.99, 9.78] was REJECTed against B = 7.57)."""
    out = tmp_path / "report.json"
    args = ["rollout.weight_noise=0.005", "rollout.weight_noise=0.0075", "rollout.weight_noise=0.0115",
            "rollout.weight_noise=0.02"]  # bounds +-10%: [0.0045, 0.0055], [0.00675, 0.00825], [0.01035, ...]
    point = write_budget(tmp_path, budget=0.01)
    run_cli(["admit", "--budget", point, "--out", str(out), *args], monkeypatch, FakeProbe())
    assert [c["verdict"] for c in json.loads(out.read_text())["candidates"]] == ["ADMIT", "ADMIT", "REJECT", "REJECT"]
    band = write_budget(tmp_path, budget=0.01, budget_interval=[0.008, 0.012])
    assert run_cli(["admit", "--budget", band, "--out", str(out), *args], monkeypatch, FakeProbe()) == 1
    rows = json.loads(out.read_text())["candidates"]
    assert [c["verdict"] for c in rows] == ["ADMIT", "UNCERTAIN", "UNCERTAIN", "REJECT"]
    assert rows[1]["budget_interval"] == [0.008, 0.012]
    assert "B = 1.000e-02 [8.000e-03, 1.200e-02]: ADMIT below its lower end" in capsys.readouterr().out
    for bad in ([0.011, 0.012], [0.008], [0.008, float("inf")], "wide"):
        with pytest.raises(AdmissionError, match="'budget_interval' must be"):
            load_budget(write_budget(tmp_path, budget=0.01, budget_interval=bad))


def test_admit_says_what_training_sees_where_the_study_trained_the_candidates_kind(tmp_path, monkeypatch, capsys):
    study = tmp_path / "study.json"
    study.write_text(json.dumps({"points": [{"id": "staleness=1", "group": "sweep", "knob": "staleness", "value": 1,
                                             "m_probe": 0.02, "m_train": 0.002}]}))
    out = tmp_path / "report.json"
    args = ["admit", "--budget", write_budget(tmp_path, budget=0.01), "--study", str(study), "--out", str(out),
            "rollout.weight_noise=0.005,rollout.stale_versions=1", "rollout.stale_versions=1"]
    run_cli(args, monkeypatch, FakeProbe())
    rows = json.loads(out.read_text())["candidates"]
    assert rows[0]["training"] == ""  # two knobs: no single study point speaks for it
    assert "training sees about M x 0.1" in rows[1]["training"] and "staleness=1" in rows[1]["training"]
    assert "the verdict stays on the probe's M" in capsys.readouterr().out
    assert run_cli([*args[:4], str(tmp_path / "missing.json"), *args[5:]], monkeypatch, FakeProbe()) == 2
    assert "study file" in capsys.readouterr().err


def test_exit_code_is_zero_only_when_every_candidate_is_admitted():
    row = lambda v: records.AdmitRow("c", [], "k3", 0, 0, 0, 1, v, 0, 0)  # noqa: E731
    assert admit.exit_code([row("ADMIT"), row("ADMIT")]) == 0
    assert admit.exit_code([row("ADMIT"), row("UNCERTAIN")]) == 1
    assert admit.exit_code([row("REJECT")]) == 1
    assert admit.exit_code([]) == 1


def test_split_candidate_keeps_mappings_whole_and_rejects_garbage():
    assert admit.split_candidate("rollout.weight_noise=0.05,rollout.stale_versions=1") == [
        "rollout.weight_noise=0.05", "rollout.stale_versions=1"]
    assert admit.split_candidate("rollout.engine=vllm,rollout.vllm={kv_cache_dtype: fp8, max_num_seqs: 8}") == [
        "rollout.engine=vllm", "rollout.vllm={kv_cache_dtype: fp8, max_num_seqs: 8}"]
    for bad in ("", "rollout.recipe", "a=1,,b=2", "x={a: 1", "=3"):
        with pytest.raises(AdmissionError):
            admit.split_candidate(bad)


def test_load_budget_errors_name_the_problem(tmp_path):
    with pytest.raises(AdmissionError, match="does not exist"):
        bio.load_budget(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AdmissionError, match="not valid JSON"):
        bio.load_budget(bad)
    bad.write_text(json.dumps({"metric": "k3"}))
    with pytest.raises(AdmissionError, match="missing key"):
        bio.load_budget(bad)
    bad.write_text(json.dumps({"metric": "k3", "budget": "big"}))
    with pytest.raises(AdmissionError, match="finite number"):
        bio.load_budget(bad)
    bad.write_text(json.dumps({"metric": "nonsense_metric", "budget": 0.1}))
    with pytest.raises(AdmissionError, match="'metric' must be one of"):  # at load, not after a probe
        bio.load_budget(bad)
    b = bio.load_budget(write_budget(tmp_path, budget=0.02))
    assert (b.metric, b.budget, b.delta) == ("k3", 0.02, 0.25)


POINTS = [{"id": "baseline", "knob": "baseline", "m_probe": 9.7e-13},
          {"id": "a", "knob": "weight_noise", "m_probe": 1.78},
          {"id": "b", "knob": "weight_noise", "m_probe": None},
          {"id": "c", "knob": "weight_noise", "m_probe": 15.4}]


def test_a_budget_beyond_its_own_calibration_points_is_refused_in_one_line(tmp_path, capsys):
    """Issue 38 row 7: a budget.json whose B is 1e308 admitted everything. B is the knee between measured points,
    so it cannot exceed the largest M its study measured: refused at load, in one line naming the file."""
    from opdjax.cli.main import main

    for b in (1e308, 15.5):
        p = write_budget(tmp_path, budget=b, points=POINTS)
        with pytest.raises(AdmissionError, match=r"budget\.json: 'budget' B = .* is above the largest M its study "
                                                 r"measured \(15\.4 over 3 points\); expected B <= 15\.4"):
            bio.load_budget(p)
    assert main(["admit", "--budget", p, "rollout.weight_noise=0.01"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and p in err[0] and "expected B <= 15.4" in err[0], err
    assert bio.load_budget(write_budget(tmp_path, budget=15.4, points=POINTS)).budget == 15.4
    assert bio.load_budget(write_budget(tmp_path, budget=7.5, points=POINTS)).budget == 7.5
    for bad in ({"points": {"a": 1}}, {"points": [1.0]}, {"points": [{"m_probe": "x"}]}):
        with pytest.raises(AdmissionError, match="'points'"):
            bio.load_budget(write_budget(tmp_path, **bad))


def test_every_shipped_resolved_budget_passes_its_own_points_check():
    root = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results"
    shipped = sorted(root.glob("*/budget.json"))
    assert shipped
    for f in shipped:
        if json.loads(f.read_text()).get("status") != "UNRESOLVED":
            assert bio.load_budget(f).budget > 0


# ------------------------------------------------------------------------------------------------------ admit CLI


def test_admit_cli_verdicts_report_and_exit_codes(tmp_path, monkeypatch, capsys):
    budget = write_budget(tmp_path, budget=0.01)
    out = tmp_path / "report.json"
    probe = FakeProbe()
    # noise 0.005 -> [0.0045, 0.0055] ADMIT; 0.02 -> REJECT; 0.0095 -> [0.00855, 0.01045] UNCERTAIN
    rc = run_cli(["admit", "--budget", budget, "--out", str(out), "rollout.weight_noise=0.005",
                  "rollout.weight_noise=0.02", "rollout.weight_noise=0.0095,rollout.stale_versions=1"],
                 monkeypatch, probe)
    assert rc == 1
    rep = json.loads(out.read_text())
    assert [c["verdict"] for c in rep["candidates"]] == ["ADMIT", "REJECT", "UNCERTAIN"]
    assert rep["candidates"][2]["overrides"] == ["rollout.weight_noise=0.0095", "rollout.stale_versions=1"]
    assert probe.calls[2].rollout.stale_versions == 1
    assert {"candidate", "m", "ci_low", "ci_high", "verdict", "seconds"} <= set(rep["candidates"][0])
    out_text = capsys.readouterr().out
    assert "UNCERTAIN" in out_text and "batches" in out_text
    assert "rollout.weight_noise=0.02: REJECT: M 2.000e-02" in out_text  # one line per candidate: why
    assert "the bounds still contain B = 1.000e-02 at the cap of 6 batches" in rep["candidates"][2]["reason"]
    assert rep["candidates"][0]["batches"] == 1 and rep["candidates"][0]["risk"] == 0.05
    assert run_cli(["admit", "--budget", budget, "rollout.weight_noise=0.001"], monkeypatch, probe) == 0


def test_admit_cli_usage_errors_exit_2(tmp_path, monkeypatch, capsys):
    probe = FakeProbe()
    assert run_cli(["admit", "--budget", str(tmp_path / "missing.json"), "rollout.weight_noise=0.1"],
                   monkeypatch, probe) == 2
    budget = write_budget(tmp_path)
    assert run_cli(["admit", "--budget", budget, "rollout.wieght_noise=0.1"], monkeypatch, probe) == 2
    assert "did you mean 'rollout.weight_noise'" in capsys.readouterr().err
    assert run_cli(["admit", "--budget", budget, "rollout.recipe=fp9"], monkeypatch, probe) == 2
    assert run_cli(["admit", "--budget", budget, "--risk", "0.7", "rollout.weight_noise=0.1"], monkeypatch, probe) == 2
    assert "--risk must be in (0, 0.5)" in capsys.readouterr().err
    assert run_cli(["admit", "--budget", budget, "--max-batches", "0", "rollout.weight_noise=0.1"], monkeypatch,
                   probe) == 2
    assert probe.calls == []  # nothing probed: every candidate is validated first


def test_admit_probes_on_the_setup_the_budget_recorded_unless_told_otherwise(tmp_path, monkeypatch, capsys):
    """A budget holds for the setup its study trained: without --config, candidates are layered on the study's
    recorded train config; --set and the candidate go on top; --config replaces it; a budget without one (older
    files) falls back to the defaults."""
    recorded = {"task": {"name": "sort", "options": {"length": 5}}, "optim": {"lr": 1.5e-4},
                "rollout": {"batch_size": 12, "max_new_tokens": 9}}
    budget = write_budget(tmp_path, config={"base_train_config": recorded})
    probe = FakeProbe()
    assert run_cli(["admit", "--budget", budget, "--set", "rollout.batch_size=16", "rollout.weight_noise=0.001"],
                   monkeypatch, probe) == 0
    cfg = probe.calls[-1]
    assert (cfg.task.name, cfg.task.options, cfg.optim.lr) == ("sort", {"length": 5}, 1.5e-4)
    assert (cfg.rollout.batch_size, cfg.rollout.max_new_tokens, cfg.rollout.weight_noise) == (16, 9, 0.001)
    assert "probing on the setup" in capsys.readouterr().err
    assert recorded["rollout"] == {"batch_size": 12, "max_new_tokens": 9}  # the budget's mapping is not changed
    other = tmp_path / "other.yaml"
    other.write_text("rollout:\n  max_new_tokens: 7\n")
    run_cli(["admit", "--budget", budget, "--config", str(other), "rollout.weight_noise=0.001"], monkeypatch, probe)
    default = admit.candidate_config(None, [])
    assert (probe.calls[-1].rollout.max_new_tokens, probe.calls[-1].task) == (7, default.task)
    run_cli(["admit", "--budget", write_budget(tmp_path), "rollout.weight_noise=0.001"], monkeypatch, probe)
    assert probe.calls[-1].task == default.task and "probing on the setup" not in capsys.readouterr().err


def test_a_budget_whose_recorded_config_does_not_load_says_so(tmp_path, monkeypatch, capsys):
    probe = FakeProbe()
    budget = write_budget(tmp_path, config={"base_train_config": {"rollout": {"batch_sise": 4}}})
    assert run_cli(["admit", "--budget", budget, "rollout.weight_noise=0.001"], monkeypatch, probe) == 2
    err = capsys.readouterr().err
    assert "the train config its study recorded does not load" in err and "batch_sise" in err
    assert probe.calls == []
    with pytest.raises(AdmissionError, match="'config.base_train_config' must be an object"):
        bio.load_budget(write_budget(tmp_path, config={"base_train_config": [1]}))


# ------------------------------------------------------------------------------------------------------ recipes


def test_unit_recipes_quantize_exactly_their_modules():
    mods = layout.linear_modules(MCFG)
    for by in ("layer", "module", "group", "layer-group"):
        us = search.units(MCFG.num_layers, by)
        covered = []
        for u in us[:-1]:
            r = search.unit_recipe(u)
            q = [m for m in mods if quant.module_spec(r, m) is not None]
            assert q and r.activations is not None and r.kv_cache is None
            covered += q
        assert sorted(covered) == sorted(mods)  # the units partition the decoder linears
        assert us[-1].kv and search.unit_recipe(us[-1]).kv_cache is not None
    full = search.full_fp8_recipe()
    ref = quant.RECIPES["fp8_w8a8_kv"]
    assert all(quant.module_spec(full, m) == quant.module_spec(ref, m) for m in mods + ["lm_head"])
    assert (full.activations, full.kv_cache, full.kv_scale) == (ref.activations, ref.kv_cache, ref.kv_scale)


def test_vllm_settings_list_kept_modules_and_refuse_split_fused_layers():
    keep = [u for u in search.units(MCFG.num_layers, "layer") if u.label == "layer0"]
    s = search.vllm_settings(MCFG, search.full_fp8_recipe(keep))
    assert s["quantization"] == "fp8_per_tensor" and s["kv_cache_dtype"] == "fp8"
    assert sorted(s["quantization_config"]["ignore"]) == sorted(
        m for m in layout.linear_modules(MCFG) if m.startswith("model.layers.0."))
    split = search.full_fp8_recipe([search.Unit("q0", ("model.layers.0.self_attn.q_proj",))])
    with pytest.raises(AdmissionError, match="fused qkv"):
        search.vllm_settings(MCFG, split)
    assert search.vllm_settings(MCFG, quant.RECIPES["none"]) == {"kv_cache_dtype": "auto"}
    calibrated = search.full_fp8_recipe(keep, kv_scales=[0.01] * MCFG.num_layers)
    with pytest.raises(AdmissionError, match="calibrated per-layer scales are read only from"):
        search.vllm_settings(MCFG, calibrated)


def test_recipe_search_with_calibrated_kv_scales_keeps_them_and_says_vllm_cannot_take_them(tmp_path):
    scales = tuple((0.01 * (i + 1), 0.02) for i in range(MCFG.num_layers))
    res = search.recipe_search(admit.candidate_config(None, []), Budget("k3", 0.03, None), margin=0.8,
                                  probe_fn=FakeProbe(0.0), mcfg=MCFG, kv_scales=scales, log=lambda s: None)
    assert res.recipe.kv_scales == scales and res.recipe.kv_scale is None
    assert "unsupported" in res.vllm and res.capacity["ratio"] > 1.9
    paths = search.write_search(res, Budget("k3", 0.03, None), 0.8, tmp_path / "rs")
    assert quant.Recipe.from_dict(json.loads(open(paths["recipe"]).read())).kv_scales == scales


def test_recipe_search_keeps_sensitive_layers_and_its_recipe_is_admitted(tmp_path, monkeypatch):
    budget = Budget("k3", 0.01, 0.25)
    probe = FakeProbe(half_width=0.05)
    cfg = admit.candidate_config(None, [])
    res = search.recipe_search(cfg, budget, margin=0.8, probe_fn=probe, mcfg=MCFG, log=lambda s: None)
    # full FP8: 0.01875 + 0.004. Keeping layer0 (0.01) leaves 0.01275 > 0.008; + layer1 -> 0.00775 fits;
    # re-quantizing layer0 alone does not fit (0.01275), so both stay; the KV cache stays FP8.
    assert res.fits and res.kept == ["layer0", "layer1"]
    assert res.m == pytest.approx(0.00775)
    assert res.capacity["ratio"] > 1.9
    paths = search.write_search(res, budget, 0.8, tmp_path / "rs")
    loaded = quant.Recipe.from_dict(json.loads(open(paths["recipe"]).read()))
    assert loaded == res.recipe
    vllm = json.loads(open(paths["vllm"]).read())
    assert all(m.startswith(("model.layers.0.", "model.layers.1.")) for m in vllm["quantization_config"]["ignore"])
    # the written file is usable as rollout.recipe and admitted with the same budget
    bfile = write_budget(tmp_path, budget=0.01)
    assert run_cli(["admit", "--budget", bfile, f"rollout.recipe={paths['recipe']}"], monkeypatch, FakeProbe()) == 0


def test_recipe_search_gives_back_units_that_are_not_needed():
    """Greedy by sensitivity keeps layer0 then the KV cache; once it fits, layer0 is re-quantized if M allows."""
    budget = Budget("k3", 0.03, None)
    res = search.recipe_search(admit.candidate_config(None, []), budget, margin=0.8, probe_fn=FakeProbe(0.0),
                                  mcfg=MCFG, log=lambda s: None)
    assert res.fits and res.kept == [] and res.m == pytest.approx(0.02275)
    b2 = Budget("k3", 0.0225, None)  # target 0.018: keep layer0 -> 0.01275 fits, nothing to give back
    res2 = search.recipe_search(admit.candidate_config(None, []), b2, margin=0.8, probe_fn=FakeProbe(0.0),
                                   mcfg=MCFG, log=lambda s: None)
    assert res2.kept == ["layer0"]


# ------------------------------------------------------------------------------------------------------ capacity


def test_capacity_matches_closed_form():
    mcfg = presets.model_config("llama3-8b")
    mem = 80 * 2**30
    E, F, L, V = 4096, 14336, 32, 128256
    linear = L * (E * 4096 + 2 * E * 1024 + 4096 * E + 3 * E * F)  # q, k, v, o, gate, up, down
    other = 2 * V * E + L * 2 * E + E  # embed + lm_head, norms, final norm
    bf16_w = 2 * (linear + other)
    fp8_w = linear + 4 * 7 * L + 2 * other  # one f32 scale per tensor
    bf16_tok = (mem - bf16_w) // (2 * L * 8 * 128 * 2)
    fp8_tok = (mem - fp8_w) // (2 * L * 8 * 128 * 1)
    rep = search.capacity_report(mcfg, quant.RECIPES["fp8_w8a8_kv"], mem)
    assert rep["bf16"]["weight_bytes"] == bf16_w and rep["recipe_side"]["weight_bytes"] == fp8_w
    assert rep["bf16"]["kv_tokens"] == bf16_tok and rep["recipe_side"]["kv_tokens"] == fp8_tok
    assert rep["ratio"] == pytest.approx(fp8_tok / bf16_tok) and rep["ratio"] >= 1.93


def test_capacity_cli_and_bad_model(monkeypatch, capsys):
    assert run_cli(["capacity", "--model", "qwen3-8b", "--memory-gb", "80"], monkeypatch) == 0
    assert "capacity ratio" in capsys.readouterr().out
    assert run_cli(["capacity", "--model", "no-such-model"], monkeypatch) == 2
    assert run_cli(["capacity", "--model", "small", "--recipe", "fp9"], monkeypatch) == 2


# ------------------------------------------------------------------------------------------------------ real probe


@pytest.mark.slow  # the real sequential probe, many batches (~25 s)
def test_admit_with_the_real_sequential_probe_stops_early_far_from_b_and_samples_to_the_cap_near_it(pair, tmp_path):
    glob = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
            "rollout.max_new_tokens=4", "pipeline.progress=false", "pipeline.tensorboard=false"]
    rows = admit.admit(["rollout.recipe=none", "rollout.recipe=fp8_w8a8_kv"], Budget("k3", 1e-6), overrides=glob,
                       max_batches=6, log=lambda s: None)
    assert rows[0].verdict == "ADMIT" and rows[0].m < 1e-6
    assert rows[1].m > 1e-5 and rows[1].verdict == "REJECT"
    assert rows[0].batches == rows[1].batches == 4  # the first look (32 sequences): far from B, no more sampling
    assert admit.exit_code(rows) == 1
    near = admit.admit(["rollout.recipe=fp8_w8a8_kv"], Budget("k3", rows[1].m), overrides=glob, max_batches=6,
                       log=lambda s: None)  # B at the candidate's own M: sampled to the cap, then UNCERTAIN
    assert near[0].verdict == "UNCERTAIN" and near[0].batches == 6 and near[0].tokens > rows[1].tokens
    assert near[0].ci_low < rows[1].m < near[0].ci_high and "at the cap of 6 batches" in near[0].reason


def test_cache_amax_matches_transformers_kv_cache(pair):
    """Per-layer max |K| / |V| of our KV cache equals that of transformers' own cache (post-RoPE keys)."""
    import numpy as np
    import torch
    import transformers

    from opdjax.admission.probe import cache_amax
    from opdjax.models import ModelConfig, hf

    mcfg = ModelConfig.from_dir(pair[0])
    graphdef, params = hf.load_state(pair[0], mcfg)
    tokens = np.random.default_rng(0).integers(3, mcfg.vocab_size, (2, 9))
    ours = cache_amax(graphdef, params, mcfg, tokens, np.ones_like(tokens, bool))
    model = transformers.AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.as_tensor(tokens), use_cache=True).past_key_values
    ref = np.array([[layer.keys.abs().max().item(), layer.values.abs().max().item()] for layer in cache.layers])
    np.testing.assert_allclose(ours, ref, rtol=1e-4)


def test_calibrated_kv_scales_are_probed_as_a_recipe(pair):
    """kv_amax -> calibrate_kv -> a recipe with per-layer KV scales, probed like any other FP8-KV recipe.

    Whether calibration lowers M depends on the model: it helps where K/V fall among e4m3's subnormals under vLLM's
    fixed scale 1.0 (`tests/quant/test_hooks.py::test_calibrated_kv_scales_keep_small_values_out_of_the_subnormals`).
    This random tiny pair's K/V reach 3.5 and 0.6, where e4m3's relative precision is the same at any scale, and
    the two M differ by sampling noise only (8.4e-6 vs 8.7e-6, either order by seed), so no order is asserted."""
    from opdjax.admission.probe import kv_amax, probe

    glob = [f"student={pair[0]}", f"teacher={pair[1]}", "task.options={digits: 1}", "rollout.batch_size=8",
            "rollout.max_new_tokens=4", "pipeline.progress=false", "pipeline.tensorboard=false"]
    cfg = admit.candidate_config(None, glob)
    amax = kv_amax(cfg, batches=1, log=lambda s: None)
    assert amax.shape == (tiny_config("qwen3", "tiny").num_layers, 2) and (amax > 0).all()
    scales = probe_mod.calibrate_kv(cfg, batches=1)
    assert scales == quant.calibrate_kv_scales(amax)
    kv = search.Unit(search.KV, kv=True)
    fixed = search._probe_recipe(cfg, search.unit_recipe(kv), probe, batches=2, metric="k3", seed=0)
    cal = search._probe_recipe(cfg, search.unit_recipe(kv, kv_scales=scales), probe, batches=2, metric="k3",
                               seed=0)
    assert 0 < cal.m < 1e-3 and 0 < fixed.m < 1e-3 and cal.m != fixed.m  # both quantize, differently


# ------------------------------------------------------------------------------------------------------ calibration


def _sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def test_setup_fingerprint_hashes_the_student_and_teacher_weights(pair):
    fp = bio.setup_fingerprint(admit.candidate_config(None, [f"student={pair[0]}", f"teacher={pair[1]}"]),
                                     log=lambda m: None)
    assert fp["student_sha256"] == _sha256(f"{pair[0]}/model.safetensors")
    assert fp["teacher_sha256"] == _sha256(f"{pair[1]}/model.safetensors") != fp["student_sha256"]
    assert fp["jax"] and fp["machine"] and fp["task"]["name"] == "addition"


def test_calibration_warning_names_the_setup_that_differs(tmp_path):
    on = {"student_sha256": "a" * 64, "teacher_sha256": "b" * 64, "jax": "0.10.2", "machine": "Linux x86_64 (cpu)"}
    b = bio.load_budget(write_budget(tmp_path, calibrated_on=on))
    assert b.calibrated_on == on
    assert bio.calibration_warning(b, dict(on)) is None
    msg = bio.calibration_warning(b, {**on, "student_sha256": "c" * 64})
    assert "student weights aaaaaaaaaaaa (now cccccccccccc)" in msg and "teacher" not in msg
    assert "rerun `opdjax study`" in msg and "jax 0.10.2" in msg
    assert bio.calibration_warning(Budget("k3", 0.01), {"student_sha256": "c" * 64}) is None  # no record
    with pytest.raises(AdmissionError, match="'calibrated_on' must be an object"):
        bio.load_budget(write_budget(tmp_path, calibrated_on="yesterday"))


def test_recipe_search_resolves_recipes_without_touching_the_registry():
    """No hidden global state: the searched recipes travel as Recipe objects in `rollout.recipe`; quant.RECIPES is
    the same dict with the same presets afterwards, and the probes saw the recipes themselves."""
    before = dict(quant.RECIPES)
    probe = FakeProbe(0.0)
    search.recipe_search(admit.candidate_config(None, []), Budget("k3", 0.001, None), margin=0.8, probe_fn=probe,
                         mcfg=MCFG, log=lambda s: None)
    assert quant.RECIPES == before
    assert probe.calls and all(isinstance(c.rollout.recipe, quant.Recipe) for c in probe.calls)


def test_rollout_recipe_accepts_a_preset_a_file_or_a_recipe(tmp_path):
    from opdjax.config import ConfigError, TrainConfig, load

    rec = search.full_fp8_recipe(keep=search.units(MCFG.num_layers, "layer")[:1], name="kept0")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rec.to_dict()))
    assert load(TrainConfig, None, ["rollout.recipe=fp8_w8a8"]).rollout.recipe == "fp8_w8a8"
    assert quant.as_recipe(load(TrainConfig, None, [f"rollout.recipe={path}"]).rollout.recipe) == rec
    cfg = load(TrainConfig, None, [])
    cfg.rollout.recipe = rec
    assert cfg.validate().rollout.recipe is rec
    with pytest.raises(ConfigError, match="does not exist"):
        load(TrainConfig, None, [f"rollout.recipe={tmp_path / 'missing.yaml'}"])


class StaleProbe(FakeProbe):
    """M = weight noise sigma + 0.01 per version of staleness (+-10%): a kind the calibration knob does not cover."""

    def __call__(self, cfg, budget=None, **kw):
        m = cfg.rollout.weight_noise + 0.01 * cfg.rollout.stale_versions
        return FakeResult("k3", m, 0.9 * m, 1.1 * m, {"k3": m})


@pytest.mark.parametrize("stale_b,envelope", [((0.05, 0.04, 0.06), "envelope (weight_noise)"),
                                              ((0.005, 0.004, 0.006), "envelope (staleness)")])
def test_a_candidate_is_judged_against_its_own_kinds_budget_and_a_combination_against_its_shares(
        tmp_path, monkeypatch, stale_b, envelope):
    b, lo, hi = stale_b
    kinds = {"staleness": {"budget": b, "budget_interval": [lo, hi], "status": "RESOLVED"},
             "recipe": {"budget": 1.0, "budget_interval": [0.1, 9.0], "status": "UNRESOLVED"}}
    path = write_budget(tmp_path, budget=0.01, budget_interval=[0.008, 0.012], kinds=kinds)
    assert load_budget(path).kinds == {"staleness": stale_b}  # an UNRESOLVED kind is no budget
    out = tmp_path / "report.json"
    cands = ["rollout.stale_versions=3", "rollout.weight_noise=0.005",
             "rollout.weight_noise=0.005,rollout.stale_versions=1",
             "rollout.weight_noise=0.005,rollout.noise_mode=per_version"]
    run_cli(["admit", "--budget", path, "--out", str(out), *cands], monkeypatch, StaleProbe())
    rows = json.loads(out.read_text())["candidates"]
    # the combination: noise 0.005 and staleness 0.01 alone, so shares 1/3 and 2/3 of each B
    shares = "shares (staleness 66.7%, weight_noise 33.3%)"
    assert [r["budget_kind"] for r in rows] == ["staleness", "weight_noise", shares, envelope]
    gentle = envelope.endswith("(weight_noise)")
    mix = [1 / (1 / 3 / n + 2 / 3 / st) for n, st in zip((0.01, 0.008, 0.012), stale_b)]
    assert rows[2]["budget"] == pytest.approx(mix[0]) and rows[2]["budget_interval"] == pytest.approx(mix[1:])
    # M 0.03: inside a gentler staleness budget, beyond a harsher one; M 0.015 [0.0135, 0.0165] (the combination):
    # within the gentle mix's lower end 0.0171, beyond the harsh mix's upper end 0.0072
    assert [r["verdict"] for r in rows] == (["ADMIT", "ADMIT", "ADMIT", "ADMIT"] if gentle else
                                            ["REJECT", "ADMIT", "REJECT", "UNCERTAIN"])
    assert rows[0]["budget_interval"] == [lo, hi]


def test_component_parts_groups_a_combination_by_kind_and_leaves_the_rest_to_for_kind():
    parts = ["rollout.recipe=nvfp4_w4a16", "rollout.weight_noise=0.1", "rollout.noise_mode=per_version",
             "rollout.stale_versions=8"]
    assert admit.component_parts(parts) == {"recipe": ["rollout.recipe=nvfp4_w4a16"],
                                            "noise:per_version": parts[1:3], "staleness": parts[3:]}
    assert admit.component_parts(["rollout.stale_versions=8"]) is None  # one kind
    assert admit.component_parts(["rollout.stale_versions=8", "rollout.engine=vllm"]) is None  # a kind no study trains


def test_for_shares_is_the_harmonic_mix_of_each_components_budget():
    b = Budget("k3", 2.0, interval=(1.0, 4.0), kinds={"staleness": (8.0, 6.0, math.inf)})
    assert b.for_shares({"staleness": 1.0})[1:] == (8.0, 6.0, math.inf)
    which, mid, lo, hi = b.for_shares({"staleness": 0.75, "recipe": 0.25})  # recipe: no B of its own, the envelope
    assert which == "shares (staleness 75%, recipe 25%)"
    assert (mid, lo, hi) == pytest.approx((1 / (0.75 / 8 + 0.25 / 2), 1 / (0.75 / 6 + 0.25 / 1), 4.0 / 0.25))
    assert bio.harmonic_mix({"a": (1.0, 0.0)}) == 0.0 and bio.harmonic_mix({"a": (0.0, 1.0)}) == math.inf


def test_a_combination_whose_components_probe_at_zero_is_judged_against_the_envelope():
    b = Budget("k3", 2.0, interval=(1.0, 4.0), kinds={"staleness": (8.0, 6.0, 9.0)})
    parts = ["rollout.recipe=fp8_w8a8", "rollout.stale_versions=1"]
    assert admit.judged_against(b, parts, lambda group: 0.0) == b.for_kind({"recipe", "staleness"})
    assert admit.judged_against(b, parts, lambda group: 1.0)[0] == "shares (recipe 50%, staleness 50%)"


def test_a_component_shared_by_two_combinations_is_probed_once():
    probed = []

    def probe(cfg, budget=None, **kw):
        probed.append((cfg.rollout.weight_noise, cfg.rollout.stale_versions))
        return StaleProbe()(cfg, budget, **kw)

    b = Budget("k3", 0.01, interval=(0.008, 0.012), kinds={"staleness": (0.05, 0.04, 0.06)})
    cands = [f"rollout.weight_noise=0.005,rollout.stale_versions={v}" for v in (1, 2)]
    rows = admit.admit(cands, b, probe_fn=probe, log=lambda s: None)
    assert [r.budget_kind.split(" (")[0] for r in rows] == ["shares", "shares"]
    # noise 0.005 alone once, each staleness alone, each combination
    assert sorted(probed) == sorted([(0.005, 0), (0.0, 1), (0.005, 1), (0.0, 2), (0.005, 2)])


def test_candidate_knobs_names_each_kind_a_candidate_sets():
    assert admit.candidate_knobs(["rollout.stale_versions=2"]) == {"staleness"}
    assert admit.candidate_knobs(["rollout.recipe=fp8_w8a8", "rollout.stale_versions=1"]) == {"recipe", "staleness"}
    assert admit.candidate_knobs(["rollout.weight_noise=0.1", "rollout.noise_mode=rounding"]) == {"noise:rounding"}
    assert admit.candidate_knobs(["rollout.weight_noise=0.1", "rollout.noise_mode=fixed"]) == {"weight_noise"}
    assert admit.candidate_knobs(["rollout.engine=vllm"]) == {"other:rollout.engine"}


def test_a_malformed_kind_budget_is_refused_with_its_name(tmp_path):
    with pytest.raises(AdmissionError, match="kinds.staleness.budget_interval"):
        load_budget(write_budget(tmp_path, kinds={"staleness": {"budget": 0.05, "budget_interval": [0.06, 0.07],
                                                                "status": "RESOLVED"}}))
    with pytest.raises(AdmissionError, match="'kinds' must map each knob"):
        load_budget(write_budget(tmp_path, kinds=[1, 2]))


def test_a_kind_without_a_knee_admits_below_its_harmless_m_and_never_rejects(tmp_path, monkeypatch, capsys):
    kinds = {"staleness": {"budget": 0.0, "budget_interval": [0.0, 0.0], "status": "NO_KNEE",
                           "harmless_up_to": 0.05, "why": "no knee", "levels": [2, 4]}}
    path = write_budget(tmp_path, budget=0.01, budget_interval=[0.008, 0.012], kinds=kinds)
    assert load_budget(path).kinds["staleness"] == (0.05, 0.05, float("inf"))
    out = tmp_path / "report.json"
    cands = ["rollout.stale_versions=4", "rollout.stale_versions=9",
             "rollout.weight_noise=0.005,rollout.stale_versions=1"]
    run_cli(["admit", "--budget", path, "--out", str(out), *cands], monkeypatch, StaleProbe())
    rows = json.loads(out.read_text())["candidates"]
    # 0.09 is beyond what was measured; the combination (M 0.015, shares 1/3 noise, 2/3 staleness) is within the
    # mix of the noise B's lower end and staleness's harmless M, 1 / (1/3 / 0.008 + 2/3 / 0.05) = 0.0182
    assert [r["verdict"] for r in rows] == ["ADMIT", "UNCERTAIN", "ADMIT"]
    assert rows[1]["budget_interval"] == [0.05, None]
    assert rows[2]["budget_kind"] == "shares (staleness 66.7%, weight_noise 33.3%)"
    assert rows[2]["budget_interval"] == pytest.approx([1 / (1 / 3 / 0.008 + 2 / 3 / 0.05), 0.012 * 3])
    assert "harmless up to M 5.000e-02" in capsys.readouterr().out
    bad = {"staleness": {**kinds["staleness"], "harmless_up_to": float("nan")}}
    with pytest.raises(AdmissionError, match="kinds.staleness.harmless_up_to"):
        load_budget(write_budget(tmp_path, kinds=bad))


def test_weight_noise_of_another_mode_is_not_matched_to_the_studys_noise_point():
    points = [{"group": "sweep", "knob": "weight_noise", "value": 0.5, "m_probe": 1.0, "m_train": 1.1}]
    assert admit.matching_point(points, "rollout.weight_noise=0.5") is points[0]
    assert admit.matching_point(points, "rollout.weight_noise=0.5,rollout.noise_mode=per_version") is None
    assert admit.matching_point(points, "rollout.weight_noise=0.5,rollout.noise_mode=fixed") is points[0]


VIEW = {"budget": 2.0, "budget_interval": [1.0, 4.0], "status": "RESOLVED", "why": "x2 <= 3",
        "ratios": [{"level": 4, "ratio": 0.1, "ratio_interval": [0.08, 0.12]},
                   {"level": 16, "ratio": 0.4, "ratio_interval": [0.3, 0.5]}]}


def test_training_view_interpolates_its_ratio_log_log_and_takes_one_outside_the_trained_levels():
    v = bio.TrainingView(2.0, (1.0, 4.0), (4.0, 16.0), (0.1, 0.4), (0.08, 0.3), (0.12, 0.5))
    assert v.ratio(4) == (0.1, 0.08, 0.12) and v.ratio(16) == (0.4, 0.3, 0.5)
    # k = 8 halfway in log k: the geometric means of the ends
    assert v.ratio(8) == pytest.approx((0.2, math.sqrt(0.08 * 0.3), math.sqrt(0.12 * 0.5)))
    assert v.ratio(2) == v.ratio(40) == (1.0, 1.0, 1.0)
    assert v.in_probe_units(8) == pytest.approx((2.0 / 0.2, 1.0 / math.sqrt(0.06), 4.0 / math.sqrt(0.024)))
    wide = bio.TrainingView(2.0, (1.0, 4.0), (4.0,), (0.9,), (0.8,), (1.3,))
    assert wide.ratio(8) == (1.3, 1.3, 1.3)  # a recorded ratio above 1: outside, the largest upper end


def test_a_staleness_candidate_is_judged_on_trainings_m_at_its_level(tmp_path, monkeypatch):
    kinds = {"staleness": {"budget": 6.0, "budget_interval": [5.0, 8.0], "status": "RESOLVED", "training": VIEW}}
    path = write_budget(tmp_path, budget=0.01, budget_interval=[0.008, 0.012], kinds=kinds)
    b = load_budget(path)
    assert set(b.views) == {"staleness"} and b.views["staleness"].levels_L == (4.0, 16.0)
    which, mid, lo, hi = admit.judged_against(b, ["rollout.stale_versions=16"], lambda g: 0.0)
    assert which == "staleness on training's M (x0.4)" and (mid, lo, hi) == pytest.approx((5.0, 2.0, 40 / 3))
    assert b.for_kind({"staleness"}) == ("staleness", 6.0, 5.0, 8.0)  # no level: the probe-M fit
    which, mid, _, _ = admit.judged_against(b, ["rollout.recipe=fp8_w8a8", "rollout.stale_versions=4"],
                                            lambda g: 1.0)
    # recipe at the envelope (0.01), staleness at 2 / 0.1 = 20 on the probe's scale, half and half
    assert which == "shares (recipe 50%, staleness on training's M 50%)"
    assert mid == pytest.approx(1 / (0.5 / 0.01 + 0.5 / 20))
    line = admit.view_line(b, ["rollout.stale_versions=16"], 10.0)
    assert "M x 0.4 [0.3, 0.5] = 4.000e+00" in line and "B on training's M 2.000e+00" in line
    assert "the ratio is taken as 1" in admit.view_line(b, ["rollout.stale_versions=64"], 10.0)
    assert admit.view_line(b, ["rollout.weight_noise=0.1"], 1.0) is None
    assert admit.candidate_levels(["rollout.stale_versions=12", "rollout.recipe=fp8_w8a8"]) == {"staleness": 12.0}


def test_an_unresolved_training_view_is_no_view_and_a_malformed_one_is_refused(tmp_path):
    kinds = {"staleness": {"budget": 6.0, "budget_interval": [5.0, 8.0], "status": "RESOLVED",
                           "training": {**VIEW, "status": "UNRESOLVED"}}}
    assert load_budget(write_budget(tmp_path, kinds=kinds)).views == {}
    bad = {**VIEW, "ratios": [VIEW["ratios"][1], VIEW["ratios"][0]]}  # levels not increasing
    with pytest.raises(AdmissionError, match="kinds.staleness.training.ratios must be"):
        load_budget(write_budget(tmp_path, kinds={"staleness": {**kinds["staleness"], "training": bad}}))
    with pytest.raises(AdmissionError, match="kinds.staleness.training must be an object"):
        load_budget(write_budget(tmp_path, kinds={"staleness": {**kinds["staleness"],
                                                                "training": {**VIEW, "budget": -1}}}))


def test_the_committed_sort16_budget_gives_the_b_each_fresh_staleness_candidate_was_judged_against():
    """The third fresh validity set (docs/results/budget_scaling/sort16_qwen3/validity_fresh3) was judged by the
    committed budget's training view: each one-kind candidate's recorded B interval comes back from the file."""
    root = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "budget_scaling" / "sort16_qwen3"
    b = load_budget(root / "budget.json")
    assert b.views["staleness"].levels_L == (4.0, 8.0, 16.0, 32.0)
    rows = json.loads((root / "validity_fresh3" / "validity.json").read_text())["rows"]
    single = [r for r in rows if "," not in r["candidate"]]
    assert len(single) >= 8
    for r in single:
        which, _, lo, hi = admit.judged_against(b, admit.split_candidate(r["candidate"]), lambda g: 0.0)
        assert (which, [lo, hi]) == (r["budget_kind"], pytest.approx(r["budget_interval"])), r["candidate"]


def test_the_admit_table_names_b_on_trainings_m_and_the_ratio_behind_a_staleness_verdict(tmp_path):
    kinds = {"staleness": {"budget": 6.0, "budget_interval": [5.0, 8.0], "status": "RESOLVED", "training": VIEW}}
    b = load_budget(write_budget(tmp_path, budget=0.01, budget_interval=[0.008, 0.012], kinds=kinds))
    rows = admit.admit(["rollout.stale_versions=8"], b, probe_fn=StaleProbe(), log=lambda s: None)
    # M 0.08 [0.072, 0.088]; r(8) = 0.2 [0.155, 0.245]: B on the probe's scale [1 / 0.245, 4 / 0.155]
    assert rows[0].verdict == "ADMIT" and rows[0].budget_interval == pytest.approx([1 / 0.2449, 4 / 0.1549], rel=1e-3)
    text = admit.format_admit_table(rows, b)
    assert "B for staleness on training's M: 2.000e+00 [1.000e+00, 4.000e+00]" in text
    assert "(B of staleness on training's M (x0.2))" in text and "training sees about M x 0.2" in text

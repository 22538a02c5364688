"""Every example in examples/ runs, and says what it claims.

References: k3 recomputed in NumPy from its closed form; `opdjax train` itself for the own-loop example (same seed,
same settings: the same per-step losses and held-out reverse KL).
"""

from __future__ import annotations

import json
import pathlib
import runpy

import numpy as np
import pytest

import opdjax
from opdjax.config import TrainConfig, load
from opdjax.pipeline import loop

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=f"example_{name}")["main"]


def test_mismatch_metrics_example_matches_the_closed_form(capsys):
    out = _example("mismatch_metrics")()
    assert "k3 KL" in capsys.readouterr().out
    assert 0 < out["k3"] < 0.01  # logit noise sigma 0.05: KL ~ sigma^2 / 2 per token
    w = out["w_BT"]
    assert w.shape == (4, 32) and np.all(w[:, :8] == 0) and np.all((w[:, 8:] > 0) & (w[:, 8:] <= 2.0))


def test_mismatch_metrics_k3_is_the_textbook_estimator():
    rng = np.random.default_rng(1)
    s, r = -rng.random((3, 7)), -rng.random((3, 7))
    mask = rng.random((3, 7)) > 0.3
    x = s - r  # log pi - log mu on tokens sampled from mu
    want = np.sum((np.exp(x) - x - 1) * mask) / mask.sum()
    np.testing.assert_allclose(float(opdjax.mismatch.metrics(s, r, mask)["k3"]), want, rtol=1e-5)


def test_quantize_weights_example_measures_an_error_and_a_k3(capsys):
    out = _example("quantize_weights")()
    errors = list(out["relative_error"].values())
    assert errors and all(0 < e < 0.1 for e in errors)  # FP8 e4m3: ~2-3% relative error per kernel
    assert 0 < out["k3"] < 0.1


@pytest.mark.slow  # two short training runs of the default settings
def test_own_opd_loop_equals_opdjax_train(pair, tmp_path):
    steps = 3
    cfg = load(TrainConfig, None, [f"student={pair[0]}", f"teacher={pair[1]}", f"pipeline.steps={steps}",
                                   "rollout.batch_size=16", "pipeline.eval_prompts=32", "pipeline.eval_every=0",
                                   "pipeline.progress=false", "pipeline.tensorboard=false",
                                   f"pipeline.out_dir={tmp_path / 'run'}"])
    summary = loop.train(cfg, log=lambda s: None)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    want = [x["loss"] for x in lines if "loss" in x]
    history = _example("own_opd_loop")(pair[0], pair[1], steps=steps, batch_size=16, eval_prompts=32,
                                       log=lambda s: None)
    np.testing.assert_allclose([m["loss"] for m in history], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(history[-1]["eval/reverse_kl"], summary["final"]["eval/reverse_kl"], rtol=1e-5)


@pytest.mark.slow  # two `opdjax serve` processes
def test_remote_servers_example_trains_against_real_servers(pair):
    history = _example("remote_servers")(pair[0], pair[1], steps=2)
    assert [h["served_version"] for h in history] == [1, 2]
    assert all(np.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in history)

"""Simulated FP8 (JaxEngine + recipe) against what vLLM serves (vLLM's own online FP8, emulated kernels on a CPU).

    python benchmarks/fp8_sim_vs_vllm.py [--prompts 64] [--tokens 16] [--mult 6]

Model: a tiny Qwen3 made locally, its random weights scaled by --mult (sharper log-probs, so FP8 rounding moves
them well beyond bf16 numerics). Two measurements per recipe:

1. k3 against the unquantized engine on the SAME tokens: one token set (sampled by the unquantized bf16 JAX engine)
   scored by four engines — JAX bf16 plain, JAX bf16 + recipe (the simulation), vLLM bf16 plain, vLLM bf16 + recipe
   (`rollout.fp8_emulation`); k3 = mean(exp(r) - r - 1), r = logp_plain - logp_fp8, within each engine family.
2. the admission probe's M: each FP8 engine samples its own rollouts of the same prompts, rescored by the f32
   learner (`admission.probe.rescore`, the probe's loop): M = k3(learner vs engine), with its bootstrap interval.

A recipe vLLM cannot serve (fp8_weights_only) is listed with vLLM's refusal.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from opdjax import quant  # noqa: E402
from opdjax.admission.probe import rescore  # noqa: E402
from opdjax.core import mismatch  # noqa: E402
from opdjax.learner.learner import Learner  # noqa: E402
from opdjax.models import ModelConfig, decoder, hf  # noqa: E402
from opdjax.models.tiny import make_tiny  # noqa: E402
from opdjax.rollout import SamplingParams  # noqa: E402
from opdjax.rollout import EngineMismatch, JaxEngine  # noqa: E402
from opdjax.rollout.vllm_settings import VllmSettingsError, vllm_settings  # noqa: E402

RECIPES = ("fp8_w8a8", "fp8_w8a8_tensor", "fp8_weights_only")
ENGINE_KW = dict(kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_seqs=64)


def k3(plain_BT, fp8_BT, mask_BT) -> float:
    return float(mismatch.metrics(plain_BT, fp8_BT, mask_BT)["k3"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--mult", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=13)
    a = ap.parse_args()
    from opdjax.rollout.vllm_engine import VllmEngine

    d = make_tiny(tempfile.mkdtemp() + "/m", "qwen3", "tiny", seed=0)
    cfg = ModelConfig.from_dir(d)
    params = jax.tree.map(lambda x: x * a.mult if x.ndim == 2 else x, nnx.state(decoder.create(cfg, seed=a.seed)))
    named = hf.named_params(cfg, params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=rng.integers(4, 12)).tolist() for _ in range(a.prompts)]
    sp = SamplingParams(max_new_tokens=a.tokens, temperature=1.0)

    def jax_engine(recipe=None):
        e = JaxEngine(cfg, dtype="bfloat16", mismatch=EngineMismatch(recipe=recipe))
        e.update_weights(named, 1)
        return e

    def vllm_engine(recipe=None):
        e = VllmEngine(d, recipe=recipe, fp8_emulation=recipe is not None, seed=0, **ENGINE_KW)
        e.update_weights(named, 1)
        return e

    plain_j, plain_v = jax_engine(), vllm_engine()
    batch = plain_j.generate(prompts, sp, seed=1)
    tok, val, m = batch.tokens_BT, batch.valid_BT, batch.completion_mask_BT
    score = lambda e: e.score(tok, val)["logp_BT"]  # noqa: E731
    lp_j, lp_v = score(plain_j), score(plain_v)
    graphdef, _ = nnx.split(decoder.abstract(cfg))
    learner = Learner(graphdef)
    learner_logp = lambda b: learner.logp(params, b.tokens_BT, b.valid_BT, temperature=1.0)  # noqa: E731

    def probe_m(engine) -> tuple[float, float, float]:
        res = rescore(lambda i: engine.generate(prompts[16 * i:16 * i + 16], sp, seed=100 + i), learner_logp,
                      range(len(prompts) // 16))
        return res.estimate("k3")

    print(f"tiny qwen3 x{a.mult:g} weights, {len(prompts)} prompts x {a.tokens} tokens ({int(m.sum())} scored), "
          f"bf16 engines; floor k3(JAX plain, vLLM plain) = {k3(lp_j, lp_v, m):.2e}\n")
    print("| recipe | k3 sim (JAX) | k3 served (vLLM) | ratio | probe M sim [95%] | probe M vLLM [95%] | M ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in RECIPES:
        try:
            vllm_settings(cfg, quant.get_recipe(name))
        except VllmSettingsError as e:
            print(f"| {name} | {k3(lp_j, score(jax_engine(name)), m):.3e} | refused: {str(e)[:90]}... | | | | |")
            continue
        sim, served = jax_engine(name), vllm_engine(name)
        ks, kv = k3(lp_j, score(sim), m), k3(lp_v, score(served), m)
        ms, mv = probe_m(sim), probe_m(served)
        print(f"| {name} | {ks:.3e} | {kv:.3e} | {kv / ks:.2f} | {ms[0]:.3e} [{ms[1]:.2e}, {ms[2]:.2e}] | "
              f"{mv[0]:.3e} [{mv[1]:.2e}, {mv[2]:.2e}] | {mv[0] / ms[0]:.2f} |", flush=True)
        del served


if __name__ == "__main__":
    main()

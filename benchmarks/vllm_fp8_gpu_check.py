"""One check for a GPU with vLLM: two publishes into vLLM's own online FP8 engine, unpatched, against the simulation.

    python benchmarks/vllm_fp8_gpu_check.py              # on a CUDA GPU with vLLM installed (no opdjax patches)
    python benchmarks/vllm_fp8_gpu_check.py --emulate    # the same check on a CPU, through vllm_fp8_cpu

The recipe is the one vLLM serves on this target: fp8_w8a8 (per-token activations) on CUTLASS FP8 GPUs (Ada,
Hopper, Blackwell), fp8_w8a8_tensor elsewhere (`opdjax.rollout.vllm_engine.target_activations`). For v1 and v2 (a
tiny Qwen3 made locally, random weights x6 so FP8 rounding matters) it checks, and prints as a table:

  scales     every qkv_proj / gate_up_proj / o_proj / down_proj is float8_e4m3fn with scale = amax(fused bf16
             weights) / 448, the value vLLM's formula gives from the published weights (relative error <= 1e-6)
  follows    the served log-probs change with the version (mean |delta| between v1 and v2 > 0.05)
  logprobs   vLLM's sampled-token log-probs are closer to the JAX simulation of the recipe than to its near misses
             (no FP8, unfused scales, the other activation scheme); FP8 rounding amplifies bf16 differences, so
             they agree in distribution, not to bf16 numerics
  k3         k3 against the unquantized engine on the same tokens, simulated vs served: ratio in [0.8, 1.25]

Exit status 0 iff every check passes. Nothing is patched on a GPU: `--emulate` is refused there.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from opdjax import quant  # noqa: E402
from opdjax.core import mismatch  # noqa: E402
from opdjax.models import decoder, hf  # noqa: E402
from opdjax.models.tiny import make_tiny  # noqa: E402
from opdjax.rollout import SamplingParams  # noqa: E402
from opdjax.rollout import EngineMismatch, JaxEngine  # noqa: E402

ENGINE_KW = dict(kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_seqs=64)
FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up"), "self_attn.o_proj": ("o",),
         "mlp.down_proj": ("down",)}
SHARD = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def served_layers(engine) -> dict[str, tuple[str, list[float]]]:
    """module -> (weight dtype, weight_scale values), read from vLLM's own model."""
    def read(worker):
        out = {}
        for name, mod in worker.model_runner.model.named_modules():
            w, s = getattr(mod, "weight", None), getattr(mod, "weight_scale", None)
            if w is not None and w.ndim == 2 and name.startswith("model.layers."):
                out[name] = (str(w.dtype), [] if s is None else [float(v) for v in s.detach().reshape(-1).cpu()])
        return out
    return engine.llm.collective_rpc(read)[0]


def scale_errors(served, named, num_layers: int) -> list[str]:
    """Layers that are not FP8 with vLLM's scale amax(bf16 concat) / 448 (true division, as vLLM computes it)."""
    import torch

    bad = []
    for i in range(num_layers):
        for fused, shards in FUSED.items():
            dtype, scale = served[f"model.layers.{i}.{fused}"]
            ws = [torch.from_numpy(np.asarray(named[f"model.layers.{i}.{SHARD[s]}.weight"], np.float32))
                  .to(torch.bfloat16) for s in shards]
            want = float(max(w.abs().max().float() for w in ws) / torch.tensor(448.0))
            if dtype != "torch.float8_e4m3fn" or len(scale) != 1 or abs(scale[0] - want) > 1e-6 * want:
                bad.append(f"layer {i} {fused}: {dtype} scale {scale} (want {want:.6e})")
    return bad


def rivals(recipe: str) -> dict:
    """The simulation of `recipe` and its near misses: no FP8, one scale per HF tensor, the other activations."""
    r = quant.get_recipe(recipe)
    other = "tensor" if r.activations.granularity == "token" else "token"
    return {"sim": r, "plain": None, "unfused": r.replace(fused_scales=False),
            "other_activations": r.replace(activations=quant.QSpec("e4m3", other))}


def check_version(engine, cfg, recipe: str, named, prompts, sp) -> dict:
    """Publish `named` and compare the served engine with the simulation and its near misses (JAX, bf16)."""
    version = engine.version + 1
    engine.update_weights(named, version)
    batch = engine.generate(prompts, sp, seed=5)
    m = batch.completion_mask_BT
    out = {"version": version, "scale_errors": scale_errors(served_layers(engine), named, cfg.num_layers),
           "logp_BT": batch.rollout_logp_BT, "mask": m}
    lp = {}
    for key, r in rivals(recipe).items():
        e = JaxEngine(cfg, dtype="bfloat16", mismatch=EngineMismatch(recipe=r))
        e.update_weights(named, version)
        lp[key] = e.score(batch.tokens_BT, batch.valid_BT)["logp_BT"]
        out[f"gap_{key}"] = float(np.abs(lp[key] - batch.rollout_logp_BT)[m].mean())
    out["k3_sim"] = float(mismatch.metrics(lp["plain"], lp["sim"], m)["k3"])
    out["k3_served"] = float(mismatch.metrics(lp["plain"], batch.rollout_logp_BT, m)["k3"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate", action="store_true", help="run on a CPU through opdjax's FP8 emulation")
    ap.add_argument("--prompts", type=int, default=32)
    a = ap.parse_args(argv)
    from opdjax.rollout.vllm_engine import VllmEngine, target_activations

    scheme = target_activations(fp8_emulation=a.emulate) or "token"
    recipe = "fp8_w8a8" if scheme == "token" else "fp8_w8a8_tensor"
    d = make_tiny(tempfile.mkdtemp() + "/m", "qwen3", "tiny", seed=0)
    cfg = hf.load_config(d)  # the ids its tokenizer has (vLLM samples those)
    engine = VllmEngine(d, recipe=recipe, fp8_emulation=a.emulate, seed=0, **ENGINE_KW)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=rng.integers(4, 12)).tolist() for _ in range(a.prompts)]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    rows = []
    for seed in (41, 42):
        params = jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, nnx.state(decoder.create(cfg, seed=seed)))
        rows.append(check_version(engine, cfg, recipe, hf.named_params(cfg, params), prompts, sp))
    moved = float(np.abs(rows[0]["logp_BT"] - rows[1]["logp_BT"])[rows[1]["mask"]].mean())
    print(f"vLLM FP8 check: recipe {recipe} (activations per {scheme}), emulated: {a.emulate}")
    print("| version | FP8 + vLLM scales | gap to sim | to plain | to unfused | to other activations | k3 sim | "
          "k3 served | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = moved > 0.05
    for r in rows:
        ratio = r["k3_served"] / max(r["k3_sim"], 1e-30)
        nearest = min(("sim", "plain", "unfused", "other_activations"), key=lambda k: r[f"gap_{k}"])
        ok &= not r["scale_errors"] and nearest == "sim" and 0.8 <= ratio <= 1.25
        print(f"| v{r['version']} | {'yes' if not r['scale_errors'] else r['scale_errors'][:2]} | {r['gap_sim']:.4f} | "
              f"{r['gap_plain']:.4f} | {r['gap_unfused']:.4f} | {r['gap_other_activations']:.4f} | "
              f"{r['k3_sim']:.3e} | {r['k3_served']:.3e} | {ratio:.2f} |")
    print(f"log-probs follow the version: mean |v2 - v1| = {moved:.3f}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The accelerator check: learner MFU, engine tokens/s against the HBM bound, qdq survives XLA, simulated vs real FP8.

One script, one process, under 8 minutes on one H200 (jax[cuda] 0.11, flax 0.12.10, optax, orbax, transformers and
torch; no vLLM). Prints a markdown table (and writes it, with every figure, as JSON to --out):

  attention the fused attention "auto" picks (cuDNN on GPU) against the einsum path: bf16 logits of a padded batch.
  qdq       quant.qdq(x, "e4m3", "tensor") on a 512x1536 array, f32 and bf16: share of values changed, distinct
            values; the naive `x.astype(f8).astype(x.dtype)` beside it (XLA on GPU removes that round trip);
            quant.check_effective for every preset recipe on this backend.
  learner   503M Qwen3-style (hidden 1536, 16 layers, 12 heads / 4 KV heads, head_dim 128, MLP 4096, vocab 32768),
            bf16 compute / f32 params, B 16 x L 1024, reverse_kl_sampled + AdamW: tokens/s, TFLOP/s and MFU with
            FLOPs = 6 N tokens + 12 layers L heads head_dim tokens, against 790 TFLOP/s (the issue's peak) and the
            bf16 matmul rate measured in this run; peer: transformers + torch (bf16 autocast, sdpa, fused AdamW).
  engine    JaxEngine decode, bf16, batch 64, 64-token prompts, 256 new tokens: tokens/s, ms per step, and the HBM
            bound per step (weights once + the filled KV cache, at the copy bandwidth measured in this run);
            peer: HF generate with a static cache; the same decode with the other merge_projections setting and
            with decode_attention="pallas".
  fp8       k3 between bf16 and FP8 log-probs of the same tokens, per recipe (fp8_w8a8, fp8_weights_only):
            simulated (JaxEngine.score with the recipe) vs real FP8 matmuls (torch._scaled_mm: FP8 weights with a
            per-tensor scale, FP8 activations with a per-token scale; weights-only: FP8 weights dequantized into a
            bf16 GEMM, as Marlin kernels do). Goal sim/real within 0.8-1.25.

--small runs the same code on a tiny model in seconds on CPU (tests/benchmarks/test_accelerator_check.py uses it), where
torch._scaled_mm may be missing: then "real" falls back to torch's own FP8 casts (labelled torch-cast).
Sections run in order of importance and each is skipped, with a note, once the --budget-s is spent.

Run: python benchmarks/accelerator_check.py [--small] [--out results.json] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch peers share the device

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opdjax import quant  # noqa: E402
from opdjax.core import mismatch
from opdjax.learner import Learner, make_optimizer  # noqa: E402
from opdjax.models import decoder  # noqa: E402
from opdjax.models.config import ModelConfig  # noqa: E402
from opdjax.rollout.base import SamplingParams  # noqa: E402
from opdjax.rollout import EngineMismatch, JaxEngine  # noqa: E402

ISSUE_PEAK_TFLOPS = 790.0


@dataclasses.dataclass(frozen=True)
class Workload:
    cfg: ModelConfig
    learn_batch: int
    learn_len: int
    gen_batch: int
    gen_prompt: int
    gen_new: int
    score_rows: int
    peak_n: int          # matmul size for the measured bf16 peak
    copy_mb: int         # array size for the measured copy bandwidth
    qdq_shape: tuple[int, int]
    steps: int           # timed learner steps


FULL = Workload(
    cfg=ModelConfig(model_type="qwen3", vocab_size=32768, hidden_size=1536, intermediate_size=4096, num_layers=16,
                    num_heads=12, num_kv_heads=4, head_dim=128, max_position_embeddings=4096, qk_norm=True),
    learn_batch=16, learn_len=1024, gen_batch=64, gen_prompt=64, gen_new=256, score_rows=16, peak_n=8192,
    copy_mb=2048, qdq_shape=(512, 1536), steps=5)
SMALL = Workload(
    cfg=ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256, qk_norm=True),
    learn_batch=2, learn_len=64, gen_batch=4, gen_prompt=8, gen_new=8, score_rows=4, peak_n=256, copy_mb=8,
    qdq_shape=(512, 1536), steps=2)


class Report:
    """Rows of (section, what, opdjax, peer, note), printed as they come and once more as a table at the end."""

    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.rows: list[dict] = []
        self.figures: dict[str, object] = {}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def row(self, section, what, ours, peer="", note=""):
        r = dict(section=section, what=what, opdjax=ours, peer=peer, note=note)
        self.rows.append(r)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {section} | {what} | {ours} | {peer} | {note}", flush=True)

    def table(self) -> str:
        lines = ["| section | what | opdjax | peer, same run | note |", "|---|---|---|---|---|"]
        lines += [f"| {r['section']} | {r['what']} | {r['opdjax']} | {r['peer']} | {r['note']} |" for r in self.rows]
        return "\n".join(lines)


def _torch():
    try:
        import torch
        import transformers  # noqa: F401

        return torch
    except Exception:  # noqa: BLE001 - any import failure: no peer
        return None


def _torch_device(torch) -> str:
    return "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------------------

def section_env(rep: Report, wl: Workload):
    dev = jax.devices()[0]
    torch = _torch()
    rep.figures["env"] = dict(backend=jax.default_backend(), device=dev.device_kind, jax=jax.__version__,
                              torch=None if torch is None else torch.__version__)
    rep.row("env", "device", f"{dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}",
            "none" if torch is None else f"torch {torch.__version__}")
    n = wl.peak_n
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(a))
    t = min(_time(lambda: jax.block_until_ready(mm(a)), 5))
    tflops = 2 * n**3 / t / 1e12
    x = jnp.zeros((wl.copy_mb << 20) // 4, jnp.float32)
    cp = jax.jit(lambda v: v + 1)
    jax.block_until_ready(cp(x))
    t = min(_time(lambda: jax.block_until_ready(cp(x)), 5))
    gbs = 2 * x.size * 4 / t / 1e9
    rep.figures.update(peak_tflops=tflops, copy_gbs=gbs)
    rep.row("env", f"bf16 matmul {n}^3 / copy {wl.copy_mb} MB", f"{tflops:.0f} TFLOP/s / {gbs:.0f} GB/s (read+write)")


def section_qdq(rep: Report, wl: Workload):
    x32 = jax.random.normal(jax.random.key(1), wl.qdq_shape, jnp.float32)
    naive = jax.jit(lambda v: v.astype(jnp.float8_e4m3fn).astype(v.dtype))
    for x in (x32, x32.astype(jnp.bfloat16)):
        y = quant.qdq(x, "e4m3", "tensor")
        changed = float(jnp.mean((y != x).astype(jnp.float32)))
        rel = float(jnp.median(jnp.abs(y.astype(jnp.float32) - x.astype(jnp.float32)) /
                               jnp.maximum(jnp.abs(x.astype(jnp.float32)), 1e-30)))
        distinct = int(np.unique(np.asarray(y.astype(jnp.float32))).size)
        nv = float(jnp.mean((naive(x) != x).astype(jnp.float32)))
        rep.figures[f"qdq_{x.dtype}"] = dict(changed=changed, max_rel=rel, distinct=distinct, naive_changed=nv)
        rep.row("qdq", f"qdq e4m3 tensor, {x.dtype} {wl.qdq_shape}",
                f"{changed:.1%} changed, median rel. change {rel:.2g}, {distinct} distinct values",
                f"naive astype round trip: {nv:.1%} changed", "survives" if changed > 0.5 else "REMOVED")
    ok, bad = [], []
    for name in sorted(quant.RECIPES):
        if quant.RECIPES[name].is_noop:
            continue
        try:
            fr = quant.check_effective(name, jnp.bfloat16)
            ok.append(f"{name} {min(fr.values(), default=1.0):.0%}")
        except quant.IneffectiveQuantError as e:
            bad.append(f"{name}: {e}")
    rep.figures["check_effective_bad"] = bad
    rep.row("qdq", "check_effective, every preset (bf16; min share changed)", "; ".join(ok),
            "", "all effective" if not bad else "INEFFECTIVE: " + " / ".join(bad))


def _rkl_batch(wl: Workload, rng: np.random.Generator) -> dict[str, np.ndarray]:
    B, L, V = wl.learn_batch, wl.learn_len, wl.cfg.vocab_size
    prompt = L // 16
    tokens = rng.integers(0, V, (B, L)).astype(np.int32)
    comp = np.zeros((B, L), bool)
    comp[:, prompt:] = True
    return {"tokens_BT": tokens, "valid_BT": np.ones((B, L), bool), "mask_BT": comp,
            "rollout_logp_BT": np.where(comp, -rng.random((B, L)) * 5, 0).astype(np.float32),
            "teacher_logp_BT": np.where(comp, -rng.random((B, L)) * 5, 0).astype(np.float32)}


def _flops(cfg: ModelConfig, tokens: int, L: int) -> float:
    return 6 * cfg.num_params() * tokens + 12 * cfg.num_layers * L * cfg.num_heads * cfg.head_dim * tokens


def _jax_learner(rep: Report, wl: Workload, batch, attention: str, remat: str = "none") -> dict:
    cfg = wl.cfg
    graphdef, params = nnx.split(decoder.create(cfg, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                                                attention=attention, remat=remat))
    tx, schedule = make_optimizer(lr=3e-4, total_steps=1000, warmup_steps=5, grad_clip=1.0, b2=0.99)
    learner = Learner(graphdef, loss="reverse_kl_sampled", tx=tx, schedule=schedule)
    state = learner.init(params)
    del params
    t = time.perf_counter()
    state, m = learner.train_step(state, batch)
    compile_s = time.perf_counter() - t
    state, m = learner.train_step(state, batch)
    times = []
    for _ in range(wl.steps):
        t = time.perf_counter()
        state, m = learner.train_step(state, batch)  # returns host floats: synchronised
        times.append(time.perf_counter() - t)
    del state, learner
    gc.collect()
    dt = statistics.median(times)
    tokens = wl.learn_batch * wl.learn_len
    tf = _flops(cfg, tokens, wl.learn_len) / dt / 1e12
    return dict(attention=decoder.resolve_attention(attention, jnp.bfloat16, cfg.head_dim), remat=remat,
                step_s=dt, tok_s=tokens / dt, tflops=tf, mfu=tf / ISSUE_PEAK_TFLOPS, compile_s=compile_s,
                loss=m["loss"])


def _torch_learner(wl: Workload, batch) -> dict | None:
    torch = _torch()
    if torch is None:
        return None
    import transformers

    dev = _torch_device(torch)
    cfg = wl.cfg
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf_dict().items()
                                                  if k not in ("architectures", "torch_dtype")})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
    tb = {k: torch.as_tensor(v, device=dev) for k, v in batch.items()}
    tokens, mask = tb["tokens_BT"].long(), tb["mask_BT"]
    amp_dtype = torch.bfloat16

    def step():
        with torch.autocast(dev, dtype=amp_dtype):
            logits = model(tokens).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        m = mask[:, 1:].float()
        adv = (tb["teacher_logp_BT"][:, 1:] - lp).detach()
        loss = -(adv * lp * m).sum() / m.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for _ in range(2):
        step()
    sync()
    times = []
    for _ in range(wl.steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    model = opt = step = None  # free the device memory before the next section
    if dev == "cuda":
        torch.cuda.empty_cache()
    dt = statistics.median(times)
    tokens_n = wl.learn_batch * wl.learn_len
    tf = _flops(cfg, tokens_n, wl.learn_len) / dt / 1e12
    return dict(step_s=dt, tok_s=tokens_n / dt, tflops=tf, mfu=tf / ISSUE_PEAK_TFLOPS)


def section_learner(rep: Report, wl: Workload):
    batch = _rkl_batch(wl, np.random.default_rng(0))
    try:
        res = _jax_learner(rep, wl, batch, "auto")
    except Exception as e:  # noqa: BLE001 - e.g. a cuDNN version without this attention: fall back, say so
        traceback.print_exc()
        rep.row("learner", "auto attention FAILED", "", "", f"{type(e).__name__}: {e}"[:300])
        res = _jax_learner(rep, wl, batch, "xla")
    rep.figures["learner"] = res
    peak = rep.figures.get("peak_tflops")
    rep.row("learner", f"step, bf16 compute / f32 params, B {wl.learn_batch} x L {wl.learn_len}, "
                       f"reverse_kl_sampled + AdamW ({res['attention']} attention)",
            f"{res['tok_s'] / 1e3:.1f}k tok/s, {res['tflops']:.0f} TFLOP/s, **MFU {res['mfu']:.1%}**"
            + (f" ({res['tflops'] / peak:.1%} of measured peak)" if peak else ""), "",
            f"step {res['step_s'] * 1e3:.1f} ms, first step {res['compile_s']:.0f} s; peak {ISSUE_PEAK_TFLOPS:.0f}")


def section_attention_parity(rep: Report, wl: Workload):
    """Logits of the fused attention "auto" resolves to (cuDNN on GPU) against the einsum path, on a batch with
    left and right padding, bf16 compute: the fused kernel must mask exactly what the einsum path masks."""
    cfg = wl.cfg
    B, L = 4, min(wl.learn_len, 256)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, L)), jnp.int32)
    valid = np.ones((B, L), bool)
    valid[0, : L // 4] = False
    valid[1, -L // 8:] = False
    valid[2, :3] = False
    valid[2, -5:] = False
    params = nnx.state(decoder.create(cfg, seed=3, dtype=jnp.bfloat16, param_dtype=jnp.float32))
    out = {}
    for impl in ("auto", "einsum"):
        gd = nnx.graphdef(decoder.abstract(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, attention=impl))
        logits, _ = jax.jit(lambda p, t, v: decoder.forward(gd, p, t, valid_BT=v))(params, tokens, jnp.asarray(valid))
        out[impl] = np.where(valid[..., None], np.asarray(logits, np.float32), 0.0)
    row_diff = np.abs(out["auto"] - out["einsum"]).max(axis=(1, 2))  # rows 0-2 padded, row 3 not
    scale = float(np.max(np.abs(out["einsum"])))
    impl = decoder.resolve_attention("auto", jnp.bfloat16, cfg.head_dim)
    # A masking error shows as padded rows far off while the unpadded row agrees to bf16 rounding.
    ok = row_diff[:3].max() <= 3 * row_diff[3] + 0.01 * max(scale, 1)
    rep.figures["attention_parity"] = dict(impl=impl, max_abs_diff=float(row_diff.max()),
                                           row_diffs=[float(d) for d in row_diff], max_abs_logit=scale)
    rep.row("learner", f"{impl} vs einsum attention, bf16 logits, rows 0-2 padded, row 3 not",
            "max |diff| per row " + " / ".join(f"{d:.3g}" for d in row_diff) + f" (max |logit| {scale:.3g})", "",
            "ok: padded rows agree as well as the unpadded one" if ok else "MISMATCH on padded rows")
    if not ok:
        raise AssertionError(f"fused attention ({impl}) differs from the einsum path on padded rows: {row_diff}")


def section_learner_peer(rep: Report, wl: Workload):
    peer = _torch_learner(wl, _rkl_batch(wl, np.random.default_rng(0)))
    rep.figures["learner_torch"] = peer
    if peer is None:
        rep.row("learner", "torch peer", "", "torch/transformers not importable")
        return
    ours = rep.figures.get("learner")
    ratio = "" if not ours else f"opdjax / torch = {ours['tok_s'] / peer['tok_s']:.2f}x"
    rep.row("learner", "peer: transformers + torch eager (bf16 autocast, sdpa, fused AdamW)", "",
            f"{peer['tok_s'] / 1e3:.1f}k tok/s, {peer['tflops']:.0f} TFLOP/s, MFU {peer['mfu']:.1%}", ratio)


def section_learner_einsum(rep: Report, wl: Workload):
    base = _jax_learner(rep, wl, _rkl_batch(wl, np.random.default_rng(0)), "einsum")
    rep.figures["learner_einsum"] = base
    rep.row("learner", "same step, einsum attention (the previous path)",
            f"{base['tok_s'] / 1e3:.1f}k tok/s, MFU {base['mfu']:.1%}", "", f"step {base['step_s'] * 1e3:.1f} ms")


def _kernels_in_loop_body(hlo: str) -> int:
    """Kernel-launching instructions in the largest while-loop body of an optimised HLO module (rough: fusions,
    custom calls, dots, copies, updates, sorts, reductions, gathers and scatters at the body's top level)."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            cur = comps.setdefault(head.group(1), [])
        elif cur is not None and " = " in line:
            cur.append(line.split(" = ", 1)[1])
    kinds = re.compile(r"\b(fusion|custom-call|dot|convolution|copy|dynamic-update-slice|dynamic-slice|sort|reduce|"
                       r"gather|scatter|rng-bit-generator|all-reduce|while|conditional)\(")
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    return max((sum(1 for op in comps.get(b, []) if kinds.search(op)) for b in bodies), default=0)


def _engine_decode(rep: Report, wl: Workload, params, merge_projections: bool | None = None,
                   decode_attention: str = "einsum") -> dict:
    """Time JaxEngine.generate on the workload; tokens/s, ms per step, the HBM bound and kernels per decode step."""
    cfg = wl.cfg
    eng = JaxEngine(cfg, params, dtype=jnp.bfloat16, eos_id=None, merge_projections=merge_projections,
                    decode_attention=decode_attention)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, cfg.vocab_size, wl.gen_prompt).tolist() for _ in range(wl.gen_batch)]
    sp = SamplingParams(max_new_tokens=wl.gen_new, temperature=1.0)
    t = time.perf_counter()
    batch = eng.generate(prompts, sp, seed=0)
    compile_s = time.perf_counter() - t
    times = _time(lambda: eng.generate(prompts, sp, seed=1), 3)
    dt = statistics.median(times)
    n_tok = int(batch.completion_mask_BT.sum())
    step_ms = dt / wl.gen_new * 1e3
    embed = cfg.vocab_size * cfg.hidden_size
    weight_bytes = 2 * (cfg.num_params() - embed)  # every weight once per step but the embedding table (a gather)
    avg_len = wl.gen_prompt + wl.gen_new / 2
    kv_bytes = 2 * wl.gen_batch * avg_len * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    bw = rep.figures.get("copy_gbs", 4300.0) * 1e9
    bound_ms = (weight_bytes + kv_bytes) / bw * 1e3
    res = dict(tok_s=n_tok / dt, step_ms=step_ms, bound_ms=bound_ms, frac_of_bound=bound_ms / step_ms,
               compile_s=compile_s, weight_mb=weight_bytes / 2**20, kv_mb=kv_bytes / 2**20,
               merge_projections=eng.merge_projections, decode_attention=decode_attention)
    try:
        lowered = eng.lower_generate(len(prompts), wl.gen_prompt, sp)
        res["kernels_per_step"] = _kernels_in_loop_body(lowered.compile().as_text())
    except Exception as e:  # noqa: BLE001 - diagnostics only
        res["kernels_per_step"] = f"n/a ({type(e).__name__})"
    return dict(engine=eng, batch=batch, prompts=prompts, sampling=sp, res=res)


def section_engine(rep: Report, wl: Workload) -> dict:
    params = nnx.state(decoder.create(wl.cfg, seed=0, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    st = _engine_decode(rep, wl, params)
    res, step_ms, bound_ms, compile_s = st["res"], st["res"]["step_ms"], st["res"]["bound_ms"], st["res"]["compile_s"]
    rep.figures["engine"] = res
    rep.row("engine", f"JaxEngine decode, bf16, batch {wl.gen_batch}, prompt {wl.gen_prompt}, {wl.gen_new} new",
            f"{res['tok_s'] / 1e3:.1f}k tok/s ({step_ms:.2f} ms/step), **{res['frac_of_bound']:.0%} of HBM bound**",
            "", f"bound {bound_ms:.3f} ms/step ({res['weight_mb']:.0f} MB weights + {res['kv_mb']:.0f} MB KV); "
                  f"~{res['kernels_per_step']} kernels per decode step; first call {compile_s:.0f} s; "
                  f"merged projections {'on' if res['merge_projections'] else 'off'}")
    return dict(st, params=params)


def _engine_variant(rep: Report, wl: Workload, st: dict, key: str, label: str, **engine_kw):
    res = _engine_decode(rep, wl, st["params"], **engine_kw)["res"]
    rep.figures[key] = res
    rep.row("engine", f"same decode, {label}",
            f"{res['tok_s'] / 1e3:.1f}k tok/s ({res['step_ms']:.2f} ms/step), {res['frac_of_bound']:.0%} of bound", "",
            f"~{res['kernels_per_step']} kernels per decode step")


def section_engine_unmerged(rep: Report, wl: Workload, st: dict):
    """The same decode with the other `merge_projections` setting (q/k/v and gate/up separate or merged)."""
    other = not st["res"]["merge_projections"]
    _engine_variant(rep, wl, st, "engine_merge_" + ("on" if other else "off"),
                    f"merged projections {'on' if other else 'off'}", merge_projections=other)


def section_engine_pallas(rep: Report, wl: Workload, st: dict):
    """The same decode with JaxEngine(decode_attention="pallas"): the flash-decoding kernel over the filled slots."""
    _engine_variant(rep, wl, st, "engine_pallas", "Pallas decode attention (filled slots only)",
                    decode_attention="pallas")


def section_engine_peer(rep: Report, wl: Workload, st: dict):
    torch = _torch()
    if torch is None:
        rep.row("engine", "HF generate peer", "", "torch/transformers not importable")
        return
    res = st["res"]
    hf_tok_s = _hf_generate(torch, wl, st["params"])
    res["hf_static_tok_s"] = hf_tok_s
    rep.row("engine", "peer: HF generate, static cache, same batch", "", f"{hf_tok_s / 1e3:.1f}k tok/s",
            f"opdjax / HF = {res['tok_s'] / hf_tok_s:.1f}x")


def _save_hf(cfg: ModelConfig, params, dtype) -> str:
    import tempfile

    from opdjax.models import hf

    out = tempfile.mkdtemp(prefix="accel_check_")
    model = nnx.merge(nnx.graphdef(decoder.abstract(cfg)), jax.tree.map(lambda a: a.astype(jnp.float32), params))
    hf.save_model(out, cfg, model, dtype=jnp.dtype(dtype))
    return out


def _hf_generate(torch, wl: Workload, params) -> float:
    import transformers

    dev = _torch_device(torch)
    path = _save_hf(wl.cfg, params, jnp.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
    ids = torch.randint(1, wl.cfg.vocab_size, (wl.gen_batch, wl.gen_prompt), device=dev)
    kw = dict(max_new_tokens=wl.gen_new, min_new_tokens=wl.gen_new, do_sample=True, cache_implementation="static",
              pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kw)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        model.generate(ids, **kw)
        sync()
        dt = time.perf_counter() - t
    del model
    return wl.gen_batch * wl.gen_new / dt


# -- real FP8 in torch ---------------------------------------------------------------------------------------------

FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def _fp8_linear_forward(torch, lin, mode: str, use_scaled_mm: bool, amax=None):
    """Replace `lin.forward` by a real FP8 GEMM (w8a8) or FP8-stored weights dequantized into bf16 (weights_only).
    amax: the weight amax the scale comes from (a fused layer's, as vLLM serves q/k/v and gate/up; default own)."""
    f8 = torch.float8_e4m3fn
    fmax = torch.finfo(f8).max
    w = lin.weight.data.float()  # [out, in]
    sw = ((w.abs().max() if amax is None else amax).clamp(min=1e-12) / fmax).float()
    w8 = (w / sw).clamp(-fmax, fmax).to(f8)  # [out, in]
    bias = lin.bias

    def weights_only(x):
        y = torch.nn.functional.linear(x, (w8.float() * sw).to(x.dtype))
        return y if bias is None else y + bias

    def w8a8(x):
        shp = x.shape
        x2 = x.reshape(-1, shp[-1]).float()
        sx = (x2.abs().amax(-1, keepdim=True).clamp(min=1e-12) / fmax).float()
        x8 = (x2 / sx).clamp(-fmax, fmax).to(f8)
        if use_scaled_mm:
            y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.reshape(1, 1).expand(1, w8.shape[0]).contiguous(),
                                 out_dtype=torch.bfloat16)
        else:  # torch's FP8 casts, matmul in f32
            y = ((x8.float() * sx) @ (w8.float() * sw).t()).to(torch.bfloat16)
        y = y.reshape(*shp[:-1], -1).to(x.dtype)
        return y if bias is None else y + bias

    lin.forward = weights_only if mode == "weights_only" else w8a8


def _torch_logp(torch, model, tokens: np.ndarray, dev: str) -> np.ndarray:
    t = torch.as_tensor(tokens, device=dev).long()
    with torch.no_grad():
        logits = model(t).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, t[:, 1:, None])[..., 0]
    return np.pad(lp.cpu().numpy(), ((0, 0), (1, 0)))


def section_fp8(rep: Report, wl: Workload, eng_state: dict):
    cfg, params, batch = wl.cfg, eng_state["params"], eng_state["batch"]
    rows = slice(0, wl.score_rows)
    tokens, valid, mask = batch.tokens_BT[rows], batch.valid_BT[rows], batch.completion_mask_BT[rows]
    # XLA attention on both sides: the comparison is about the linear layers, not the attention kernel.
    gd = nnx.graphdef(decoder.abstract(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention="xla"))
    ref = JaxEngine(cfg, params, dtype=jnp.bfloat16, graphdef=gd).score(tokens, valid)["logp_BT"]
    sim = {}
    for name in ("fp8_w8a8", "fp8_weights_only"):
        engine = JaxEngine(cfg, params, dtype=jnp.bfloat16, graphdef=gd, mismatch=EngineMismatch(recipe=name))
        lp = engine.score(tokens, valid)["logp_BT"]
        sim[name] = float(mismatch.metrics(jnp.asarray(ref), jnp.asarray(lp), jnp.asarray(mask))["k3"])
    real, how = {}, "torch unavailable"
    torch = _torch()
    if torch is not None:
        import transformers

        dev = _torch_device(torch)
        path = _save_hf(cfg, params, jnp.bfloat16)
        use_mm = dev == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
        if use_mm:
            try:  # rowwise-scaled FP8 GEMM available in this torch?
                a8 = torch.ones(32, 64, device=dev).to(torch.float8_e4m3fn)
                b8 = torch.ones(32, 64, device=dev).to(torch.float8_e4m3fn)
                torch._scaled_mm(a8, b8.t(), scale_a=torch.ones(32, 1, device=dev),
                                 scale_b=torch.ones(1, 32, device=dev), out_dtype=torch.bfloat16)
            except Exception as e:  # noqa: BLE001
                use_mm = False
                rep.row("fp8", "torch._scaled_mm unavailable", "", "", f"{type(e).__name__}: {e}"[:200])
        how = "torch._scaled_mm" if use_mm else "torch-cast (no FP8 GEMM here)"
        for name, mode in (("fp8_w8a8", "w8a8"), ("fp8_weights_only", "weights_only")):
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
            base = _torch_logp(torch, model, tokens, dev)
            for layer in model.model.layers:
                for group in FUSED_LINEARS:  # one scale per vLLM fused layer, as the simulation's fused_scales
                    mod = layer.self_attn if group[0].endswith(("q_proj", "o_proj")) else layer.mlp
                    lins = [getattr(mod, n) for n in group]
                    amax = max(lin.weight.data.float().abs().max() for lin in lins)
                    for lin in lins:
                        _fp8_linear_forward(torch, lin, mode, use_mm, amax)
            q = _torch_logp(torch, model, tokens, dev)
            real[name] = float(mismatch.metrics(jnp.asarray(base), jnp.asarray(q), jnp.asarray(mask))["k3"])
            del model
    rep.figures["fp8"] = dict(sim=sim, real=real, real_how=how)
    for name in sim:
        r = real.get(name)
        ratio = "" if not r else f"sim/real = {sim[name] / r:.3f}"
        ok = "" if not r else ("in range" if 0.8 <= sim[name] / r <= 1.25 else "OUT OF RANGE")
        rep.row("fp8", f"k3 vs bf16 on the same {int(mask.sum())} tokens, {name}",
                f"sim {sim[name]:.4g}", "" if r is None else f"real ({how}) {r:.4g}", f"{ratio} {ok}".strip())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model, seconds on CPU (for tests)")
    ap.add_argument("--out", default=None, help="write the table and every figure as JSON here")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip optional parts once this much time is spent")
    ap.add_argument("--sections",
                    default="env,qdq,attention,learner,engine,fp8,learner_peer,engine_peer,engine_merge,"
                            "engine_pallas,learner_einsum")
    a = ap.parse_args()
    wl = SMALL if a.small else FULL
    rep = Report(a.budget_s)
    wanted = a.sections.split(",")
    eng_state = None
    failures = 0
    sections = (("env", section_env, 0), ("qdq", section_qdq, 0), ("attention", section_attention_parity, 0),
                ("learner", section_learner, 0),
                ("engine", section_engine, 0), ("fp8", section_fp8, 60), ("learner_peer", section_learner_peer, 60),
                ("engine_peer", section_engine_peer, 60), ("engine_merge", section_engine_unmerged, 60),
                ("engine_pallas", section_engine_pallas, 60),
                ("learner_einsum", section_learner_einsum, 90))
    for name, fn, min_left in sections:
        if name not in wanted:
            continue
        needs_engine = name in ("fp8", "engine_peer", "engine_merge", "engine_pallas")
        if needs_engine and eng_state is None:
            rep.row(name, "skipped", "", "", "needs the engine section's state")
            continue
        if rep.left() < max(min_left, 20):
            rep.row(name, "skipped", "", "", f"time budget of {a.budget_s:.0f} s spent")
            continue
        try:
            out = fn(rep, wl, eng_state) if needs_engine else fn(rep, wl)
            if name == "engine":
                eng_state = out
        except Exception as e:  # noqa: BLE001 - report and go on with the next section
            failures += 1
            traceback.print_exc()
            rep.row(name, "FAILED", "", "", f"{type(e).__name__}: {e}"[:300])
        gc.collect()
    print("\n" + rep.table(), flush=True)
    print(f"\ntotal {time.perf_counter() - rep.t0:.0f} s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=rep.rows, figures=rep.figures, table=rep.table()), f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

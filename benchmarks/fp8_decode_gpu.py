"""FP8 decode on a GPU: one batched decode step, BF16 vs FP8 weights + FP8 KV cache, each at the batch that equal
memory allows, measured next to the bytes-moved model (`opdjax.quant.decode_cost`).

    python benchmarks/fp8_decode_gpu.py                      # a CUDA GPU (H100/H200): real shapes, < 10 min
    python benchmarks/fp8_decode_gpu.py --model-only         # the model alone, any machine, no torch needed
    python benchmarks/fp8_decode_gpu.py --dry-run            # CPU, tiny shape, seconds: plumbing, never speed

Needs torch (and opdjax's own jax/flax imports); no vLLM, no network. For each shape (default Qwen3-1.7B and
Qwen3-8B, random weights) and a memory budget for weights + KV (--memory-gib, default 40) it sizes the batch of
sequences with --context cached tokens each that fits, for BF16 and for FP8 (recipe fp8_w8a8_kv: decoder linears
e4m3 with one per-tensor scale, fused qkv / gate_up sharing one; embeddings, norms and LM head BF16; KV cache e4m3
with scale 1.0), and times one decode step (greedy, the cache full, a CUDA graph when capture works) as:

  bf16            BF16 weights and KV at the BF16 batch
  fp8 @ bf16 B    FP8 weights and KV at the BF16 batch (the per-token speed-up alone)
  fp8             FP8 weights and KV at the FP8 batch (what the memory buys)

FP8 GEMMs: `torch._scaled_mm` with e4m3 activations (dynamic per-token scale, row-wise) and e4m3 weights (per-tensor
scale broadcast row-wise); a per-tensor activation scale when row-wise is refused; where `_scaled_mm` is missing
(or with --emulate) both are dequantized to BF16 first, labelled "emulated". Attention over the FP8 cache is not a
fused FP8 kernel: each layer dequantizes its K/V to a BF16 copy and runs `scaled_dot_product_attention` on it (more
bytes than a fused read: the model is printed both ways). Every output names what is model and what is measured.
A correctness check runs first on a tiny shape on the same device: FP8 logits close to BF16 logits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from opdjax import quant  # noqa: E402
from opdjax.models.config import ModelConfig  # noqa: E402
from opdjax.models.presets import model_config  # noqa: E402
from opdjax.quant import decode_cost  # noqa: E402

GIB = 1 << 30
FP8_RECIPE = "fp8_w8a8_kv"
E4M3_MAX = 448.0
TINY = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True, qk_norm=True)
CONFIGS = (("bf16", False, "bf16"), ("fp8 @ bf16 B", True, "bf16"), ("fp8", True, "fp8"))


def shape_config(name: str) -> ModelConfig:
    """A named shape: "tiny" (the dry run's) or an `opdjax.models.presets` name (qwen3-1.7b, qwen3-8b, ...)."""
    return TINY if name == "tiny" else model_config(name)


# ----------------------------------------------------------------------------------------------------------------------
# The model (no torch)
# ----------------------------------------------------------------------------------------------------------------------

def model_rows(cfg, memory_bytes: int, context: int, bandwidth: float, attn: str = "triton") -> list[dict]:
    """One row per CONFIGS entry: batch, KV tokens and the modelled step at `bandwidth`: "model" reads the FP8
    cache once (fused), "model_as_timed" models the attention `attn` the script times ("sdpa": + a BF16 copy)."""
    fp8 = quant.get_recipe(FP8_RECIPE)
    b_bf16 = decode_cost.max_batch(cfg, memory_bytes, context)
    if b_bf16 == 0:
        raise ValueError(f"no BF16 sequence of {context} tokens fits in {memory_bytes / GIB:.2f} GiB next to the "
                         f"weights ({quant.weight_bytes(cfg) / GIB:.2f} GiB): raise --memory-gib or lower --context")
    rows = []
    for label, is_fp8, at in CONFIGS:
        recipe = fp8 if is_fp8 else None
        batch = b_bf16 if at == "bf16" else decode_cost.max_batch(cfg, memory_bytes, context, recipe)
        fused = decode_cost.decode_model(cfg, memory_bytes, context, bandwidth, recipe, batch=batch)
        timed = decode_cost.decode_model(cfg, memory_bytes, context, bandwidth, recipe, batch=batch,
                                         kv_dequant_copy=attn == "sdpa")
        rows.append({"config": label, "fp8": is_fp8, "batch": batch, "kv_tokens": batch * context,
                     "model": fused, "model_as_timed": timed})
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# Torch: weights, FP8 GEMMs, the decode step
# ----------------------------------------------------------------------------------------------------------------------

def fp8_quantize(w, torch):
    """(e4m3 tensor, float32 scale) with scale = amax(w) / 448 (one per tensor)."""
    scale = (w.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def gemm_modes(torch, device: str, emulate: bool) -> str:
    """The FP8 GEMM this device runs: "rowwise" (per-token activation scales), "tensorwise" (one scale), or
    "emulated" (dequantize to BF16, then a BF16 matmul). Probed on a 31 x 64 x 48 product against the emulation."""
    if emulate or not hasattr(torch, "_scaled_mm"):
        return "emulated"
    a = torch.randn(31, 64, device=device).to(torch.float8_e4m3fn)  # an odd batch, as the real ones are
    w = torch.randn(48, 64, device=device).to(torch.float8_e4m3fn)
    want = a.float() @ w.float().t()
    for mode, sa, sb in (("rowwise", torch.ones(31, 1, device=device), torch.ones(1, 48, device=device)),
                         ("tensorwise", torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))):
        try:
            got = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        if float((got - want).abs().max()) <= 0.02 * float(want.abs().max()) + 1e-3:
            return mode
    return "emulated"


def make_linear(w, fp8: bool, torch):
    """A linear layer y = x @ w.T (w [out, in], BF16): kept BF16, or e4m3 with its per-tensor scale."""
    if not fp8:
        return {"w": w}
    q, s = fp8_quantize(w, torch)
    return {"q": q, "s": s, "s_row": s.reshape(1, 1).expand(1, w.shape[0]).contiguous()}


def linear(x, lin, mode: str, torch):
    """x [B, in] BF16 -> [B, out] BF16 through the layer's BF16 weight or its FP8 GEMM (`mode`, see gemm_modes).
    FP8: x quantized to e4m3 with a dynamic scale amax/448 per row ("rowwise") or over x ("tensorwise")."""
    if "w" in lin:
        return x @ lin["w"].t()
    per_row = mode in ("rowwise", "emulated")
    amax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()
    sx = (amax.float() / E4M3_MAX).clamp(min=1e-12)
    xq = (x.float() / sx).to(torch.float8_e4m3fn)
    if mode == "emulated":
        return ((xq.float() * sx) @ (lin["q"].float() * lin["s"]).t()).to(torch.bfloat16)
    sb = lin["s_row"] if mode == "rowwise" else lin["s"]
    return torch._scaled_mm(xq, lin["q"].t(), scale_a=sx, scale_b=sb, out_dtype=torch.bfloat16)


def random_weights(cfg, device: str, seed: int, torch) -> dict:
    """BF16 random weights in torch layout ([out, in]), fused qkv and gate_up, scaled 1/sqrt(in)."""
    g = torch.Generator(device=device).manual_seed(seed)
    E, F, H, K, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) / math.sqrt(shape[-1]))

    ones = lambda n: torch.ones(n, device=device, dtype=torch.bfloat16)  # noqa: E731
    layers = [{"ln1": ones(E), "ln2": ones(E), "qn": ones(D), "kn": ones(D), "qkv": rnd((H + 2 * K) * D, E),
               "o": rnd(E, H * D), "gate_up": rnd(2 * F, E), "down": rnd(E, F)} for _ in range(cfg.num_layers)]
    embed = torch.randn(cfg.vocab_size, E, generator=g, device=device, dtype=torch.bfloat16)
    lm_head = embed if cfg.tie_word_embeddings else rnd(cfg.vocab_size, E)
    return {"layers": layers, "embed": embed, "lm_head": lm_head, "norm": ones(E)}


def to_serving(weights: dict, fp8: bool, torch, keep_bf16: bool = True) -> dict:
    """The weights a step reads: every decoder linear through make_linear (FP8 or BF16). keep_bf16=False frees each
    BF16 linear as it is quantized (the real shapes do not hold both copies)."""
    out = {k: v for k, v in weights.items() if k != "layers"}
    out["layers"] = []
    for layer in weights["layers"]:
        new = {}
        for k, v in list(layer.items()):
            new[k] = make_linear(v, fp8, torch) if k in ("qkv", "o", "gate_up", "down") else v
            if fp8 and not keep_bf16 and k in ("qkv", "o", "gate_up", "down"):
                del layer[k]
        out["layers"].append(new)
    return out


def rms(x, w, eps: float, torch):
    """RMSNorm over the last axis, computed in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16) * w


def rope(x, pos: int, theta: float, torch):
    """Rotary embedding (rotate-half) of x [B, N, D] at position `pos`."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    x1, x2 = x.float()[..., : D // 2], x.float()[..., D // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(torch.bfloat16)


def make_cache(cfg, batch: int, context: int, fp8: bool, device: str, seed: int, torch) -> list:
    """Per layer (K, V) of shape [batch, kv_heads, context, head_dim], random N(0, 1/4): BF16 or e4m3 (scale 1.0,
    the value as it is: every |x| < 448)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, cfg.num_kv_heads, context, cfg.head_dim)
    out = []
    for _ in range(cfg.num_layers):
        kv = []
        for _ in range(2):
            t = torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * 0.5
            kv.append(t.to(torch.float8_e4m3fn) if fp8 else t)
            del t
        out.append(tuple(kv))
    return out


_KERNEL: dict = {}


def triton_kernel():
    """The Triton decode-attention kernel (built on first use, so TRITON_INTERPRET set before it applies): one
    program per (sequence, KV head) streams its K/V blocks in their storage dtype (BF16 or e4m3), converts them to
    float32 in registers (tl.dot: TF32 on a GPU), and keeps an online softmax for the G = heads / kv_heads queries
    that share them."""
    if "k" in _KERNEL:
        return _KERNEL["k"]
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, o_ptr, L, sm_scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
               BN: tl.constexpr):
        b, kh, nkv = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        g, d = tl.arange(0, GP), tl.arange(0, D)
        rows = ((b * nkv + kh) * G + g)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + rows, mask=(g < G)[:, None], other=0.0).to(tl.float32)
        base = (b * nkv + kh) * L * D
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(0, L, BN):
            n = start + tl.arange(0, BN)
            off = base + n[:, None] * D + d[None, :]
            k = tl.load(k_ptr + off, mask=(n < L)[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            s = tl.where((n < L)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + off, mask=(n < L)[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        tl.store(o_ptr + rows, (acc / l_i[:, None]).to(tl.bfloat16), mask=(g < G)[:, None])

    _KERNEL["k"] = kernel
    return kernel


def triton_attention(q, kc, vc, torch):
    """q [B, H, D] BF16 over the cache kc, vc [B, K, L, D] (BF16 or e4m3, scale 1.0) -> [B, H, D] BF16."""
    B, H, D = q.shape
    K, L = kc.shape[1], kc.shape[2]
    G = H // K
    out = torch.empty_like(q)
    triton_kernel()[(B, K)](q.contiguous(), kc, vc, out, L, D ** -0.5, G=G, GP=max(16, 1 << (G - 1).bit_length()),
                            D=D, BN=64)
    return out


def attention(q, k, v, kc, vc, pos: int, impl: str, torch):
    """Write the new k, v [B, K, D] at slot `pos` of the cache (e4m3 when the cache is) and attend over every slot:
    q [B, H, D] -> [B, H * D]. impl "triton": triton_attention reads either cache as stored; "sdpa": an FP8 cache
    is dequantized to a BF16 copy first (scale 1.0), then read by scaled_dot_product_attention."""
    kc[:, :, pos] = k.to(kc.dtype)
    vc[:, :, pos] = v.to(vc.dtype)
    if impl == "triton":
        return triton_attention(q, kc, vc, torch).reshape(q.shape[0], -1)
    kk, vv = (kc, vc) if kc.dtype == torch.bfloat16 else (kc.to(torch.bfloat16), vc.to(torch.bfloat16))
    o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True)
    return o.reshape(q.shape[0], -1)


def decode_step(cfg, w: dict, cache: list, tokens, pos: int, mode: str, attn: str, torch):
    """One greedy decode step of a Qwen3-style decoder: tokens [B] -> (next tokens [B], logits [B, V] BF16);
    linears through `linear(mode)`, attention through `attention(attn)`."""
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    B, eps = tokens.shape[0], cfg.rms_norm_eps
    h = w["embed"][tokens]
    for layer, (kc, vc) in zip(w["layers"], cache):
        qkv = linear(rms(h, layer["ln1"], eps, torch), layer["qkv"], mode, torch)
        q, k, v = qkv.split([H * D, K * D, K * D], dim=-1)
        q = rope(rms(q.reshape(B, H, D), layer["qn"], eps, torch), pos, cfg.rope_theta, torch)
        k = rope(rms(k.reshape(B, K, D), layer["kn"], eps, torch), pos, cfg.rope_theta, torch)
        h = h + linear(attention(q, k, v.reshape(B, K, D), kc, vc, pos, attn, torch), layer["o"], mode, torch)
        gu = linear(rms(h, layer["ln2"], eps, torch), layer["gate_up"], mode, torch)
        g, u = gu.chunk(2, dim=-1)
        h = h + linear(torch.nn.functional.silu(g) * u, layer["down"], mode, torch)
    logits = rms(h, w["norm"], eps, torch) @ w["lm_head"].t()
    return logits.argmax(-1), logits


# ----------------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------------

def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def runner(fn, torch, device: str, graph: bool):
    """(callable, how): a CUDA graph of fn when graph and capture works, else fn eagerly."""
    fn()  # warm up (cuBLAS handles, kernels)
    fn()
    if not (graph and device.startswith("cuda")):
        return fn, "eager"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        _sync(torch, device)
        return g.replay, "cuda graph"
    except Exception as e:  # noqa: BLE001 - any capture failure: time eagerly and say why
        return fn, f"eager (graph capture failed: {type(e).__name__})"


def time_step(fn, iters: int, torch, device: str) -> float:
    """Median seconds of one call over `iters` calls (each synchronised)."""
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync(torch, device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def copy_bandwidth(torch, device: str, nbytes: int) -> float | None:
    """Device copy bandwidth in bytes/s (read + write of an nbytes buffer), CUDA only."""
    if not device.startswith("cuda"):
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * nbytes / time_step(lambda: b.copy_(a), 10, torch, device)


def measure_shape(cfg, rows: list[dict], context: int, mode: str, a, torch) -> None:
    """Time every row of `rows` (model_rows) in place: step_s, per_token_s, tok_s, how it ran."""
    w_bf16 = random_weights(cfg, a.device, a.seed, torch)
    pos = context - 1
    for is_fp8 in (False, True):
        w = to_serving(w_bf16, is_fp8, torch, keep_bf16=False)
        mine = [r for r in rows if r["fp8"] == is_fp8]
        cache = make_cache(cfg, max(r["batch"] for r in mine), context, is_fp8, a.device, a.seed + 1, torch)
        for r in mine:
            b = r["batch"]
            sub = [(k[:b], v[:b]) for k, v in cache]
            tokens = torch.arange(b, device=a.device) % cfg.vocab_size
            fn, how = runner(lambda: decode_step(cfg, w, sub, tokens, pos, mode if is_fp8 else "bf16", a.attention,
                                                 torch), torch, a.device, not a.no_graph)
            step_s = time_step(fn, a.iters, torch, a.device)
            r["measured"] = {"kind": "measured", "step_s": step_s, "per_token_s": step_s / b, "tok_s": b / step_s,
                             "how": how, "gemm": mode if is_fp8 else "bf16", "attention": a.attention}
            del fn
        cache = w = sub = None  # free this precision's weights and cache before the next
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()


def check_fp8_close(mode: str, a, torch) -> dict:
    """On the tiny shape and this device: one step with FP8 weights + KV against BF16 on the same weights and
    cache values; relative L2 error of the logits, and of this GEMM mode against the emulation."""
    w = random_weights(TINY, a.device, a.seed, torch)
    cache = make_cache(TINY, 4, 64, False, a.device, a.seed + 1, torch)
    as_fp8 = lambda: [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in cache]  # noqa: E731
    tokens = torch.arange(4, device=a.device)
    _, ref = decode_step(TINY, to_serving(w, False, torch), [(k.clone(), v.clone()) for k, v in cache], tokens, 63,
                         "bf16", "sdpa", torch)
    wq = to_serving(w, True, torch)
    _, got = decode_step(TINY, wq, as_fp8(), tokens, 63, mode, a.attention, torch)
    _, emu = decode_step(TINY, wq, as_fp8(), tokens, 63, "emulated", "sdpa", torch)
    rel = lambda x, y: float((x.float() - y.float()).norm() / y.float().norm())  # noqa: E731
    out = {"fp8_vs_bf16": rel(got, ref), "gemm_vs_emulated": rel(got, emu), "gemm": mode}
    out["ok"] = out["fp8_vs_bf16"] < 0.2 and out["gemm_vs_emulated"] < 0.05
    return out


def check_triton_attention(a, torch) -> dict | None:
    """triton_attention against scaled_dot_product_attention on a BF16 and an e4m3 cache (B 3, 4 KV heads, G 2,
    L 100: a partial last block), max |difference| over max |reference|; None where Triton is missing."""
    try:
        triton_kernel()
    except ImportError:
        return None
    g = torch.Generator(device=a.device).manual_seed(a.seed)
    q = torch.randn(3, 8, 32, generator=g, device=a.device).to(torch.bfloat16)
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        kc, vc = (torch.randn(3, 4, 100, 32, generator=g, device=a.device).mul(0.5).to(dt) for _ in range(2))
        got = triton_attention(q, kc, vc, torch).float()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], kc.to(torch.bfloat16), vc.to(torch.bfloat16), enable_gqa=True)[:, :, 0].float()
        out[name] = float((got - ref).abs().max() / ref.abs().max())
    out["ok"] = max(out.values()) < 0.02
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------------

def table(shape: str, rows: list[dict], dry: bool) -> str:
    """Markdown: per config the batch, then per-token time and tokens/s, model beside measured, and the ratio of
    tokens/s to the BF16 row (model: fused FP8 KV read; "as timed": the dequantize-then-read path)."""
    base = rows[0]
    meas = "measured (dry run: plumbing, not speed)" if dry else "measured"
    lines = [f"| {shape} | batch | KV tokens | model µs/token | model µs/token as timed | {meas} µs/token | "
             f"model tok/s | {meas} tok/s | model tok/s ratio | {meas} tok/s ratio |", "|---" * 10 + "|"]
    for r in rows:
        m, t, x = r["model"], r["model_as_timed"], r.get("measured")
        ratio_m = m["tok_s"] / base["model"]["tok_s"]
        xs = ("—", "—", "—") if x is None else (f"{x['per_token_s'] * 1e6:.2f}", f"{x['tok_s']:,.0f}",
                                                 f"{x['tok_s'] / base['measured']['tok_s']:.2f}×")
        lines.append(f"| {r['config']} | {r['batch']} | {r['kv_tokens']:,} | {m['per_token_s'] * 1e6:.2f} | "
                     f"{t['per_token_s'] * 1e6:.2f} | {xs[0]} | {m['tok_s']:,.0f} | {xs[1]} | {ratio_m:.2f}× | "
                     f"{xs[2]} |")
    return "\n".join(lines)


def device_bandwidth(a, torch) -> tuple[float, str]:
    """(bytes/s, name) for the model: --bandwidth, else the nominal figure of the GPU's name, else H100 SXM."""
    if a.bandwidth:
        return decode_cost.bandwidth_of(a.bandwidth), str(a.bandwidth)
    name = torch.cuda.get_device_name() if torch is not None and a.device.startswith("cuda") else ""
    key = "h200" if "H200" in name else "h100-pcie" if "H100" in name and "PCIe" in name else "h100-sxm"
    return decode_cost.BANDWIDTHS[key], key


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-1.7b,qwen3-8b", help="comma list: presets or 'tiny'")
    ap.add_argument("--memory-gib", type=float, default=40.0, help="device memory for weights + KV cache, GiB")
    ap.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    ap.add_argument("--bandwidth", default=None, help="model denominator: h100-sxm, h200, or bytes/s (TB/s < 1e6)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="torch device (default cuda when available)")
    ap.add_argument("--attention", choices=("auto", "triton", "sdpa"), default="auto",
                    help="triton: one kernel reads either cache as stored; sdpa: FP8 dequantized to a BF16 copy "
                         "first; auto: triton on a GPU where importable, else sdpa")
    ap.add_argument("--emulate", action="store_true", help="FP8 GEMMs dequantized to BF16 (no torch._scaled_mm)")
    ap.add_argument("--no-graph", action="store_true", help="time eagerly, no CUDA graph")
    ap.add_argument("--model-only", action="store_true", help="print the model, measure nothing")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, 1 MiB, context 64: plumbing only")
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.shapes, a.memory_gib, a.context, a.iters, a.device = "tiny", 1 / 1024, 64, 2, a.device or "cpu"
    return a


def resolve_attention(a) -> str:
    """--attention auto: "triton" on a CUDA device where Triton imports (and for --model-only), else "sdpa". On a
    CPU, Triton (when installed) only runs in its interpreter: TRITON_INTERPRET=1 is set (before Triton is imported)
    for the kernel check."""
    have = importlib.util.find_spec("triton") is not None
    if a.device is not None and not a.device.startswith("cuda") and have:
        os.environ["TRITON_INTERPRET"] = "1"
    if a.attention != "auto":
        return a.attention
    if a.device is None:
        return "triton"  # --model-only: model the path a GPU run takes
    return "triton" if have and a.device.startswith("cuda") else "sdpa"


def device_checks(a, res: dict, torch) -> bool:
    """Pick the FP8 GEMM, measure the copy bandwidth, run the correctness checks; print them; True iff they pass."""
    if a.device.startswith("cuda") and not a.dry_run:
        free = torch.cuda.mem_get_info()[0]
        if a.memory_gib * GIB * 1.15 > free:
            raise SystemExit(f"--memory-gib {a.memory_gib:g} (+15% for activations and the attention scratch) "
                             f"exceeds the free device memory {free / GIB:.1f} GiB: lower --memory-gib")
    mode = gemm_modes(torch, a.device, a.emulate)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"cpu, torch {torch.__version__}"
    res.update(device=dev, gemm=mode, copy_bandwidth=copy_bandwidth(torch, a.device, 1 << 30))
    res["check"] = check_fp8_close(mode, a, torch)
    res["check_attention"] = check_triton_attention(a, torch)
    print(f"measured on {dev}; FP8 GEMM: {mode}" + (" (FP8 dequantized to BF16, then a BF16 matmul: emulated)"
                                                    if mode == "emulated" else " (torch._scaled_mm)"))
    print("attention: " + ("one Triton kernel reads the BF16 or e4m3 cache as stored (fused FP8 read)"
                           if a.attention == "triton" else
                           "scaled_dot_product_attention; an FP8 cache is dequantized to a BF16 copy per layer first"))
    if res["copy_bandwidth"]:
        print(f"measured copy bandwidth: {res['copy_bandwidth'] / 1e12:.2f} TB/s")
    c, t = res["check"], res["check_attention"]
    print(f"check (tiny shape, this device): FP8 vs BF16 logits rel. error {c['fp8_vs_bf16']:.3f} (< 0.2), "
          f"this GEMM + attention vs emulated GEMM + SDPA {c['gemm_vs_emulated']:.4f} (< 0.05): "
          f"{'ok' if c['ok'] else 'FAILED'}")
    print("check Triton attention vs SDPA: " + ("Triton not installed" if t is None else
          f"bf16 {t['bf16']:.4f}, fp8 {t['fp8']:.4f} (< 0.02): {'ok' if t['ok'] else 'FAILED'}"))
    return c["ok"] and (t is None or t["ok"]) and (t is not None or a.attention != "triton")


def main(argv=None) -> int:
    a = parse(argv)
    torch = None
    if not a.model_only:
        import torch

        a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if a.device == "cpu" and not a.dry_run:
            raise SystemExit("real shapes on a CPU would take hours: use --dry-run (plumbing) or --model-only")
    a.attention = resolve_attention(a)
    bw, bw_name = device_bandwidth(a, torch)
    res = {"args": vars(a), "bandwidth": bw, "bandwidth_name": bw_name, "shapes": {}}
    print(f"model: bytes moved / {bw / 1e12:.2f} TB/s ({bw_name}); weights + KV in {a.memory_gib:g} GiB, "
          f"{a.context} cached tokens per sequence; FP8 = {FP8_RECIPE}; 'as timed' = {a.attention} attention"
          + (" (FP8 KV dequantized to a BF16 copy)" if a.attention == "sdpa" else " (FP8 KV read as stored)"))
    ok = device_checks(a, res, torch) if torch is not None else True
    for shape in a.shapes.split(","):
        cfg = shape_config(shape)
        rows = model_rows(cfg, int(a.memory_gib * GIB), a.context, bw, a.attention)
        if torch is not None:
            t0 = time.perf_counter()
            measure_shape(cfg, rows, a.context, res["gemm"], a, torch)
            print(f"[{shape}: measured in {time.perf_counter() - t0:.1f} s, {rows[0]['measured']['how']}]")
        res["shapes"][shape] = rows
        print(table(shape, rows, a.dry_run), flush=True)
    res["ok"] = ok
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

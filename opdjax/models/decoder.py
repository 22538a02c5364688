"""One decoder-only family in Flax NNX: Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim).

GQA, RoPE (default / linear / llama3), RMSNorm, SwiGLU, tied or untied embeddings, f32 or bf16 compute. Every
param carries `logical_axes` metadata that `opdjax.sharding` maps onto a device mesh. Linear kernels are stored
[in, out] (HF's `weight` transposed). Each Linear knows its HF module name, which is what quantization recipes
select on.

Attention. With a cache (prefill, decode) queries at cache slots `index + [0, T)` attend to every filled cache slot
at or before them, through plain einsums (`attention="einsum"` semantics). Without a cache (the learner, scoring)
the forward is causal self-attention over T tokens with padded keys masked, through the fused
`jax.nn.dot_product_attention`: `attention="auto"` picks cuDNN flash attention on GPU for bf16/f16 compute and
head_dim <= 128 (it skips the masked upper triangle), XLA's implementation elsewhere (CPU; TPU, where JAX ships
no kernel behind this API); "xla", "cudnn" and "einsum" force one. `remat` ("none", "block": recompute each block
in the backward pass, "dots": keep only matmul outputs) trades compute for activation memory.
`return_hidden=True` returns the final-norm hidden states instead of logits, for log-probs computed in chunks
(`opdjax.logprobs.chunked_token_logprobs`) so that [B, T, V] logits never exist at once.

Merged projections (`merge_projections`): q/k/v and gate/up read the same input, so each group can run as one
matmul against its kernels concatenated along the output axis (2 matmuls per layer where there were 5). Every
output is the same dot product; only the matmul's shape, and so possibly its rounding, changes. An inference
engine on GPU wants fewer, larger kernels (a decode step is a chain of small ones); XLA:CPU runs the separate dots
of a group concurrently on its threads and is faster without merging.

Decode attention (`decode_attention`, one query per row through a cache): "einsum" (every cache slot, masked) or
"pallas", JAX's Pallas flash-decoding kernel (`pallas_decode_attention`), which reads only the filled slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

from opdjax.models.config import ModelConfig, rope_inv_freq

Array = jax.Array
_MASKED = -1e30  # finite, so a query with no visible key gives a uniform (not NaN) softmax
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "einsum")
DECODE_ATTENTION_IMPLS = ("einsum", "pallas")
PALLAS_DECODE_SPLIT = 64  # cache slots per program of the Pallas decode kernel; its caches are a multiple of this
REMAT_POLICIES = ("none", "block", "dots")


def resolve_attention(impl: str, dtype: Any, head_dim: int, backend: str | None = None) -> str:
    """The attention implementation "auto" stands for on `backend` (default: JAX's default backend).

    cuDNN flash attention on GPU when the compute dtype is bf16/f16 and head_dim <= 128 (a multiple of 8), else XLA.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention={impl!r} is not valid; choose one of {list(ATTENTION_IMPLS)}")
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    cudnn_ok = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim <= 128 \
        and head_dim % 8 == 0
    return "cudnn" if backend in ("gpu", "cuda") and cudnn_ok else "xla"


class ForwardQuant(Protocol):
    """Simulated-quantization hooks the forward calls at trace time (see `opdjax.quant`)."""

    def act(self, module: str, x: Array) -> Array: ...

    def kv(self, layer: int, kind: str, x_BTKD: Array) -> Array: ...

    def quantizes(self, module: str) -> bool: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MergedProjections:
    """One layer's projections that share an input, concatenated along the output axis (`merge_projections`):
    qkv_kernel [E, (H + 2K) D] = [q | k | v] (qkv_bias likewise, when the model has q/k/v biases) and
    gate_up_kernel [E, 2F] = [gate | up]. None where a group stays separate."""

    qkv_kernel: Array | None
    qkv_bias: Array | None
    gate_up_kernel: Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer keys/values [B, K, S, D] (heads before slots, the layout the attention dots read without a
    transpose), which slots hold real tokens [B, S], and the next write slot."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    valid_BS: Array
    index: Array  # int32 scalar

    @property
    def max_len(self) -> int:
        return int(self.valid_BS.shape[1])


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for `batch` rows and `max_len` slots."""
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   valid_BS=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32))


def grow_cache(cache: KVCache, max_len: int) -> KVCache:
    """The cache with `max_len` >= cache.max_len slots: k/v [B, K, S, D] -> [B, K, max_len, D] and valid_BS
    [B, S] -> [B, max_len], the new slots zero and invalid (what `init_cache` puts there), index unchanged."""
    pad = int(max_len) - cache.max_len
    if pad < 0:
        raise ValueError(f"grow_cache: cannot shrink a cache of {cache.max_len} slots to {max_len}")
    if pad == 0:
        return cache
    widen = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0)))  # noqa: E731
    return KVCache(k=tuple(map(widen, cache.k)), v=tuple(map(widen, cache.v)),
                   valid_BS=jnp.pad(cache.valid_BS, ((0, 0), (0, pad))), index=cache.index)


def _param(rngs: nnx.Rngs, shape, axes, dtype, std=0.02, init=None) -> nnx.Param:
    value = init(shape, dtype) if init is not None else std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, logical_axes=axes)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out]."""

    def __init__(self, din: int, dout: int, axes: tuple[str, str], *, name: str, bias: bool, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.name = name
        self.dtype = dtype
        self.kernel = _param(rngs, (din, dout), axes, param_dtype)
        self.bias = _param(rngs, (dout,), axes[1:], param_dtype, init=jnp.zeros) if bias else None

    def __call__(self, x: Array, quant: ForwardQuant | None = None) -> Array:
        if quant is not None:
            x = quant.act(self.name, x)
        y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """scale * (x / sqrt(mean(x^2) + eps)), the normalisation computed in f32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.eps = eps
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * y.astype(self.dtype)


def pallas_decode_attention(q_BKGD: Array, k_BKSD: Array, v_BKSD: Array, start_B: Array, end: Array, *,
                            interpret: bool | None = None) -> Array:
    """out[b, k, g] = softmax_s(q[b, k, g] . k[b, k, s] / sqrt(D)) v[b, k, s] over slots start_b <= s < end: one
    query per row and query head (G per KV head), [B, K, G, D] in q's dtype.

    JAX's Pallas flash-decoding kernel (`jax.experimental.pallas.ops.gpu.decode_attention`, Triton on GPU), called
    per (row, KV head) on the cache's own [B, K, S, D] layout: the S slots are split in chunks of
    `PALLAS_DECODE_SPLIT` (S must be a multiple), each program loads only the slots of its chunk inside
    [start, end) — attention over the filled part of the cache, not all S slots — and the chunks' partial
    softmaxes are combined after. interpret (default: on any backend but GPU) runs the kernel as plain JAX ops.
    """
    B, K, G, D = q_BKGD.shape
    S = k_BKSD.shape[2]
    if S % PALLAS_DECODE_SPLIT:
        raise ValueError(f"pallas decode attention needs a cache length that is a multiple of "
                         f"{PALLAS_DECODE_SPLIT}, got {S}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    one = functools.partial(pallas_decode.decode_attn_unbatched, sm_scale=D**-0.5, block_h=16,
                            block_k=PALLAS_DECODE_SPLIT, k_splits=S // PALLAS_DECODE_SPLIT, num_warps=None,
                            num_stages=2, grid=None, interpret=interpret, debug=False, return_residuals=False,
                            normalize_output=True)
    start_BK = jnp.broadcast_to(start_B.astype(jnp.int32)[:, None], (B, K))
    end_BK = jnp.broadcast_to(jnp.asarray(end, jnp.int32), (B, K))
    return jax.vmap(jax.vmap(one))(q_BKGD, k_BKSD, v_BKSD, start_BK, end_BK)


def rope_cos_sin(cfg: ModelConfig, positions_BT: Array) -> tuple[Array, Array]:
    """cos, sin [B, T, D] for positions, frequencies repeated twice along D (HF's rotate-half layout)."""
    inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    freqs = positions_BT.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTHD: Array, cos_BTD: Array, sin_BTD: Array) -> Array:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]."""
    half = x_BTHD.shape[-1] // 2
    rot = jnp.concatenate([-x_BTHD[..., half:], x_BTHD[..., :half]], axis=-1)
    c, s = cos_BTD[:, :, None, :].astype(x_BTHD.dtype), sin_BTD[:, :, None, :].astype(x_BTHD.dtype)
    return x_BTHD * c + rot * s


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pre = f"model.layers.{layer}.self_attn"
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layer = layer
        self.cfg = cfg
        self.dtype = dtype
        self.q = Linear(E, H * D, ("embed", "heads"), name=f"{pre}.q_proj", bias=cfg.attention_bias, **kw)
        self.k = Linear(E, K * D, ("embed", "kv_heads"), name=f"{pre}.k_proj", bias=cfg.attention_bias, **kw)
        self.v = Linear(E, K * D, ("embed", "kv_heads"), name=f"{pre}.v_proj", bias=cfg.attention_bias, **kw)
        self.o = Linear(H * D, E, ("heads", "embed"), name=f"{pre}.o_proj", bias=False, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x_BTE: Array, quant: ForwardQuant | None,
                    merged: MergedProjections | None = None) -> tuple[Array, Array, Array]:
        """q [B, T, H*D], k and v [B, T, K*D]: three matmuls, or one against merged.qkv_kernel (the input through
        the activation hook once: the group's modules are quantized alike, or it would not be merged)."""
        if merged is None or merged.qkv_kernel is None:
            return self.q(x_BTE, quant), self.k(x_BTE, quant), self.v(x_BTE, quant)
        if quant is not None:
            x_BTE = quant.act(self.q.name, x_BTE)
        y = jnp.dot(x_BTE.astype(self.dtype), merged.qkv_kernel.astype(self.dtype))
        if merged.qkv_bias is not None:
            y = y + merged.qkv_bias.astype(self.dtype)
        HD, KD = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        q, k, v = jnp.split(y, [HD, HD + KD], axis=-1)
        return q, k, v

    def __call__(self, x_BTE, cos, sin, k_cache, v_cache, visible_BTS, index, quant, fused: str | None = None,
                 merged: MergedProjections | None = None, span: tuple[Array, Array] | None = None):
        """Attend from T new tokens to the keys visible_BTS marks.

        With a cache (k_cache, v_cache [B, K, S, D]) the new keys/values are written at slots index..index+T and
        the queries attend over all S slots through einsums, or (fused "pallas", T = 1) over the slots
        span = (start_B, end) only, through `pallas_decode_attention`. Without one (None: the cache-free forward,
        S == T) the keys are the T new ones, through `jax.nn.dot_product_attention` when `fused` names its
        implementation ("xla" / "cudnn"), else the same einsums.
        """
        cfg = self.cfg
        B, T, _ = x_BTE.shape
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = self.project_qkv(x_BTE, quant, merged)
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if quant is not None:
            k, v = quant.kv(self.layer, "k", k), quant.kv(self.layer, "v", v)
        dt = self.dtype
        if k_cache is None and fused is not None:
            out = jax.nn.dot_product_attention(q.astype(dt), k.astype(dt), v.astype(dt),
                                               mask=visible_BTS[:, None], scale=D**-0.5,
                                               is_causal=fused == "cudnn", implementation=fused)
            return self.o(out.reshape(B, T, H * D), quant), None, None
        if k_cache is None:
            k_all, v_all = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        else:
            k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3).astype(k_cache.dtype),
                                                   (0, 0, index, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).astype(v_cache.dtype),
                                                   (0, 0, index, 0))
            k_all, v_all = k_cache, v_cache
            if fused == "pallas":
                out = pallas_decode_attention(q.reshape(B, K, H // K, D).astype(k_cache.dtype), k_cache, v_cache,
                                              *span)
                return self.o(out.reshape(B, T, H * D).astype(dt), quant), k_cache, v_cache
        qg = q.reshape(B, T, K, H // K, D)
        scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_all.astype(dt)).astype(jnp.float32) * D**-0.5
        scores = jnp.where(visible_BTS[:, None, None, :, :], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        # Heads-major output, then one transpose (a bitcast at T = 1): the same sums as writing "btkgd" directly,
        # which XLA:CPU lowers to a dot with a strided output layout, 2-3x slower (measured at decode shapes).
        out = jnp.einsum("bkgts,bksd->bkgtd", probs, v_all.astype(dt)).transpose(0, 3, 1, 2, 4).reshape(B, T, H * D)
        return self.o(out, quant), k_cache, v_cache


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        E, F = cfg.hidden_size, cfg.intermediate_size
        pre = f"model.layers.{layer}.mlp"
        kw = dict(bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate = Linear(E, F, ("embed", "mlp"), name=f"{pre}.gate_proj", **kw)
        self.up = Linear(E, F, ("embed", "mlp"), name=f"{pre}.up_proj", **kw)
        self.down = Linear(F, E, ("mlp", "embed"), name=f"{pre}.down_proj", **kw)

    def __call__(self, x, quant, merged: MergedProjections | None = None):
        if merged is None or merged.gate_up_kernel is None:
            g, u = self.gate(x, quant), self.up(x, quant)
        else:  # one matmul against [gate | up]
            xa = quant.act(self.gate.name, x) if quant is not None else x
            g, u = jnp.split(jnp.dot(xa.astype(self.gate.dtype), merged.gate_up_kernel.astype(self.gate.dtype)), 2,
                             axis=-1)
        return self.down(jax.nn.silu(g) * u, quant)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.attn = Attention(cfg, layer, rngs=rngs, **kw)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, layer, rngs=rngs, **kw)

    def __call__(self, x, cos, sin, k_cache, v_cache, visible_BTS, index, quant, fused=None, merged=None,
                 span=None):
        h, k_cache, v_cache = self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, visible_BTS, index, quant,
                                        fused, merged, span)
        x = x + h
        x = x + self.mlp(self.mlp_norm(x), quant, merged)
        return x, k_cache, v_cache


class Decoder(nnx.Module):
    """Token ids [B, T] -> logits [B, T, V] (f32), optionally through a KV cache."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs,
                 attention: str = "auto", remat: str = "none"):
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={attention!r} is not valid; choose one of {list(ATTENTION_IMPLS)}")
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r} is not valid; choose one of {list(REMAT_POLICIES)}")
        self.cfg = cfg
        self.dtype = dtype
        self.attention = attention
        self.remat = remat
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype)
        self.layers = nnx.List([Block(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), name="lm_head", bias=False,
                                  dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def lm_head_kernel(self) -> Array:
        """The output projection [E, U] in the compute dtype (the embedding transposed when tied), over the usable
        ids only: U = cfg.usable_size <= V, the padding rows beyond the tokenizer dropped (`ModelConfig`), so every
        logit, log-softmax, sample and top-k is over the ids a token can have."""
        w_EV = self.embed[...].T if self.lm_head is None else self.lm_head.kernel[...]
        U = self.cfg.usable_size
        return (w_EV if U == w_EV.shape[1] else w_EV[:, :U]).astype(self.dtype)

    def __call__(self, tokens_BT: Array, *, positions_BT: Array | None = None, valid_BT: Array | None = None,
                 cache: KVCache | None = None, quant: ForwardQuant | None = None,
                 return_hidden: bool = False, merged: tuple[MergedProjections, ...] | None = None,
                 decode_attention: str = "einsum") -> tuple[Array, KVCache | None]:
        """Logits [B, T, V] in f32 (or, return_hidden=True, final-norm hidden states [B, T, E] in the compute dtype)
        and the updated cache (None when called without one).

        valid_BT marks real tokens (False = padding; padded keys are never attended to). positions default to
        the number of real tokens before each one (counting those already in the cache), so left padding works.
        merged: per-layer `merge_projections(self, quant)`, computed once outside a decode loop.
        decode_attention: "pallas" runs a one-token step through a cache with `pallas_decode_attention` over slots
        [first valid slot, index] of each row, which must be contiguous (left-padded prompts, as JaxEngine lays
        them out; a finished row's later slots may be invalid: its output is unused); "einsum" masks every slot.
        """
        if decode_attention not in DECODE_ATTENTION_IMPLS:
            raise ValueError(f"decode_attention={decode_attention!r} is not valid; choose one of "
                             f"{list(DECODE_ATTENTION_IMPLS)}")
        B, T = tokens_BT.shape
        valid_BT = jnp.ones((B, T), bool) if valid_BT is None else valid_BT.astype(bool)
        if cache is not None:
            lay = _cached_layout(cache, valid_BT, positions_BT, decode_attention)
        else:
            lay = _causal_layout(valid_BT, positions_BT, resolve_attention(self.attention, self.dtype,
                                                                           self.cfg.head_dim))
        cos, sin = rope_cos_sin(self.cfg, lay.positions_BT)
        x = jnp.take(self.embed[...], tokens_BT, axis=0).astype(self.dtype)
        x, ks, vs = self._blocks(x, cos, sin, lay, cache, quant, merged)
        x = self.norm(x)
        new_cache = None if cache is None else KVCache(k=ks, v=vs, valid_BS=lay.valid_BS, index=lay.index + T)
        if return_hidden:
            return x, new_cache
        return self.logits(x, quant), new_cache

    def _blocks(self, x, cos, sin, lay: "_AttentionLayout", cache: KVCache | None, quant: ForwardQuant | None,
                merged: tuple[MergedProjections, ...] | None) -> tuple[Array, tuple, tuple]:
        """Every block in turn (under `nnx.remat` when self.remat says so): the hidden states [B, T, E] after the
        last block, and each layer's updated K and V caches (None per layer without a cache)."""
        def run(block, x, cos, sin, k, v, visible_BTS, index, merged_i):
            return block(x, cos, sin, k, v, visible_BTS, index, quant, lay.fused, merged_i, lay.span)

        if self.remat != "none":
            run = _remat(run, jax.checkpoint_policies.dots_with_no_batch_dims_saveable if self.remat == "dots" else None)
        ks, vs = [], []
        for i, block in enumerate(self.layers):
            k_i, v_i = (cache.k[i], cache.v[i]) if cache is not None else (None, None)
            m_i = None if merged is None else merged[i]
            x, k_i, v_i = run(block, x, cos, sin, k_i, v_i, lay.visible_BTS, lay.index, m_i)
            ks.append(k_i)
            vs.append(v_i)
        return x, tuple(ks), tuple(vs)

    def logits(self, h_BTE: Array, quant: ForwardQuant | None = None) -> Array:
        """Logits [B, T, U] in f32 from final-norm hidden states: h @ `lm_head_kernel()` (the lm_head input through
        the recipe's activation hook, as every Linear's); U = cfg.usable_size (V unless the vocabulary is padded)."""
        if quant is not None and self.lm_head is not None:
            h_BTE = quant.act(self.lm_head.name, h_BTE)
        return jnp.dot(h_BTE.astype(self.dtype), self.lm_head_kernel()).astype(jnp.float32)


class _AttentionLayout(NamedTuple):
    """Where a forward's T query tokens sit among the S key slots, and which attention implementation runs.

    positions_BT  rope position of each query token
    valid_BS      key slots holding real tokens (with a cache: its slots after this call's write)
    index         the first slot this call writes (0 without a cache)
    visible_BTS   query t may attend to slot s: s ≤ slot(t) and s valid
    fused         the fused attention kernel, or None for the einsum path
    span          pallas decode only: (first valid slot per row [B], index + 1)
    """

    positions_BT: Array
    valid_BS: Array
    index: Array
    visible_BTS: Array
    fused: str | None
    span: tuple[Array, Array] | None


def _visible(valid_BS: Array, q_slot_T: Array) -> Array:
    """visible_BTS = (s ≤ q_slot_T[t]) & valid_BS[b, s]: causal over slots, padding never attended to."""
    S = valid_BS.shape[1]
    return (jnp.arange(S)[None, None, :] <= q_slot_T[None, :, None]) & valid_BS[:, None, :]


def _cached_layout(cache: KVCache, valid_BT: Array, positions_BT: Array | None,
                   decode_attention: str) -> _AttentionLayout:
    """The T tokens written at cache slots [index, index + T). Positions default to the real tokens already in
    the cache plus those before each one; a one-token step uses pallas decode when decode_attention="pallas"."""
    T = valid_BT.shape[1]
    index = cache.index
    if positions_BT is None:
        seen_B = jnp.sum(cache.valid_BS, axis=1)
        positions_BT = jnp.maximum(seen_B[:, None] + jnp.cumsum(valid_BT, axis=1) - 1, 0)
    valid_BS = jax.lax.dynamic_update_slice(cache.valid_BS, valid_BT, (0, index))
    fused = "pallas" if decode_attention == "pallas" and T == 1 else None
    span = (jnp.argmax(valid_BS, axis=1), index + 1) if fused == "pallas" else None
    return _AttentionLayout(positions_BT, valid_BS, index, _visible(valid_BS, index + jnp.arange(T)), fused, span)


def _causal_layout(valid_BT: Array, positions_BT: Array | None, impl: str) -> _AttentionLayout:
    """A cache-free forward: causal self-attention over the T tokens (S = T), with attention implementation
    `impl` (from `resolve_attention`); positions default to the real tokens before each one."""
    T = valid_BT.shape[1]
    if positions_BT is None:
        positions_BT = jnp.maximum(jnp.cumsum(valid_BT, axis=1) - 1, 0)
    return _AttentionLayout(positions_BT, valid_BT, jnp.zeros((), jnp.int32), _visible(valid_BT, jnp.arange(T)),
                            None if impl == "einsum" else impl, None)


def merge_projections(model: Decoder, quant: ForwardQuant | None = None) -> tuple[MergedProjections, ...]:
    """Per layer, [q | k | v] and [gate | up] kernels concatenated along the output axis, for `Decoder(merged=...)`.

    A group is merged only when the activation hook treats its modules alike (all quantized or none), since the
    merged matmul passes its input through the hook once. Costs one copy of those kernels: compute it once per
    set of weights (an engine: once per generate, outside the decode loop).
    """
    def alike(*modules) -> bool:
        return quant is None or len({quant.quantizes(m.name) for m in modules}) == 1

    out = []
    for block in model.layers:
        a, m = block.attn, block.mlp
        qkv = alike(a.q, a.k, a.v)
        out.append(MergedProjections(
            qkv_kernel=jnp.concatenate([a.q.kernel[...], a.k.kernel[...], a.v.kernel[...]], axis=1) if qkv else None,
            qkv_bias=jnp.concatenate([a.q.bias[...], a.k.bias[...], a.v.bias[...]])
            if qkv and a.q.bias is not None else None,
            gate_up_kernel=jnp.concatenate([m.gate.kernel[...], m.up.kernel[...]], axis=1)
            if alike(m.gate, m.up) else None))
    return tuple(out)


def create(cfg: ModelConfig, seed: int = 0, *, dtype=jnp.float32, param_dtype=jnp.float32, attention: str = "auto",
           remat: str = "none") -> Decoder:
    """A randomly initialised decoder (normal(0, 0.02) kernels, unit norms, zero biases)."""
    return Decoder(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(params=seed), attention=attention,
                   remat=remat)


def abstract(cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, attention: str = "auto",
             remat: str = "none") -> Decoder:
    """The decoder's structure with ShapeDtypeStruct leaves: no memory, no compute (for loading)."""
    return nnx.eval_shape(lambda: create(cfg, dtype=dtype, param_dtype=param_dtype, attention=attention,
                                         remat=remat))


def forward(graphdef: nnx.GraphDef, params: Any, tokens_BT: Array, **kwargs) -> tuple[Array, KVCache | None]:
    """Functional entry point usable inside jax.jit: merge (graphdef, params) and run the decoder."""
    return nnx.merge(graphdef, params)(tokens_BT, **kwargs)


def _remat(run, policy):
    """`run(block, *args)` recomputed in the backward pass (`jax.checkpoint` with `policy`). The block's state goes
    in as an explicit argument and the block is rebuilt inside (nnx.split / nnx.merge), so it works under any outer
    JAX transform (a `lax.scan` over micro-batches): nnx.remat would write the block's state back across trace
    levels there."""
    def wrapped(block, *args):
        graphdef, state = nnx.split(block)

        def pure(state, *args):
            return run(nnx.merge(graphdef, state), *args)
        return jax.checkpoint(pure, policy=policy)(state, *args)
    return wrapped

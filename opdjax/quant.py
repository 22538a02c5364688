"""Simulated quantization (quantize–dequantize, "qdq") of weights, activations and the KV cache.

The rollout engine (vLLM on GPU) runs FP8 weights, FP8 activations and an FP8 KV cache; the learner runs in
bf16/fp32. This module reproduces the engine's rounding in JAX so that the same mismatch can be measured on a CPU
(`JaxEngine` with a recipe), and produces the (q, scale) pairs a weight bridge would ship.

Formats (`FORMATS`):

    "e4m3"  jnp.float8_e4m3fn   max 448     (no inf: an overflowing cast gives NaN, so values are clipped first)
    "e5m2"  jnp.float8_e5m2     max 57344
    "int8"  jnp.int8            max 127     (symmetric, round-half-to-even, [-127, 127])

Quantization (one formula for every granularity; `amax` is taken over the granularity's group):

    scale = max(amax(|x|), AMAX_EPS) * (1 / fmt_max)      (float32; or a given fixed `scale`)
    q     = cast(clip(x * (1 / scale), -fmt_max, fmt_max)) (int8: round before the cast)
    x'    = q * scale                                     (dequantize; computed in float32, cast to x's dtype)

**Why no compiler can drop the rounding.** A plain `x.astype(f8).astype(f32)` is a pair of converts that XLA's GPU
compiler removes under its default `xla_allow_excess_precision` (the round trip is then a silent no-op: measured on
an H200, k3 = 0.0 exactly for an FP8 recipe; an `optimization_barrier` between the converts does not help either,
since XLA expands barriers into control dependencies before its simplifiers run). So the dequantizer never converts
FP8 back to float: it reinterprets the stored byte (`bitcast_convert_type` to uint8) and decodes sign, exponent and
mantissa with integer arithmetic into the float32 bit pattern (`_decode_f8`; subnormals as m * 2^(1-bias-M)). No
compiler may fold that back into the input, because the bits of the FP8 value are data to it, and the result is
bit-identical to `q.astype(float32)` for every finite code (tested over all 256). int8 needs nothing: round and clip
already produce the quantized values, so its converts are exact whether or not a compiler keeps them.
`check_effective` verifies on the current backend, inside a jit as the engines run it, that a recipe's
quantization changes a probe tensor; engines call it at construction.

Divisions are written as multiplications by float32 reciprocals on purpose: XLA's CPU compiler rewrites `a / c`
and `a / broadcast(s)` into `a * (1/c)` (seen with jax 0.10), so a literal division would not be bit-stable across
programs and backends, while a multiplication is. A vLLM scale computed as a true `amax / fmt_max` can differ from
ours by one float32 ulp.

Granularities and the shape of the returned scale (x has shape S, ndim n):

    "tensor"   one scale for the whole tensor                    scale.shape == ()
    "channel"  one scale per index of `channel_axis` (kept),      scale.shape == S with every axis but
               amax over every other axis. opdjax stores linear   channel_axis set to 1, e.g. (1, out)
               kernels as [in, out] (HF's weight transposed), so  for a kernel [in, out]
               the default channel_axis=-1 is the OUTPUT channel
               (HF's per-row scale of weight [out, in]).
    "token"    one scale per row of an activation [..., D]:       scale.shape == S with `axis` set to 1,
               amax over `axis` (default -1, the feature axis).   e.g. (B, T, 1) for x [B, T, D]
    "block"    one scale per (bm, bn) block of the last two axes   scale.shape == S[:-2] + (ceil(M/bm),
               [..., M, N] (x is zero-padded internally to a       ceil(N/bn)); not broadcastable: pass
               multiple of the block, then cropped). (128, 128)    `block=` to `dequantize`. For a kernel
               for weights, (1, 128) for activations [..., T, D].  [in, out] it is the transpose of
                                                                   vLLM's [out/128, in/128] weight_scale_inv.

Everything is pure and jit-able; `fmt`, `granularity`, `block`, `axis`, `channel_axis` and `ste` are static.
`qdq` runs the same quantizer and dequantizer code as `quantize` / `dequantize` (fused in one jit), so a (q, scale)
pair shipped by a bridge dequantizes bit-for-bit to the simulated weight (tested).

Recipes (`Recipe`, registry `RECIPES`) choose which HF modules are quantized and how; `ForwardQuant` carries a recipe
into a decoder's forward pass (activations, KV cache) as a hashable, jit-closable object.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

Array = jax.Array

__all__ = [
    "AMAX_EPS", "FORMATS", "GRANULARITIES", "QFormat", "RecipeError",
    "quantize", "dequantize", "qdq",
    "QSpec", "Recipe", "ForwardQuant", "forward_quant", "RECIPES", "FP8_DEFAULT", "get_recipe", "as_recipe",
    "module_spec", "apply_to_named", "quantize_named", "dequantize_named", "calibrate_kv_scales",
    "check_effective", "IneffectiveQuantError",
    "add_weight_noise",
    "kv_cache_bytes_per_token", "weight_bytes", "kv_capacity_tokens", "llama_weight_shapes",
]

# ----------------------------------------------------------------------------------------------------------------------
# Formats and the core quantize / dequantize / qdq
# ----------------------------------------------------------------------------------------------------------------------

AMAX_EPS = 1e-12  # floor on amax so an all-zero group gives scale > 0 (q = 0, x' = 0) instead of 0/0 = NaN
SCALE_BYTES = 4  # scales are float32


@dataclasses.dataclass(frozen=True)
class QFormat:
    """A storage format: its dtype, its largest finite magnitude, and whether it is an integer format."""

    name: str
    dtype: Any
    max_value: float
    is_int: bool = False

    @property
    def bytes(self) -> int:
        return jnp.dtype(self.dtype).itemsize


FORMATS: dict[str, QFormat] = {
    "e4m3": QFormat("e4m3", jnp.float8_e4m3fn, 448.0),
    "e5m2": QFormat("e5m2", jnp.float8_e5m2, 57344.0),
    "int8": QFormat("int8", jnp.int8, 127.0, is_int=True),
}
GRANULARITIES = ("tensor", "channel", "token", "block")
KV_GRANULARITIES = ("tensor", "token")


class RecipeError(ValueError):
    """A quantization format, granularity, recipe name or recipe field that does not exist or does not fit."""


def _format(fmt: str) -> QFormat:
    if fmt not in FORMATS:
        raise RecipeError(f"unknown quantization format {fmt!r}; valid formats: {sorted(FORMATS)}")
    return FORMATS[fmt]


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise RecipeError(f"unknown granularity {granularity!r}; valid granularities: {list(GRANULARITIES)}")


def _check_block(block: Sequence[int]) -> tuple[int, int]:
    block = tuple(block)
    if len(block) != 2 or not all(isinstance(b, (int, np.integer)) and b >= 1 for b in block):
        raise RecipeError(f"block must be two positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def _amax(x: Array, granularity: str, axis: int, channel_axis: int) -> Array:
    """max |x| over the granularity's group, keepdims (block handled separately)."""
    a = jnp.abs(x)
    if granularity == "tensor":
        return jnp.max(a)
    if granularity == "channel":
        keep = channel_axis % x.ndim
        return jnp.max(a, axis=tuple(i for i in range(x.ndim) if i != keep), keepdims=True)
    return jnp.max(a, axis=axis, keepdims=True)  # token


def _block_amax(x_MN: Array, block: tuple[int, int]) -> Array:
    """Per-block max |x| of the last two axes [..., M, N] -> [..., ceil(M/bm), ceil(N/bn)] (zero padding)."""
    bm, bn = block
    M, N = x_MN.shape[-2:]
    pm, pn = (-M) % bm, (-N) % bn
    pad = [(0, 0)] * (x_MN.ndim - 2) + [(0, pm), (0, pn)]
    xp = jnp.pad(jnp.abs(x_MN), pad)
    lead = x_MN.shape[:-2]
    xb = xp.reshape(*lead, (M + pm) // bm, bm, (N + pn) // bn, bn)
    return jnp.max(xb, axis=(-3, -1))


def _expand_block_scale(scale: Array, shape: tuple[int, ...], block: tuple[int, int]) -> Array:
    """Block scale [..., nM, nN] -> per-element scale [..., M, N] (repeat each block, crop the padding).

    A scale of rank < 2 (a fixed per-tensor scale) is returned as is: it already broadcasts.
    """
    if scale.ndim < 2:
        return scale
    bm, bn = block
    M, N = shape[-2:]
    s = jnp.repeat(jnp.repeat(scale, bm, axis=-2, total_repeat_length=scale.shape[-2] * bm), bn, axis=-1,
                   total_repeat_length=scale.shape[-1] * bn)
    return s[..., :M, :N]


def _cast(y: Array, f: QFormat) -> Array:
    """Clip to ±fmt_max (e4m3fn has no inf: overflow would become NaN), round for int, cast to storage dtype."""
    y = jnp.clip(y, -f.max_value, f.max_value)
    if f.is_int:
        y = jnp.round(y)
    return y.astype(f.dtype)


def _quantize_impl(x, scale, fmt, granularity, block, axis, channel_axis):
    """The one quantizer behind `quantize` and `qdq` (traced inside their jits)."""
    f = FORMATS[fmt]
    x32 = x.astype(jnp.float32)
    if scale is None:
        if granularity == "block":
            amax = _block_amax(x32, block)
        else:
            amax = _amax(x32, granularity, axis, channel_axis)
        scale = jnp.maximum(amax, AMAX_EPS) * np.float32(1.0 / f.max_value)
    scale = jnp.asarray(scale, jnp.float32)
    inv = jnp.float32(1.0) / scale
    inv_full = _expand_block_scale(inv, x.shape, block) if granularity == "block" else inv
    return _cast(x32 * inv_full, f), scale


def _decode_f8(q: Array) -> Array:
    """float32(q) for an FP8 array, computed from its bits so that no compiler can cancel it against the cast.

    bits = s | e (E bits) | m (M bits), bias b:  normal (e > 0)   -> f32 bits s<<31 | (e - b + 127)<<23 | m<<(23-M)
                                                 subnormal (e = 0) -> (-1)^s * m * 2^(1 - b - M)
    Exact for every finite code (inf/NaN codes never occur: the quantizer clips to ±fmt_max first).
    """
    fi = ml_dtypes.finfo(q.dtype)
    E, M = int(fi.nexp), int(fi.nmant)
    bias = 1 - int(fi.minexp)  # e4m3fn: 7, e5m2: 15
    u = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)
    sign = (u >> (E + M)) << 31
    e = (u >> M) & ((1 << E) - 1)
    m = u & ((1 << M) - 1)
    normal = jax.lax.bitcast_convert_type(sign | ((e + (127 - bias)) << 23) | (m << (23 - M)), jnp.float32)
    sub = m.astype(jnp.float32) * np.float32(2.0 ** (1 - bias - M))
    sub = jnp.where(sign != 0, -sub, sub)
    return jnp.where(e > 0, normal, sub)


def _to_f32(q: Array) -> Array:
    """float32 values of stored codes: FP8 through `_decode_f8`, int8 (and anything else) by a plain cast."""
    if jnp.dtype(q.dtype).itemsize == 1 and jnp.issubdtype(q.dtype, jnp.floating):
        return _decode_f8(q)
    return q.astype(jnp.float32)


def _dequantize_impl(q, scale, dtype, block):
    """The one dequantizer behind `dequantize` and `qdq`: (f32(q) * scale) -> dtype, f32(q) from q's bits."""
    scale = jnp.asarray(scale, jnp.float32)
    if block is not None:
        scale = _expand_block_scale(scale, q.shape, block)
    return (_to_f32(q) * scale).astype(dtype)


_STATIC = ("fmt", "granularity", "block", "axis", "channel_axis")
_quantize_jit = jax.jit(_quantize_impl, static_argnames=_STATIC)
_dequantize_jit = jax.jit(_dequantize_impl, static_argnames=("dtype", "block"))


@functools.partial(jax.jit, static_argnames=_STATIC + ("ste",))
def _qdq_jit(x, scale, fmt, granularity, block, axis, channel_axis, ste):
    q, s = _quantize_impl(x, scale, fmt, granularity, block, axis, channel_axis)
    y = _dequantize_impl(q, s, x.dtype, block if granularity == "block" else None)
    if ste:
        y = jax.lax.stop_gradient(y) + (x - jax.lax.stop_gradient(x))
    return y


def _check_args(x: Array, fmt: str, granularity: str, block: Sequence[int], scale: Any):
    f = _format(fmt)
    _check_granularity(granularity)
    block = _check_block(block)
    if granularity == "block" and x.ndim < 2:
        raise RecipeError(f"block granularity needs an array of rank >= 2, got shape {x.shape}")
    if x.ndim == 0 and granularity != "tensor":
        raise RecipeError(f"granularity {granularity!r} needs an array of rank >= 1, got a scalar")
    return dict(fmt=f.name, granularity=granularity, block=block), (
        None if scale is None else jnp.asarray(scale, jnp.float32))


def quantize(x: Array, fmt: str, granularity: str = "tensor", *, block: Sequence[int] = (128, 128), axis: int = -1,
             channel_axis: int = -1, scale: Array | float | None = None) -> tuple[Array, Array]:
    """Quantize x to `fmt` with one scale per `granularity` group. Returns (q, scale).

    scale = max(amax, AMAX_EPS) * (1/fmt_max) (float32), q = cast(clip(x * (1/scale), ±fmt_max)) in the storage
    dtype (float8_e4m3fn, float8_e5m2 or int8). Scale shapes per granularity are in the module docstring:
    tensor (), channel S with all axes but `channel_axis` -> 1, token S with `axis` -> 1, block
    S[:-2] + (ceil(M/bm), ceil(N/bn)).

    `scale` given: used as is (a fixed scale, e.g. 1.0 for vLLM's uncalibrated FP8 KV cache; it must broadcast
    against x, or for "block" have the block-scale shape); no amax is computed. Finite inputs never give NaN/inf:
    values beyond ±fmt_max * scale saturate. Works on any float input dtype (computed in float32).
    """
    x = jnp.asarray(x)
    static, scale = _check_args(x, fmt, granularity, block, scale)
    return _quantize_jit(x, scale, axis=axis, channel_axis=channel_axis, **static)


def dequantize(q: Array, scale: Array, dtype: Any = jnp.float32, *, block: Sequence[int] | None = None) -> Array:
    """x' = (float32(q) * scale) cast to `dtype`.

    `scale` broadcasts against q for tensor/channel/token scales. A block scale [..., nM, nN] needs the `block` it
    was made with (the padding makes the block size ambiguous from shapes alone); a rank < 2 scale is always
    broadcast, so `block` may be passed for any granularity.
    """
    return _dequantize_jit(q, jnp.asarray(scale, jnp.float32), dtype=jnp.dtype(dtype),
                           block=None if block is None else _check_block(block))


def qdq(x: Array, fmt: str, granularity: str = "tensor", *, block: Sequence[int] = (128, 128), axis: int = -1,
        channel_axis: int = -1, scale: Array | float | None = None, ste: bool = False) -> Array:
    """Simulated quantization: dequantize(quantize(x, ...)) in x's dtype (f32, bf16, ...), one jit.

    Built from the same quantizer and dequantizer as `quantize` / `dequantize`, so both paths agree bit-for-bit.
    ste=True: straight-through estimator, value qdq(x), gradient identity. Written as
    sg(qdq(x)) + (x - sg(x)), whose value is exactly qdq(x) (x - x = 0) and whose d/dx is 1.
    ste=False: the plain composition (its gradient is that of the rounding function, mostly useless).
    """
    x = jnp.asarray(x)
    static, scale = _check_args(x, fmt, granularity, block, scale)
    return _qdq_jit(x, scale, axis=axis, channel_axis=channel_axis, ste=bool(ste), **static)


# ----------------------------------------------------------------------------------------------------------------------
# Recipes
# ----------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QSpec:
    """How one kind of tensor is quantized: format, granularity and (for "block") the block shape."""

    fmt: str = "e4m3"
    granularity: str = "tensor"
    block: tuple[int, int] = (128, 128)

    def __post_init__(self):
        _format(self.fmt)
        _check_granularity(self.granularity)
        object.__setattr__(self, "block", _check_block(self.block))

    @classmethod
    def from_dict(cls, d: Any, *, where: str = "spec") -> "QSpec | None":
        """A spec from YAML: None / "none" -> None (high precision), "e4m3" -> QSpec("e4m3"), or a mapping with keys
        fmt, granularity, block."""
        if d is None or (isinstance(d, str) and d.lower() in ("none", "null", "bf16", "fp32", "high")):
            return None
        if isinstance(d, QSpec):
            return d
        if isinstance(d, str):
            try:
                return cls(fmt=d)
            except RecipeError as e:
                raise RecipeError(f"{where}: {e}") from None
        if not isinstance(d, Mapping):
            raise RecipeError(f"{where}: expected a mapping with keys {_QSPEC_KEYS}, a format name or null, "
                              f"got {d!r}")
        unknown = sorted(set(d) - set(_QSPEC_KEYS))
        if unknown:
            raise RecipeError(f"{where}: unknown key(s) {unknown}; valid keys: {list(_QSPEC_KEYS)}")
        kw = dict(d)
        if "block" in kw:
            kw["block"] = tuple(kw["block"])
        try:
            return cls(**kw)
        except RecipeError as e:
            raise RecipeError(f"{where}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"fmt": self.fmt, "granularity": self.granularity}
        if self.granularity == "block":
            d["block"] = list(self.block)
        return d


_QSPEC_KEYS = ("fmt", "granularity", "block")
_RECIPE_KEYS = ("name", "base", "weights", "activations", "kv_cache", "kv_scale", "kv_scales")

# Every Linear layer of a Llama/Qwen decoder, by HF module name. Embeddings, lm_head, norms and MoE routers
# (`mlp.gate`, no `_proj`) do not match.
DECODER_LINEAR_PATTERNS: tuple[str, ...] = tuple(
    [f"model.layers.*.self_attn.{p}_proj" for p in "qkvo"] + [f"model.layers.*.mlp.{p}_proj" for p in
                                                              ("gate", "up", "down")])
HIGH_PRECISION_PATTERNS: tuple[str, ...] = ("model.embed_tokens", "lm_head")


def _normalise_kv_scales(kv_scales: Any) -> tuple | None:
    if kv_scales is None:
        return None
    out = []
    for i, s in enumerate(kv_scales):
        if isinstance(s, (tuple, list, np.ndarray)):
            if len(s) != 2:
                raise RecipeError(f"kv_scales[{i}] must be a float or a (k_scale, v_scale) pair, got {s!r}")
            out.append((float(s[0]), float(s[1])))
        else:
            out.append(float(s))
    for i, s in enumerate(out):
        if not all(v > 0 and math.isfinite(v) for v in (s if isinstance(s, tuple) else (s,))):
            raise RecipeError(f"kv_scales[{i}] must be positive and finite, got {s!r}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Which tensors the rollout engine quantizes, and how. Frozen and hashable (tuples only).

    weights       ordered (fnmatch pattern over HF module names, QSpec | None); the first matching pattern wins;
                  None keeps the module in high precision. The quantized tensor is `<module>.weight` (2-D only).
    activations   dynamic quantization of the INPUT of every linear layer whose weight is quantized (W8A8);
                  None = weight-only (W8A16).
    kv_cache      QSpec of the KV cache (granularity "token" = one scale per (token, kv head) over head_dim, or
                  "tensor"); None = high-precision cache.
    kv_scale      fixed scale for keys and values (1.0 = vLLM's uncalibrated FP8 default); None = dynamic.
    kv_scales     calibrated per-layer scales: one float (K and V) or a (k_scale, v_scale) pair per layer.
    """

    name: str = "custom"
    weights: tuple[tuple[str, QSpec | None], ...] = ()
    activations: QSpec | None = None
    kv_cache: QSpec | None = None
    kv_scale: float | None = None
    kv_scales: tuple | None = None

    def __post_init__(self):
        weights = []
        for i, entry in enumerate(self.weights):
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                    and (entry[1] is None or isinstance(entry[1], QSpec))):
                raise RecipeError(f"recipe {self.name!r}: weights[{i}] must be (pattern: str, QSpec | None), "
                                  f"got {entry!r}")
            weights.append((entry[0], entry[1]))
        object.__setattr__(self, "weights", tuple(weights))
        for field in ("activations", "kv_cache"):
            v = getattr(self, field)
            if v is not None and not isinstance(v, QSpec):
                raise RecipeError(f"recipe {self.name!r}: {field} must be a QSpec or None, got {v!r}")
        if self.kv_cache is not None and self.kv_cache.granularity not in KV_GRANULARITIES:
            raise RecipeError(f"recipe {self.name!r}: kv_cache granularity {self.kv_cache.granularity!r} not "
                              f"supported; valid: {list(KV_GRANULARITIES)}")
        object.__setattr__(self, "kv_scales", _normalise_kv_scales(self.kv_scales))
        if self.kv_scale is not None:
            object.__setattr__(self, "kv_scale", float(self.kv_scale))
            if not (self.kv_scale > 0 and math.isfinite(self.kv_scale)):
                raise RecipeError(f"recipe {self.name!r}: kv_scale must be positive and finite, got {self.kv_scale}")
        if (self.kv_scale is not None or self.kv_scales is not None) and self.kv_cache is None:
            raise RecipeError(f"recipe {self.name!r}: kv_scale/kv_scales given but kv_cache is None")
        if self.kv_scale is not None and self.kv_scales is not None:
            raise RecipeError(f"recipe {self.name!r}: give kv_scale (one fixed scale) or kv_scales (per layer), "
                              f"not both")

    # -- queries ---------------------------------------------------------------------------------------------------
    @property
    def kv_dynamic(self) -> bool:
        """True when the KV cache is quantized with scales computed on the fly (per token or per tensor)."""
        return self.kv_cache is not None and self.kv_scale is None and self.kv_scales is None

    @property
    def is_noop(self) -> bool:
        return self.kv_cache is None and all(spec is None for _, spec in self.weights)

    def module_spec(self, module_name: str) -> QSpec | None:
        return module_spec(self, module_name)

    def forward_hooks(self, *, ste: bool = False) -> "ForwardQuant":
        return ForwardQuant(self, ste=ste)

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)

    # -- YAML ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recipe":
        """A recipe from a YAML mapping. Keys: name, base (a preset name to start from), weights, activations,
        kv_cache, kv_scale, kv_scales.

        weights is a list of [pattern, spec] pairs or a mapping pattern -> spec (order kept); a spec is null
        (high precision), a format name ("e4m3") or a mapping {fmt, granularity, block}. Unknown keys, formats and
        granularities raise RecipeError naming the valid ones.
        """
        if not isinstance(d, Mapping):
            raise RecipeError(f"a recipe must be a mapping with keys {list(_RECIPE_KEYS)}, got {d!r}")
        unknown = sorted(set(d) - set(_RECIPE_KEYS))
        if unknown:
            raise RecipeError(f"recipe: unknown key(s) {unknown}; valid keys: {list(_RECIPE_KEYS)}")
        base = get_recipe(d["base"]) if "base" in d else Recipe()
        default_name = d["base"] if set(d) == {"base"} else "custom"
        kw: dict[str, Any] = {"name": str(d.get("name", default_name))}
        if "weights" in d:
            w = d["weights"]
            items = list(w.items()) if isinstance(w, Mapping) else list(w or [])
            weights = []
            for i, item in enumerate(items):
                if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
                    raise RecipeError(f"recipe: weights[{i}] must be a [pattern, spec] pair, got {item!r}")
                weights.append((item[0], QSpec.from_dict(item[1], where=f"recipe weights[{item[0]!r}]")))
            kw["weights"] = tuple(weights)
        for field in ("activations", "kv_cache"):
            if field in d:
                kw[field] = QSpec.from_dict(d[field], where=f"recipe {field}")
        for field in ("kv_scale", "kv_scales"):
            if field in d:
                kw[field] = d[field]
        return dataclasses.replace(base, **kw)

    def to_dict(self) -> dict[str, Any]:
        spec = lambda s: None if s is None else s.to_dict()  # noqa: E731
        return {"name": self.name, "weights": [[p, spec(s)] for p, s in self.weights],
                "activations": spec(self.activations), "kv_cache": spec(self.kv_cache), "kv_scale": self.kv_scale,
                "kv_scales": None if self.kv_scales is None else [list(s) if isinstance(s, tuple) else s
                                                                   for s in self.kv_scales]}


@functools.lru_cache(maxsize=8192)
def module_spec(recipe: Recipe, module_name: str) -> QSpec | None:
    """The QSpec of an HF module's weight under `recipe`: the first pattern (fnmatchcase, `*` crosses dots) that
    matches wins; no match, or a None spec, means high precision."""
    for pattern, spec in recipe.weights:
        if fnmatch.fnmatchcase(module_name, pattern):
            return spec
    return None


def _weight_spec(recipe: Recipe, name: str, ndim: int) -> QSpec | None:
    """Spec for tensor `name` if it is the 2-D `.weight` of a matched module, else None."""
    if ndim != 2 or not name.endswith(".weight"):
        return None
    return module_spec(recipe, name[: -len(".weight")])


def _linear_recipe(name: str, w: QSpec | None, a: QSpec | None = None, kv: QSpec | None = None,
                   kv_scale: float | None = None) -> Recipe:
    weights = tuple((p, None) for p in HIGH_PRECISION_PATTERNS)
    if w is not None:
        weights += tuple((p, w) for p in DECODER_LINEAR_PATTERNS)
    return Recipe(name=name, weights=weights, activations=a, kv_cache=kv, kv_scale=kv_scale)


_E4M3_T = QSpec("e4m3", "tensor")
_E4M3_CH = QSpec("e4m3", "channel")
_E4M3_TOK = QSpec("e4m3", "token")

# vLLM `quantization="fp8"` (online dynamic FP8): every decoder Linear's weight to e4m3 with one per-tensor scale;
# activations dynamically quantized to e4m3 per token (what vLLM's FP8 GEMM does on Hopper/Ada, the GPUs that run
# W8A8; the docs' generic description is a dynamic per-tensor activation scale — see "fp8_w8a8_tensor").
# lm_head, embeddings, norms and routers stay in the model dtype.
FP8_DEFAULT = _linear_recipe("fp8_w8a8", _E4M3_T, _E4M3_TOK)

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe(name="none"),
    _linear_recipe("fp8_weights_only", _E4M3_T),                           # W8A16 (vLLM FP8 on Ampere, Marlin)
    FP8_DEFAULT,                                                           # W8A8, per-tensor W, per-token A
    _linear_recipe("fp8_w8a8_tensor", _E4M3_T, _E4M3_T),                   # per-tensor W, dynamic per-tensor A
    _linear_recipe("fp8_w8a8_channel", _E4M3_CH, _E4M3_TOK),               # llm-compressor FP8_DYNAMIC
    _linear_recipe("fp8_block128", QSpec("e4m3", "block", (128, 128)),     # vLLM fp8_per_block / DeepSeek-V3
                   QSpec("e4m3", "block", (1, 128))),
    _linear_recipe("fp8_w8a8_kv", _E4M3_T, _E4M3_TOK, _E4M3_TOK, 1.0),     # + FP8 KV cache, scale 1.0
    _linear_recipe("fp8_kv_only", None, None, _E4M3_TOK, 1.0),             # kv_cache_dtype="fp8" alone
    _linear_recipe("e5m2_w8a8", QSpec("e5m2", "tensor"), QSpec("e5m2", "token")),
    _linear_recipe("int8_w8a8", QSpec("int8", "channel"), QSpec("int8", "token")),  # vLLM INT8 W8A8 (dynamic)
)}


def get_recipe(name: str) -> Recipe:
    """The preset named `name`; an unknown name raises RecipeError (a ValueError) listing the valid names."""
    if name not in RECIPES:
        raise RecipeError(f"unknown quantization recipe {name!r}; valid recipes: {sorted(RECIPES)}")
    return RECIPES[name]


def as_recipe(spec: "str | Mapping[str, Any] | Recipe | None") -> Recipe:
    """Accept a preset name, a path to a recipe file (.json/.yaml), a YAML mapping, a Recipe, or None (-> "none")."""
    if spec is None:
        return RECIPES["none"]
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, str):
        if spec not in RECIPES and spec.endswith((".json", ".yaml", ".yml")):
            import pathlib

            import yaml

            p = pathlib.Path(spec)
            if not p.is_file():
                raise RecipeError(f"recipe file {spec} does not exist")
            return Recipe.from_dict(yaml.safe_load(p.read_text()))
        return get_recipe(spec)
    return Recipe.from_dict(spec)


# ----------------------------------------------------------------------------------------------------------------------
# Applying a recipe to named weights (opdjax layout: linear kernels [in, out])
# ----------------------------------------------------------------------------------------------------------------------

def _spec_kwargs(spec: QSpec) -> dict[str, Any]:
    return {"block": spec.block, "channel_axis": -1}


def apply_to_named(recipe: Recipe, named: Mapping[str, Array]) -> dict[str, Array]:
    """Simulated-quantized copy of `named` (HF tensor name -> array in opdjax layout, kernels [in, out]).

    Only 2-D `<module>.weight` tensors whose module matches a non-None pattern are replaced by their qdq
    (per-channel = per output column); biases, norms, embeddings and unmatched tensors are returned untouched.
    Dtypes are preserved.
    """
    out = {}
    for name, arr in named.items():
        spec = _weight_spec(recipe, name, np.ndim(arr))
        out[name] = arr if spec is None else qdq(arr, spec.fmt, spec.granularity, **_spec_kwargs(spec))
    return out


def quantize_named(recipe: Recipe, named: Mapping[str, Array]) -> dict[str, tuple[Array, Array] | Array]:
    """Like `apply_to_named`, but quantized tensors come back as (q, scale) for a weight bridge.

    q is [in, out] in the storage dtype (a bridge transposes to HF's [out, in] and the scale with it);
    `dequantize_named` (or `dequantize(q, scale, dtype, block=spec.block)`) equals `apply_to_named` bit-for-bit.
    """
    out: dict[str, Any] = {}
    for name, arr in named.items():
        spec = _weight_spec(recipe, name, np.ndim(arr))
        out[name] = arr if spec is None else quantize(arr, spec.fmt, spec.granularity, **_spec_kwargs(spec))
    return out


def dequantize_named(recipe: Recipe, qnamed: Mapping[str, Any], dtypes: Mapping[str, Any] | Any) -> dict[str, Array]:
    """Inverse of `quantize_named`: (q, scale) entries -> dequantized arrays in `dtypes[name]` (or one dtype)."""
    out = {}
    for name, v in qnamed.items():
        if isinstance(v, tuple):
            q, s = v
            spec = _weight_spec(recipe, name, q.ndim)
            dt = dtypes[name] if isinstance(dtypes, Mapping) else dtypes
            out[name] = dequantize(q, s, dt, block=spec.block if spec and spec.granularity == "block" else None)
        else:
            out[name] = v
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Forward hooks: activations and KV cache inside a decoder's forward pass
# ----------------------------------------------------------------------------------------------------------------------

_KV_KINDS = {"k": 0, "key": 0, "v": 1, "value": 1}


@dataclasses.dataclass(frozen=True)
class ForwardQuant:
    """A recipe's forward-pass hooks. Frozen and hashable: close over it (or pass it static) under jax.jit.

    The decoder calls, at trace time:
      act(module, x)              before each linear layer `module` (HF name, e.g. "model.layers.0.mlp.up_proj")
      kv(layer, kind, x_BTKH)     on the keys ("k") / values ("v") written to the cache of layer `layer`
      weight(module, w_IO)        optionally, on a kernel [in, out] (same result as `apply_to_named`)
    All are the identity where the recipe quantizes nothing.
    """

    recipe: Recipe
    ste: bool = False

    @property
    def enabled(self) -> bool:
        return not self.recipe.is_noop

    def quantizes(self, module: str) -> bool:
        return module_spec(self.recipe, module) is not None

    def act(self, module: str, x: Array) -> Array:
        """qdq of a linear layer's input with recipe.activations if the layer's weight is quantized, else x.

        "token": one scale per row over the last (feature) axis; "tensor": one scale over the whole x (as vLLM's
        dynamic per-tensor scale, it depends on what else is in the batch); "block" (1, 128): per token, per 128
        features (blocks over x's last two axes [..., T, D]).
        """
        spec = self.recipe.activations
        if spec is None or not self.quantizes(module):
            return x
        return qdq(x, spec.fmt, spec.granularity, block=spec.block, ste=self.ste)

    def weight(self, module: str, w_IO: Array) -> Array:
        spec = _weight_spec(self.recipe, module + ".weight", np.ndim(w_IO))
        if spec is None:
            return w_IO
        return qdq(w_IO, spec.fmt, spec.granularity, ste=self.ste, **_spec_kwargs(spec))

    def kv(self, layer: int | Array, kind: str, x_BTKH: Array) -> Array:
        """qdq of keys or values [B, T, K, H] with recipe.kv_cache.

        Fixed kv_scale: q = cast(clip(x / kv_scale)) (vLLM's fp8 cache, scale 1.0 by default). Calibrated
        kv_scales: kv_scales[layer] (or its k/v entry); `layer` may be a traced index (scan over layers).
        Dynamic "token": one scale per (b, t, kv head), amax over head_dim; dynamic "tensor": one scale.
        """
        spec = self.recipe.kv_cache
        if kind not in _KV_KINDS:
            raise ValueError(f"kv kind must be one of {sorted(_KV_KINDS)}, got {kind!r}")
        if spec is None:
            return x_BTKH
        r = self.recipe
        if r.kv_scale is not None:
            scale = r.kv_scale
        elif r.kv_scales is not None:
            scale = _layer_kv_scale(r.kv_scales, layer, _KV_KINDS[kind])
        else:
            scale = None
        granularity = "tensor" if scale is not None else spec.granularity
        return qdq(x_BTKH, spec.fmt, granularity, axis=-1, scale=scale, ste=self.ste)


def _layer_kv_scale(kv_scales: tuple, layer: int | Array, kind_index: int) -> Array | float:
    """kv_scales[layer] (picking k or v from a pair); static Python lookup or a gather for a traced layer."""
    if isinstance(layer, (int, np.integer)):
        if not 0 <= layer < len(kv_scales):
            raise IndexError(f"layer {layer} out of range for kv_scales of {len(kv_scales)} layers")
        s = kv_scales[layer]
        return s[kind_index] if isinstance(s, tuple) else s
    table = np.array([s if isinstance(s, tuple) else (s, s) for s in kv_scales], np.float32)  # [L, 2]
    return jnp.asarray(table)[layer, kind_index]


def forward_quant(recipe: "Recipe | str | Mapping[str, Any] | None", *, ste: bool = False) -> ForwardQuant:
    """ForwardQuant for a recipe, a preset name, a YAML mapping, or None (no quantization)."""
    return ForwardQuant(as_recipe(recipe), ste=ste)


class IneffectiveQuantError(RecipeError):
    """A recipe whose simulated quantization leaves values unchanged on this backend (it would measure nothing)."""


def _probe_tensor(dtype: Any) -> Array:
    """A fixed [4, 8, 2, 64] probe (N(0, 1) values times 3, from numpy's seed 0) in `dtype`."""
    x = np.random.default_rng(0).standard_normal((4, 8, 2, 64)).astype(np.float32) * 3.0
    return jnp.asarray(x, dtype)


# A value counts as quantized when it moved by more than this relative amount: FP8/int8 rounding moves most values
# by 0.1-10%, while a removed rounding leaves f32 values within float32 rounding (~1e-7) and bf16 values unchanged.
EFFECTIVE_REL_CHANGE = 1e-4
EFFECTIVE_MIN_FRACTION = 0.01


@functools.lru_cache(maxsize=None)
def _changed_fraction(spec: QSpec | Recipe, dtype_name: str, backend: str) -> float:
    """Fraction of probe values changed by a weight/activation QSpec, or by a KV-only Recipe's key quantizer,
    run under jax.jit on `backend` (memoised)."""
    x = jax.device_put(_probe_tensor(jnp.dtype(dtype_name)), jax.devices(backend)[0])
    if isinstance(spec, Recipe):  # the KV cache, layer 0 keys, exactly as the decoder calls it
        hooks = ForwardQuant(spec)
        fn = lambda a: hooks.kv(0, "k", a)  # noqa: E731
    else:
        x = x.reshape(32, 128)
        fn = lambda a: qdq(a, spec.fmt, spec.granularity, **_spec_kwargs(spec))  # noqa: E731
    y = jax.jit(fn)(x).astype(jnp.float32)
    x = x.astype(jnp.float32)
    return float(jnp.mean((jnp.abs(y - x) > EFFECTIVE_REL_CHANGE * jnp.abs(x)).astype(jnp.float32)))


def check_effective(recipe: "Recipe | str | Mapping[str, Any] | None", dtype: Any = jnp.float32,
                    backend: str | None = None) -> dict[str, float]:
    """Verify that every quantized part of `recipe` changes a probe tensor on `backend` (default: JAX's default).

    Runs each distinct weight spec, the activation spec and the KV-cache quantizer under jax.jit on a fixed probe
    tensor in `dtype`; returns {part: fraction of probe values moved by more than EFFECTIVE_REL_CHANGE relative}.
    Raises IneffectiveQuantError naming the part, the backend and the dtype when fewer than EFFECTIVE_MIN_FRACTION
    moved: the compiler removed the rounding, and a study, probe or engine using this recipe would silently
    measure no quantization at all. Memoised per spec.
    """
    r = as_recipe(recipe)
    backend = backend or jax.default_backend()
    dtype_name = jnp.dtype(dtype).name
    parts: dict[str, QSpec | Recipe] = {}
    for pattern, spec in r.weights:
        if spec is not None and spec not in parts.values():
            parts[f"weights {pattern}"] = spec
    if r.activations is not None:
        parts["activations"] = r.activations
    if r.kv_cache is not None:
        parts["kv_cache"] = Recipe(name=r.name, kv_cache=r.kv_cache, kv_scale=r.kv_scale, kv_scales=r.kv_scales)
    out = {}
    for part, spec in parts.items():
        frac = _changed_fraction(spec, dtype_name, backend)
        if frac < EFFECTIVE_MIN_FRACTION:
            raise IneffectiveQuantError(
                f"recipe {r.name!r}: {part} quantization leaves a {dtype_name} probe tensor unchanged on backend "
                f"{backend!r} ({frac:.1%} of values moved by more than {EFFECTIVE_REL_CHANGE:g} relative, expected "
                f">= {EFFECTIVE_MIN_FRACTION:.0%}): the compiler removed the rounding, so simulated quantization "
                f"would measure nothing")
        out[part] = frac
    return out


def calibrate_kv_scales(amax_per_layer: Any, fmt: str = "e4m3") -> tuple:
    """Per-layer KV scales from observed amax: scale = max(amax, AMAX_EPS) / fmt_max.

    amax_per_layer: one amax per layer (shared by K and V) -> tuple of floats, or [L, 2] (k_amax, v_amax) ->
    tuple of (k_scale, v_scale) pairs. The result goes into `Recipe(kv_scales=...)`.
    """
    f = _format(fmt)
    a = np.asarray(amax_per_layer, np.float64)
    if a.ndim not in (1, 2) or (a.ndim == 2 and a.shape[1] != 2):
        raise ValueError(f"amax_per_layer must have shape [L] or [L, 2] (k, v), got {a.shape}")
    s = np.maximum(a, AMAX_EPS) / f.max_value
    return tuple(float(v) for v in s) if s.ndim == 1 else tuple((float(k), float(v)) for k, v in s)


# ----------------------------------------------------------------------------------------------------------------------
# Weight noise
# ----------------------------------------------------------------------------------------------------------------------

def _path_str(path: tuple) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def add_weight_noise(params: Any, sigma: float, key: Array, mode: str = "relative",
                     filter: Callable[[str], bool] | None = None) -> Any:  # noqa: A002
    """Add Gaussian noise to every floating leaf of a pytree (a mismatch knob with a known scale).

    relative: w + sigma * rms(w) * eps, rms(w) = sqrt(mean(w^2)) per tensor;   absolute: w + sigma * eps;
    eps ~ N(0, 1) drawn in float32 with key fold_in(key, leaf_index), the sum cast back to the leaf's dtype.
    Integer/bool leaves and leaves whose "/"-joined path fails `filter(path)` are untouched; sigma == 0 returns
    `params` itself. Deterministic for a given key and tree structure.
    """
    if mode not in ("relative", "absolute"):
        raise ValueError(f"noise mode must be 'relative' or 'absolute', got {mode!r}")
    if isinstance(sigma, (int, float)) and sigma == 0:
        return params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        dtype = getattr(leaf, "dtype", None)
        if (dtype is None or not jnp.issubdtype(dtype, jnp.floating)
                or (filter is not None and not filter(_path_str(path)))):
            out.append(leaf)
            continue
        out.append(_noisy(leaf, sigma, jax.random.fold_in(key, i), mode))
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.partial(jax.jit, static_argnames=("mode",))
def _noisy(w: Array, sigma: Any, key: Array, mode: str) -> Array:
    w32 = w.astype(jnp.float32)
    std = sigma * jnp.sqrt(jnp.mean(jnp.square(w32))) if mode == "relative" else sigma
    return (w32 + std * jax.random.normal(key, w.shape, jnp.float32)).astype(w.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Memory accounting
# ----------------------------------------------------------------------------------------------------------------------

def llama_weight_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes (opdjax layout: linear kernels [in, out]) of a Llama/Qwen2/Qwen3 decoder.

    cfg needs vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
    tie_word_embeddings; optional attention_bias (q/k/v biases, as Qwen2) and qk_norm (q_norm/k_norm, as Qwen3).
    lm_head.weight is absent when embeddings are tied.
    """
    E, F, H, K, D, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": (E, H * D), f"{p}.self_attn.k_proj.weight": (E, K * D),
            f"{p}.self_attn.v_proj.weight": (E, K * D), f"{p}.self_attn.o_proj.weight": (H * D, E),
            f"{p}.mlp.gate_proj.weight": (E, F), f"{p}.mlp.up_proj.weight": (E, F), f"{p}.mlp.down_proj.weight": (F, E),
            f"{p}.input_layernorm.weight": (E,), f"{p}.post_attention_layernorm.weight": (E,),
        })
        if getattr(cfg, "attention_bias", False):
            shapes.update({f"{p}.self_attn.q_proj.bias": (H * D,), f"{p}.self_attn.k_proj.bias": (K * D,),
                           f"{p}.self_attn.v_proj.bias": (K * D,)})
        if getattr(cfg, "qk_norm", False):
            shapes.update({f"{p}.self_attn.q_norm.weight": (D,), f"{p}.self_attn.k_norm.weight": (D,)})
    shapes["model.norm.weight"] = (E,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (E, V)
    return shapes


def _num_scales(shape: tuple[int, ...], spec: QSpec) -> int:
    """Number of float32 scales `quantize` returns for a tensor of `shape` (kernel [in, out])."""
    if spec.granularity == "tensor":
        return 1
    if spec.granularity == "channel":
        return shape[-1]
    if spec.granularity == "token":
        return math.prod(shape[:-1])
    bm, bn = spec.block
    return math.prod(shape[:-2]) * -(-shape[-2] // bm) * -(-shape[-1] // bn)


def weight_bytes(cfg: Any, recipe: Recipe | None = None, base_dtype_bytes: int = 2) -> int:
    """Bytes of the decoder's weights: a quantized tensor costs numel * fmt bytes (1) + 4 bytes per scale, every
    other tensor numel * base_dtype_bytes. Selection as in `apply_to_named`."""
    total = 0
    for name, shape in llama_weight_shapes(cfg).items():
        spec = None if recipe is None else _weight_spec(recipe, name, len(shape))
        n = math.prod(shape)
        total += n * base_dtype_bytes if spec is None else n * FORMATS[spec.fmt].bytes + SCALE_BYTES * _num_scales(
            shape, spec)
    return total


def kv_cache_bytes_per_token(cfg: Any, recipe: Recipe | None = None, base_dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token occupies: 2 (K, V) * num_layers * num_kv_heads * head_dim * bytes.

    bytes = base_dtype_bytes for a high-precision cache, 1 for an fp8/int8 cache. A dynamic per-token KV scale adds
    one float32 scale per (token, layer, kv head, K/V): + 2 * num_layers * num_kv_heads * 4. Fixed, calibrated
    (per-layer) and dynamic per-tensor scales are per layer, not per token, and add nothing here.
    """
    n = 2 * cfg.num_layers * cfg.num_kv_heads
    if recipe is None or recipe.kv_cache is None:
        return n * cfg.head_dim * base_dtype_bytes
    overhead = SCALE_BYTES if recipe.kv_dynamic and recipe.kv_cache.granularity == "token" else 0
    return n * (cfg.head_dim * FORMATS[recipe.kv_cache.fmt].bytes + overhead)


def kv_capacity_tokens(cfg: Any, memory_bytes: int | float, recipe: Recipe | None = None,
                       base_dtype_bytes: int = 2) -> int:
    """Tokens of KV cache that fit next to the weights: max(memory - weight_bytes, 0) // kv bytes per token.
    (Activations and framework overhead are not counted; compare recipes on the same memory_bytes.)"""
    free = int(memory_bytes) - weight_bytes(cfg, recipe, base_dtype_bytes)
    return max(free, 0) // kv_cache_bytes_per_token(cfg, recipe, base_dtype_bytes)

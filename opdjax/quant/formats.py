"""Simulated quantization (quantize–dequantize, "qdq") of weights, activations and the KV cache.

The rollout engine (vLLM on GPU) runs FP8 weights, FP8 activations and an FP8 KV cache; the learner runs in
bf16/fp32. This module reproduces the engine's rounding in JAX so that the same mismatch can be measured on a CPU
(`JaxEngine` with a recipe), and produces the (q, scale) pairs a weight bridge would ship.

Formats (`FORMATS`):

    "e4m3"  jnp.float8_e4m3fn   max 448     (no inf: an overflowing cast gives NaN, so values are clipped first)
    "e5m2"  jnp.float8_e5m2     max 57344
    "int8"  jnp.int8            max 127     (symmetric, round-half-to-even, [-127, 127])
    "e2m1"  float32 codes       max 6       FP4 (OCP / NVIDIA e2m1): ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, 4 bits
    "int4"  float32 codes       max 7       symmetric, round-half-to-even, [-7, 7], 4 bits

The 4-bit formats are weight-only here (W4A16: activations and the KV cache stay high precision). `quantize`
returns their q as float32 code values (the e2m1 values, or the int4 integers), not packed nibbles: opdjax's weight
bridge never ships a 4-bit weight, so nothing needs the packed layout. The e2m1 rounding is arithmetic in float32
(`round_e2m1`), so there is no convert for a compiler to drop either.

Quantization (one formula for every granularity; `amax` is taken over the granularity's group):

    scale = max(amax(|x|), AMAX_EPS) * (1 / fmt_max)      (float32; or a given fixed `scale`)
    q     = cast(clip(x * (1 / scale), -fmt_max, fmt_max)) (int: round before the cast; e2m1: round onto its grid)
    x'    = q * scale                                     (dequantize; computed in float32, cast to x's dtype)

Scale rules (`scale_fmt`, `SCALE_FMTS`; "e8m0" and "e4m3" only for fmt "e2m1" with granularity "block"):

    "f32"   the formula above (every format; the default)
    "e8m0"  MXFP4 (OCP Microscaling): scale = 2^(floor(log2(max(amax_block, AMAX_EPS))) - emax_elem), a power of
            two (emax_elem = 2 for e2m1, whose largest value 6 = 1.5 * 2^2); x / scale may exceed 6 (up to < 8) and
            is clipped to ±6, the spec's clamp. Blocks of 32 along the input axis: block (32, 1) for a kernel
            [in, out].
    "e4m3"  NVFP4: s_t = max(amax_tensor, AMAX_EPS) / (6 * 448) (float32, one per tensor),
            s_b = e4m3(clip(amax_block / 6 / s_t, 2^-9, 448)) (rounded to an e4m3 value by the same quantize and
            bit-level decode as the e4m3 format, floored at e4m3's smallest subnormal 2^-9), scale = s_b * s_t.
            Blocks of 16 along the input axis: block (16, 1).
    The returned scale is always the float32 effective scale, so `dequantize` is the same for every rule.

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
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from opdjax.core.errors import InputError

Array = jax.Array

# ----------------------------------------------------------------------------------------------------------------------
# Formats and the core quantize / dequantize / qdq
# ----------------------------------------------------------------------------------------------------------------------

AMAX_EPS = 1e-12  # floor on amax so an all-zero group gives scale > 0 (q = 0, x' = 0) instead of 0/0 = NaN
SCALE_BYTES = 4  # scales are float32


@dataclasses.dataclass(frozen=True)
class QFormat:
    """A storage format: the dtype `quantize` returns q in, its largest finite magnitude, whether it is an integer
    format, and `bits`, the width one value takes in a served checkpoint (8; 4 for e2m1 and int4, whose q comes
    back as float32 code values: see the module docstring)."""

    name: str
    dtype: Any
    max_value: float
    is_int: bool = False
    bits: int = 8


FORMATS: dict[str, QFormat] = {
    "e4m3": QFormat("e4m3", jnp.float8_e4m3fn, 448.0),
    "e5m2": QFormat("e5m2", jnp.float8_e5m2, 57344.0),
    "int8": QFormat("int8", jnp.int8, 127.0, is_int=True),
    "e2m1": QFormat("e2m1", jnp.float32, 6.0, bits=4),
    "int4": QFormat("int4", jnp.float32, 7.0, is_int=True, bits=4),
}
GRANULARITIES = ("tensor", "channel", "token", "block")
KV_GRANULARITIES = ("tensor", "token")
SCALE_FMTS = ("f32", "e8m0", "e4m3")  # float32 scales; MXFP4 power-of-two block scales; NVFP4 e4m3 block scales
E2M1_EMAX = 2  # floor(log2(6)): the exponent of e2m1's largest value, MX's emax_elem
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9  # the smallest positive e4m3 value: NVFP4 block scales are floored here


class RecipeError(InputError):
    """A quantization format, granularity, recipe name or recipe field that does not exist or does not fit."""


def get_format(fmt: str) -> QFormat:
    """The `QFormat` named `fmt` ("e4m3", "e5m2", "int8", "e2m1", "int4"); RecipeError listing the valid ones
    otherwise."""
    if fmt not in FORMATS:
        raise RecipeError(f"unknown quantization format {fmt!r}; valid formats: {sorted(FORMATS)}")
    return FORMATS[fmt]


def check_granularity(granularity: str) -> None:
    """RecipeError unless `granularity` is one of GRANULARITIES."""
    if granularity not in GRANULARITIES:
        raise RecipeError(f"unknown granularity {granularity!r}; valid granularities: {list(GRANULARITIES)}")


def check_scale_fmt(fmt: str, granularity: str, scale_fmt: str) -> None:
    """RecipeError unless `scale_fmt` is one of SCALE_FMTS and fits: "e8m0" (MXFP4) and "e4m3" (NVFP4) scale rules
    need fmt "e2m1" with granularity "block"; "f32" fits every format and granularity."""
    if scale_fmt not in SCALE_FMTS:
        raise RecipeError(f"unknown scale_fmt {scale_fmt!r}; valid scale formats: {list(SCALE_FMTS)}")
    if scale_fmt != "f32" and (fmt, granularity) != ("e2m1", "block"):
        kind = "MXFP4" if scale_fmt == "e8m0" else "NVFP4"
        raise RecipeError(f"scale_fmt {scale_fmt!r} ({kind} block scales) needs fmt 'e2m1' with granularity "
                          f"'block', got fmt {fmt!r} with granularity {granularity!r}; use scale_fmt 'f32' otherwise")


def check_block(block: Sequence[int]) -> tuple[int, int]:
    """`block` as (rows, cols) of positive ints; RecipeError otherwise."""
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


def round_e2m1(y: Array) -> Array:
    """Round float32 values in [-6, 6] to the nearest e2m1 value, ties to even, in float32 arithmetic.

    e2m1 (1 sign, 2 exponent bits with bias 1, 1 mantissa bit) has the values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}: a step
    of 0.5 on [0, 2) (0.5 is its subnormal), 1 on [2, 4), 2 on [4, 6]. |y'| = round(|y| / step) * step with
    jnp.round (half to even) breaks a tie towards the value whose mantissa bit is 0 (0.25 -> 0, 0.75 -> 1,
    1.75 -> 2, 5 -> 4), as a round-to-nearest-even cast does; dividing by a power of two is exact. The sign is
    copied back (-0.1 -> -0.0). Bit-identical to an ml_dtypes float4_e2m1fn cast of the clipped value (tested).
    """
    a = jnp.abs(y)
    step = jnp.where(a < 2.0, np.float32(0.5), jnp.where(a < 4.0, np.float32(1.0), np.float32(2.0)))
    return jnp.copysign(jnp.round(a * (np.float32(1.0) / step)) * step, y)


def _cast(y: Array, f: QFormat) -> Array:
    """Clip to ±fmt_max (e4m3fn has no inf: overflow would become NaN), round for int (onto the grid for e2m1),
    cast to the storage dtype (float32 for the 4-bit formats)."""
    y = jnp.clip(y, -f.max_value, f.max_value)
    if f.is_int:
        y = jnp.round(y)
    elif f.name == "e2m1":
        y = round_e2m1(y)
    return y.astype(f.dtype)


def e8m0_scale(amax: Array, emax_elem: int = E2M1_EMAX) -> Array:
    """MX block scale 2^(floor(log2(max(amax, AMAX_EPS))) - emax_elem), float32, any shape.

    floor(log2(a)) of a normal float32 a is its exponent field minus 127, read from the bits: exact at powers of
    two, where a float log2 could round either way. a >= AMAX_EPS keeps the field >= 87, so the power of two
    2^(field - 127 - emax_elem) is a normal float32 (and within e8m0's 2^-127..2^127).
    """
    a = jnp.maximum(jnp.asarray(amax, jnp.float32), np.float32(AMAX_EPS))
    field = (jax.lax.bitcast_convert_type(a, jnp.uint32) >> 23) & 0xFF
    return jax.lax.bitcast_convert_type((field - np.uint32(emax_elem)) << 23, jnp.float32)


def nvfp4_scales(amax_block: Array, amax_tensor: Array, fmt_max: float = 6.0) -> tuple[Array, Array]:
    """NVFP4's two-level scale: (s_b, s_t), block scales [...] (same shape as amax_block) and a scalar.

    s_t = max(amax_tensor, AMAX_EPS) * (1 / (fmt_max * 448))          float32 per-tensor scale
    s_b = e4m3(clip(amax_block * (1/fmt_max) * (1/s_t), 2^-9, 448))  an e4m3 value, >= the smallest subnormal
    The effective scale of a block is s_b * s_t. The e4m3 rounding is the e4m3 format's own cast and bit-level
    decode (`_decode_f8`), so no compiler can drop it; the floor keeps an all-zero block's scale positive.
    """
    s_t = jnp.maximum(jnp.asarray(amax_tensor, jnp.float32), np.float32(AMAX_EPS)) * np.float32(
        1.0 / (fmt_max * E4M3_MAX))
    v = amax_block * np.float32(1.0 / fmt_max) * (np.float32(1.0) / s_t)
    v = jnp.clip(v, np.float32(E4M3_MIN_SUBNORMAL), np.float32(E4M3_MAX))
    return _decode_f8(v.astype(jnp.float8_e4m3fn)), s_t


def _computed_scale(x32, f: QFormat, granularity, block, axis, channel_axis, scale_fmt):
    """The float32 scale of x32 under the granularity and scale rule (block: [..., nM, nN]; others broadcast)."""
    if granularity == "block":
        amax = _block_amax(x32, block)
    else:
        amax = _amax(x32, granularity, axis, channel_axis)
    if scale_fmt == "e8m0":
        return e8m0_scale(amax, E2M1_EMAX)
    if scale_fmt == "e4m3":
        s_b, s_t = nvfp4_scales(amax, jnp.max(jnp.abs(x32)), f.max_value)
        return s_b * s_t
    return jnp.maximum(amax, AMAX_EPS) * np.float32(1.0 / f.max_value)


def _quantize_impl(x, scale, fmt, granularity, block, axis, channel_axis, scale_fmt="f32"):
    """The one quantizer behind `quantize` and `qdq` (traced inside their jits)."""
    f = FORMATS[fmt]
    x32 = x.astype(jnp.float32)
    if scale is None:
        scale = _computed_scale(x32, f, granularity, block, axis, channel_axis, scale_fmt)
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


_STATIC = ("fmt", "granularity", "block", "axis", "channel_axis", "scale_fmt")
_quantize_jit = jax.jit(_quantize_impl, static_argnames=_STATIC)
_dequantize_jit = jax.jit(_dequantize_impl, static_argnames=("dtype", "block"))


@functools.partial(jax.jit, static_argnames=_STATIC + ("ste",))
def _qdq_jit(x, scale, fmt, granularity, block, axis, channel_axis, scale_fmt, ste):
    q, s = _quantize_impl(x, scale, fmt, granularity, block, axis, channel_axis, scale_fmt)
    y = _dequantize_impl(q, s, x.dtype, block if granularity == "block" else None)
    if ste:
        y = jax.lax.stop_gradient(y) + (x - jax.lax.stop_gradient(x))
    return y


def _check_args(x: Array, fmt: str, granularity: str, block: Sequence[int], scale: Any, scale_fmt: str = "f32"):
    f = get_format(fmt)
    check_granularity(granularity)
    check_scale_fmt(fmt, granularity, scale_fmt)
    block = check_block(block)
    if granularity == "block" and x.ndim < 2:
        raise RecipeError(f"block granularity needs an array of rank >= 2, got shape {x.shape}")
    if x.ndim == 0 and granularity != "tensor":
        raise RecipeError(f"granularity {granularity!r} needs an array of rank >= 1, got a scalar")
    return dict(fmt=f.name, granularity=granularity, block=block, scale_fmt=scale_fmt), (
        None if scale is None else jnp.asarray(scale, jnp.float32))


def quantize(x: Array, fmt: str, granularity: str = "tensor", *, block: Sequence[int] = (128, 128), axis: int = -1,
             channel_axis: int = -1, scale: Array | float | None = None, scale_fmt: str = "f32"
             ) -> tuple[Array, Array]:
    """Quantize x to `fmt` with one scale per `granularity` group. Returns (q, scale).

    scale = max(amax, AMAX_EPS) * (1/fmt_max) (float32), q = cast(clip(x * (1/scale), ±fmt_max)) in the storage
    dtype (float8_e4m3fn, float8_e5m2 or int8; float32 code values for e2m1 and int4). Scale shapes per
    granularity are in the module docstring: tensor (), channel S with all axes but `channel_axis` -> 1, token S
    with `axis` -> 1, block S[:-2] + (ceil(M/bm), ceil(N/bn)). scale_fmt "e8m0" (MXFP4) / "e4m3" (NVFP4) computes
    a block's scale by that rule (module docstring) and returns the float32 effective scale.

    `scale` given: used as is (a fixed scale, e.g. 1.0 for vLLM's uncalibrated FP8 KV cache; it must broadcast
    against x, or for "block" have the block-scale shape); no amax is computed. Finite inputs never give NaN/inf:
    values beyond ±fmt_max * scale saturate. Works on any float input dtype (computed in float32).
    """
    x = jnp.asarray(x)
    static, scale = _check_args(x, fmt, granularity, block, scale, scale_fmt)
    return _quantize_jit(x, scale, axis=axis, channel_axis=channel_axis, **static)


def dequantize(q: Array, scale: Array, dtype: Any = jnp.float32, *, block: Sequence[int] | None = None) -> Array:
    """x' = (float32(q) * scale) cast to `dtype`.

    `scale` broadcasts against q for tensor/channel/token scales. A block scale [..., nM, nN] needs the `block` it
    was made with (the padding makes the block size ambiguous from shapes alone); a rank < 2 scale is always
    broadcast, so `block` may be passed for any granularity.
    """
    return _dequantize_jit(q, jnp.asarray(scale, jnp.float32), dtype=jnp.dtype(dtype),
                           block=None if block is None else check_block(block))


def qdq(x: Array, fmt: str, granularity: str = "tensor", *, block: Sequence[int] = (128, 128), axis: int = -1,
        channel_axis: int = -1, scale: Array | float | None = None, scale_fmt: str = "f32", ste: bool = False
        ) -> Array:
    """Simulated quantization: dequantize(quantize(x, ...)) in x's dtype (f32, bf16, ...), one jit.

    Built from the same quantizer and dequantizer as `quantize` / `dequantize`, so both paths agree bit-for-bit.
    ste=True: straight-through estimator, value qdq(x), gradient identity. Written as
    sg(qdq(x)) + (x - sg(x)), whose value is exactly qdq(x) (x - x = 0) and whose d/dx is 1.
    ste=False: the plain composition (its gradient is that of the rounding function, mostly useless).
    """
    x = jnp.asarray(x)
    static, scale = _check_args(x, fmt, granularity, block, scale, scale_fmt)
    return _qdq_jit(x, scale, axis=axis, channel_axis=channel_axis, ste=bool(ste), **static)

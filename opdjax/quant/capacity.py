"""Memory accounting: weight bytes, KV-cache bytes per token and KV tokens that fit, BF16 vs a recipe."""

from __future__ import annotations

import math
from typing import Any

from opdjax.core.layout import weight_shapes
from opdjax.quant.formats import FORMATS, SCALE_BYTES
from opdjax.quant.recipes import QSpec, Recipe, weight_spec

# ----------------------------------------------------------------------------------------------------------------------
# Memory accounting
# ----------------------------------------------------------------------------------------------------------------------

def _num_scales(shape: tuple[int, ...], spec: QSpec) -> int:
    """Number of scales `quantize` returns for a tensor of `shape` (kernel [in, out])."""
    if spec.granularity == "tensor":
        return 1
    if spec.granularity == "channel":
        return shape[-1]
    if spec.granularity == "token":
        return math.prod(shape[:-1])
    bm, bn = spec.block
    return math.prod(shape[:-2]) * -(-shape[-2] // bm) * -(-shape[-1] // bn)


INT4_GROUP_SCALE_BYTES = 2  # GPTQ / AWQ / compressed-tensors W4A16 checkpoints store fp16 / bf16 group scales
BLOCK_SCALE_BYTES = {"e8m0": 1, "e4m3": 1}  # MXFP4 / NVFP4: one byte per block scale
NVFP4_TENSOR_SCALE_BYTES = 4  # NVFP4's float32 per-tensor scale (weight_scale_2)


def scale_bytes(spec: QSpec) -> int:
    """Bytes one scale of `spec` takes in a served checkpoint: 1 for an e8m0 (MXFP4) or e4m3 (NVFP4) block scale,
    INT4_GROUP_SCALE_BYTES (2) for an int4 scale, as the checkpoints store them (the simulation keeps int4 scales in
    float32; their fp16/bf16 rounding is not simulated), SCALE_BYTES (4, float32) for every other format."""
    if spec.scale_fmt in BLOCK_SCALE_BYTES:
        return BLOCK_SCALE_BYTES[spec.scale_fmt]
    return INT4_GROUP_SCALE_BYTES if spec.fmt == "int4" else SCALE_BYTES


def quantized_tensor_bytes(shape: tuple[int, ...], spec: QSpec) -> int:
    """Bytes of one quantized tensor: ceil(numel * bits / 8) (two 4-bit values per byte) + scale_bytes(spec) per
    scale, + NVFP4_TENSOR_SCALE_BYTES for an NVFP4 tensor's float32 per-tensor scale."""
    values = -(-math.prod(shape) * FORMATS[spec.fmt].bits // 8)
    extra = NVFP4_TENSOR_SCALE_BYTES if spec.scale_fmt == "e4m3" else 0
    return values + scale_bytes(spec) * _num_scales(shape, spec) + extra


def weight_bytes(cfg: Any, recipe: Recipe | None = None, base_dtype_bytes: int = 2) -> int:
    """Bytes of the decoder's weights: a quantized tensor costs `quantized_tensor_bytes` (values at the format's
    bits, plus its scales), every other tensor numel * base_dtype_bytes. Selection as in `apply_to_named`."""
    total = 0
    for name, shape in weight_shapes(cfg).items():
        spec = None if recipe is None else weight_spec(recipe, name, len(shape))
        total += math.prod(shape) * base_dtype_bytes if spec is None else quantized_tensor_bytes(shape, spec)
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
    return n * (cfg.head_dim * FORMATS[recipe.kv_cache.fmt].bits // 8 + overhead)


def kv_capacity_tokens(cfg: Any, memory_bytes: int | float, recipe: Recipe | None = None,
                       base_dtype_bytes: int = 2) -> int:
    """Tokens of KV cache that fit next to the weights: max(memory - weight_bytes, 0) // kv bytes per token.
    (Activations and framework overhead are not counted; compare recipes on the same memory_bytes.)"""
    free = int(memory_bytes) - weight_bytes(cfg, recipe, base_dtype_bytes)
    return max(free, 0) // kv_cache_bytes_per_token(cfg, recipe, base_dtype_bytes)

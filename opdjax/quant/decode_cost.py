"""A bytes-moved model of one batched decode step, BF16 vs a recipe (FP8, 4-bit), at the batch that equal memory allows.

A model, not a measurement: decode at the batch sizes that fill a device is memory-bound, so one step costs about
the bytes it must read (every weight once, every cached K/V of the batch once) divided by the memory bandwidth.
FLOPs, kernel launches, activations and the KV write of the new token are not counted, so a measured step is
slower than the model; FP8 halves the weight bytes of the decoder's linear layers and the KV bytes per token.

    max_batch            sequences of `context_len` cached tokens that fit next to the weights in `memory_bytes`
    decode_weight_bytes  weight bytes one step reads (the embedding table is gathered, not read, when untied)
    decode_step_bytes    weights read + batch * context_len * KV bytes per token (+ a dequantized copy's traffic)
    decode_model         batch, bytes, seconds per step, seconds per token and tokens/s at a bandwidth
"""

from __future__ import annotations

import math
from typing import Any

from opdjax.core.errors import ConfigError
from opdjax.core.layout import weight_shapes
from opdjax.quant.capacity import kv_cache_bytes_per_token, kv_capacity_tokens, weight_bytes
from opdjax.quant.recipes import Recipe

# Nominal HBM bandwidth in bytes/s (vendor data sheets): the model's default denominators.
BANDWIDTHS: dict[str, float] = {"h100-sxm": 3.35e12, "h100-pcie": 2.0e12, "h200": 4.8e12}


def max_batch(cfg: Any, memory_bytes: int | float, context_len: int, recipe: Recipe | None = None,
              base_dtype_bytes: int = 2) -> int:
    """Sequences that fit: kv_capacity_tokens(memory_bytes) // context_len, with
    kv_capacity_tokens = max(memory - weight_bytes, 0) // KV bytes per token (`opdjax.quant.capacity`)."""
    if context_len <= 0:
        raise ConfigError(f"context_len must be a positive number of cached tokens per sequence, got {context_len}")
    return kv_capacity_tokens(cfg, memory_bytes, recipe, base_dtype_bytes) // int(context_len)


def decode_weight_bytes(cfg: Any, recipe: Recipe | None = None, base_dtype_bytes: int = 2) -> int:
    """Weight bytes one decode step reads: weight_bytes(cfg, recipe) less the embedding table when the embeddings
    are untied (a step gathers B rows of it, not V * hidden); a tied table is read whole as the LM head."""
    total = weight_bytes(cfg, recipe, base_dtype_bytes)
    if cfg.tie_word_embeddings:
        return total
    return total - math.prod(weight_shapes(cfg)["model.embed_tokens.weight"]) * base_dtype_bytes


def decode_step_bytes(cfg: Any, batch: int, context_len: int, recipe: Recipe | None = None,
                      base_dtype_bytes: int = 2, kv_dequant_copy: bool = False) -> int:
    """Bytes one decode step moves: decode_weight_bytes + batch * context_len * kv_bytes_per_token.

    kv_dequant_copy=True models attention that dequantizes a quantized cache into a high-precision copy before
    reading it (the unfused path): + batch * context_len * 2 * kv_bytes_per_token(BF16) (write the copy, read it).
    """
    kv = kv_cache_bytes_per_token(cfg, recipe, base_dtype_bytes)
    if kv_dequant_copy and recipe is not None and recipe.kv_cache is not None:
        kv += 2 * kv_cache_bytes_per_token(cfg, None, base_dtype_bytes)
    return decode_weight_bytes(cfg, recipe, base_dtype_bytes) + int(batch) * int(context_len) * kv


def decode_model(cfg: Any, memory_bytes: int | float, context_len: int, bandwidth: float,
                 recipe: Recipe | None = None, batch: int | None = None, base_dtype_bytes: int = 2,
                 kv_dequant_copy: bool = False) -> dict[str, Any]:
    """The modelled step at `batch` (default: max_batch at memory_bytes):
    step_s = decode_step_bytes / bandwidth, per_token_s = step_s / batch, tok_s = batch / step_s."""
    if bandwidth <= 0:
        raise ConfigError(f"bandwidth must be positive bytes/s, got {bandwidth}")
    b = max_batch(cfg, memory_bytes, context_len, recipe, base_dtype_bytes) if batch is None else int(batch)
    nbytes = decode_step_bytes(cfg, b, context_len, recipe, base_dtype_bytes, kv_dequant_copy)
    step_s = nbytes / bandwidth
    return {"kind": "model", "recipe": None if recipe is None else recipe.name, "batch": b,
            "context_len": int(context_len), "bytes": nbytes, "bandwidth": float(bandwidth), "step_s": step_s,
            "per_token_s": step_s / b if b else float("inf"), "tok_s": b / step_s,
            "kv_dequant_copy": bool(kv_dequant_copy)}


def bandwidth_of(name_or_bytes_per_s: str | float) -> float:
    """Bytes/s from a BANDWIDTHS name ("h100-sxm", "h200", ...) or a number (bytes/s, or TB/s when below 1e6)."""
    if isinstance(name_or_bytes_per_s, str) and name_or_bytes_per_s.lower() in BANDWIDTHS:
        return BANDWIDTHS[name_or_bytes_per_s.lower()]
    try:
        v = float(name_or_bytes_per_s)
    except ValueError:
        raise ConfigError(f"bandwidth {name_or_bytes_per_s!r} is neither a number nor one of "
                          f"{sorted(BANDWIDTHS)}") from None
    if v <= 0:
        raise ConfigError(f"bandwidth must be positive, got {name_or_bytes_per_s!r}")
    return v * 1e12 if v < 1e6 else v

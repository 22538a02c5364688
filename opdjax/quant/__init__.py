"""Simulated quantization of weights, activations and the KV cache (see `opdjax.quant.formats` for the formulas).

    formats    FP8/int8 and 4-bit weight formats (e2m1 with f32 / MXFP4 / NVFP4 scales, int4), quantize /
               dequantize / qdq (a rounding no compiler can remove)
    recipes    QSpec, Recipe, the preset RECIPES, recipe files, applying a recipe to named weights
    hooks      ForwardQuant (a recipe inside a forward pass), calibrated KV scales, check_effective
    capacity   weight bytes, KV bytes per token, KV tokens that fit in memory
    decode_cost  a bytes-moved model of a decode step (BF16 vs a recipe) at the batch that memory allows
"""

from opdjax.quant.capacity import (
                                  kv_cache_bytes_per_token,
                                  kv_capacity_tokens,
                                  quantized_tensor_bytes,
                                  scale_bytes,
                                  weight_bytes,
)
from opdjax.quant.formats import (
                                  AMAX_EPS,
                                  FORMATS,
                                  GRANULARITIES,
                                  KV_GRANULARITIES,
                                  SCALE_FMTS,
                                  QFormat,
                                  RecipeError,
                                  dequantize,
                                  e8m0_scale,
                                  nvfp4_scales,
                                  qdq,
                                  quantize,
                                  round_e2m1,
)
from opdjax.quant.hooks import (
                                  EFFECTIVE_MIN_FRACTION,
                                  EFFECTIVE_REL_CHANGE,
                                  ForwardQuant,
                                  IneffectiveQuantError,
                                  calibrate_kv_scales,
                                  check_effective,
                                  forward_quant,
)
from opdjax.quant.recipes import (
                                  FP8_DEFAULT,
                                  RECIPE_SUFFIXES,
                                  RECIPES,
                                  QSpec,
                                  Recipe,
                                  apply_to_named,
                                  as_recipe,
                                  dequantize_named,
                                  fused_shards,
                                  get_recipe,
                                  is_recipe_file,
                                  load_recipe_file,
                                  module_spec,
                                  quantize_named,
                                  shared_scale,
                                  weight_spec,
)

__all__ = [
    "AMAX_EPS", "FORMATS", "GRANULARITIES", "KV_GRANULARITIES", "SCALE_FMTS", "QFormat", "RecipeError",
    "quantize", "dequantize", "qdq", "round_e2m1", "e8m0_scale", "nvfp4_scales",
    "QSpec", "Recipe", "RECIPES", "RECIPE_SUFFIXES", "FP8_DEFAULT", "get_recipe", "as_recipe", "is_recipe_file",
    "load_recipe_file", "module_spec", "weight_spec", "apply_to_named", "quantize_named", "dequantize_named",
    "fused_shards", "shared_scale",
    "ForwardQuant", "forward_quant", "calibrate_kv_scales", "check_effective", "IneffectiveQuantError",
    "EFFECTIVE_REL_CHANGE", "EFFECTIVE_MIN_FRACTION",
    "kv_cache_bytes_per_token", "weight_bytes", "kv_capacity_tokens", "quantized_tensor_bytes", "scale_bytes",
]

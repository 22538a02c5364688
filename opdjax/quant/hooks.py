"""A recipe inside a forward pass (`ForwardQuant`: activations, KV cache), calibrated KV scales, and the check
that a recipe's quantization survives the compiler on this backend."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.quant.formats import AMAX_EPS, RecipeError, get_format, qdq
from opdjax.quant.recipes import QSpec, Recipe, as_recipe, module_spec, qdq_kwargs, weight_spec

Array = jax.Array

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
      weight(module, w_IO)        optionally, on a kernel [in, out] (its own scale; `apply_to_named` also shares
                                  one scale across a vLLM fused layer)
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
        spec = weight_spec(self.recipe, module + ".weight", np.ndim(w_IO))
        if spec is None:
            return w_IO
        return qdq(w_IO, spec.fmt, spec.granularity, ste=self.ste, **qdq_kwargs(spec))

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
        fn = lambda a: qdq(a, spec.fmt, spec.granularity, **qdq_kwargs(spec))  # noqa: E731
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
    f = get_format(fmt)
    a = np.asarray(amax_per_layer, np.float64)
    if a.ndim not in (1, 2) or (a.ndim == 2 and a.shape[1] != 2):
        raise ValueError(f"amax_per_layer must have shape [L] or [L, 2] (k, v), got {a.shape}")
    s = np.maximum(a, AMAX_EPS) / f.max_value
    return tuple(float(v) for v in s) if s.ndim == 1 else tuple((float(k), float(v)) for k, v in s)

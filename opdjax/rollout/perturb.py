"""Simulated engine-side mismatch knobs with a known scale: Gaussian weight noise, and rounding to a uniform grid.

`NOISE_MODES` are the kinds of the engine's `weight_noise` knob (sigma):
    fixed        W + sigma * rms(W) * eps on every floating tensor, eps drawn once and kept for every version
                 (a persistent offset that never averages out: the harshest kind per unit of mismatch)
    per_version  the same with eps redrawn at every weight update (partly averages out over training steps)
    rounding     every decoder matmul kernel (the tensors a weight-quantization recipe touches) rounded to a
                 per-output-channel uniform grid of step sigma * max|W[:, o]|, i.e. symmetric integer
                 quantization with 1/sigma levels, re-derived from the current weights at every update:
                 deterministic, tied to the weights and refreshed as they move, like a real engine's
                 quantization error (sigma = 1/127 is int8 per-channel weights)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from opdjax import quant

Array = jax.Array

__all__ = ["NOISE_MODES", "EngineMismatch", "add_weight_noise", "round_to_grid"]

NOISE_MODES = ("fixed", "per_version", "rounding")


@dataclasses.dataclass(frozen=True)
class EngineMismatch:
    """The engine-side mismatch of a rollout engine, one value validated once (on construction) and passed whole.

    recipe          simulated quantization (`quant.Recipe`; a preset name, a recipe file or a mapping is read into
                    one, None = no quantization): weights quantized at each update, activations and KV cache in
                    the forward pass
    weight_noise    the weight-noise knob sigma >= 0 (0 = none); its kind is `noise_mode`
    noise_mode      one of `NOISE_MODES` (module docstring)
    stale_versions  k >= 0: serve the weights published k versions ago

    Config keys: `rollout.recipe`, `rollout.weight_noise`, `rollout.noise_mode`, `rollout.stale_versions`; a bad
    value raises ValueError naming that key. `EngineMismatch()` is the clean engine.
    """

    recipe: quant.Recipe = dataclasses.field(default_factory=lambda: quant.as_recipe(None))
    weight_noise: float = 0.0
    noise_mode: str = "fixed"
    stale_versions: int = 0

    def __post_init__(self):
        object.__setattr__(self, "recipe", _recipe(self.recipe))
        if not float(self.weight_noise) >= 0:
            raise ValueError(f"rollout.weight_noise must be >= 0, got {self.weight_noise!r}")
        if self.noise_mode not in NOISE_MODES:
            raise ValueError(f"rollout.noise_mode={self.noise_mode!r} is not valid; choose one of "
                             f"{sorted(NOISE_MODES)}")
        if isinstance(self.stale_versions, bool) or int(self.stale_versions) != self.stale_versions \
                or self.stale_versions < 0:
            raise ValueError(f"rollout.stale_versions must be an integer >= 0, got {self.stale_versions!r}")
        object.__setattr__(self, "weight_noise", float(self.weight_noise))
        object.__setattr__(self, "stale_versions", int(self.stale_versions))

    @classmethod
    def of(cls, spec: "EngineMismatch | Mapping[str, Any] | None") -> "EngineMismatch":
        """`spec` as an EngineMismatch: itself, one built from a mapping of its fields, or the clean engine (None)."""
        if spec is None or isinstance(spec, EngineMismatch):
            return spec or cls()
        return cls(**dict(spec))

    @property
    def is_clean(self) -> bool:
        """No quantization, no noise, no staleness: the engine computes what the learner computes."""
        return self.recipe.is_noop and self.weight_noise == 0 and self.stale_versions == 0

    def describe(self) -> dict[str, Any]:
        """The knobs as plain values (what the engine reports in its stats and the probe records)."""
        return {"recipe": self.recipe.name, "weight_noise": self.weight_noise, "noise_mode": self.noise_mode,
                "stale_versions": self.stale_versions}


def _recipe(spec: Any) -> quant.Recipe:
    """`rollout.recipe` as a `quant.Recipe`: a preset name, a recipe file, a mapping or a Recipe (None: none)."""
    if isinstance(spec, str) and spec not in quant.RECIPES and not quant.is_recipe_file(spec):
        raise ValueError(f"rollout.recipe={spec!r} is not valid; choose one of {sorted(quant.RECIPES)} or a recipe "
                         "file (.json/.yaml)")
    try:
        return quant.as_recipe(spec)
    except ValueError as e:
        raise ValueError(f"rollout.recipe={spec!r}: {e}") from None


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


@jax.jit
def round_to_grid(w_IO: Array, step: Any) -> Array:
    """Round a kernel [in, out] to a per-output-channel uniform grid: s_o = step * max_i |w[i, o]|,
    w_q[i, o] = s_o * round(w[i, o] / s_o) (half to even), computed in float32 and cast back; an all-zero
    channel stays zero. step = 1/L gives L levels on each side of 0, so |w_q - w| <= s_o / 2."""
    w32 = w_IO.astype(jnp.float32)
    s_1O = step * jnp.max(jnp.abs(w32), axis=0, keepdims=True)
    safe_1O = jnp.where(s_1O > 0, s_1O, 1.0)
    return jnp.where(s_1O > 0, jnp.round(w32 / safe_1O) * safe_1O, w32).astype(w_IO.dtype)

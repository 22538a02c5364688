"""Simulated engine-side mismatch knobs: Gaussian weight noise with a known scale."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["add_weight_noise"]



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


"""Meshes and shardings: one table maps the params' logical axes onto the (data, fsdp, tensor) mesh.

The same code runs on 1 device, 8 fake CPU devices, a TPU slice or GPUs. A mesh axis is dropped from a
dimension's spec when it does not divide that dimension (tiny models on big meshes stay replicated there)
rather than failing at placement time.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.core.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_TO_MESH: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
}


def make_mesh(shape: Sequence[int] = (1, -1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one entry of `shape` may be -1 (= all remaining devices).

    Axis types are Auto explicitly (JAX's default Explicit breaks embedding gathers).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != 3:
        raise ConfigError(f"mesh.shape needs 3 entries (data, fsdp, tensor), got {shape}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ConfigError(f"mesh.shape {shape}: entries are positive device counts, and at most one -1 (the rest)")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ConfigError(f"mesh.shape {shape}: the {len(devices)} devices are not divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) > len(devices):
        raise ConfigError(f"mesh.shape {tuple(shape)} needs {math.prod(shape)} devices; this machine has "
                          f"{len(devices)} ({jax.default_backend()})")
    devs = np.asarray(devices[: math.prod(shape)]).reshape(shape)
    return Mesh(devs, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def logical_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 rules: dict[str, Any] = LOGICAL_TO_MESH) -> P:
    """PartitionSpec for an array of `shape` with logical `axes`, keeping only mesh axes that divide the dim."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match array rank {len(shape)}")
    spec, used = [], set()
    for name, dim in zip(axes, shape):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        target = rules.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        keep, size = [], 1
        for t in targets:
            n = mesh.shape[t]
            if t in used or n == 1 or dim % (size * n):
                continue
            keep.append(t)
            size *= n
        used.update(keep)
        spec.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return P(*spec)


def param_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding for every variable, from its `logical_axes` metadata (replicated when it has none)."""

    def one(var):
        axes = var.get_metadata().get("logical_axes")
        shape = var.get_value().shape
        spec = logical_spec(axes, shape, mesh) if axes is not None else P()
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, state, is_leaf=_is_var)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def shard_state(state: nnx.State, mesh: Mesh) -> nnx.State:
    """Place every variable on the mesh according to its logical axes."""
    shardings = param_shardings(state, mesh)
    return jax.tree.map(lambda v, s: v.replace(value=jax.device_put(v.get_value(), s)), state, shardings,
                        is_leaf=_is_var)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Batch-major arrays [B, ...]: rows over (data, fsdp) when they divide evenly (mesh axes that do not divide B
    are dropped, as for every logical axis), the other dims replicated."""
    return NamedSharding(mesh, logical_spec(("batch",) + (None,) * (len(shape) - 1), tuple(shape), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())

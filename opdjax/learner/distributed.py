"""A learner on several processes: JAX's multi-controller runtime (`jax.distributed`), nothing home-made.

Every process runs the same `opdjax train` with the same config. `initialize` joins the job: the coordinator address,
the process count and this process's id come from flags or the environment (OPDJAX_COORDINATOR,
OPDJAX_NUM_PROCESSES, OPDJAX_PROCESS_ID; OPDJAX_HEARTBEAT_S: seconds before a silent process counts as dead,
default 60), or `coordinator="auto"` lets JAX detect them (TPU pods, SLURM, ...).
On CPU the processes reduce gradients through gloo. The mesh then spans every process's devices; each process
samples and scores its share of every batch (`row_share`) and contributes those rows to the global batch
(`learner.to_global`); checkpoints are written and restored by all processes (orbax); only process 0 logs.
A process that dies stops the others: the collective that waits for it fails (`opdjax train` then says so and how
to resume), or, when none is under way, JAX's coordination service ends them at its heartbeat timeout with its own
message ("another task died"). (JAX's `jax_enable_recoverability` would keep them alive, but then the coordinator
process may leave before the others have disconnected, which aborts them at a normal shutdown.)
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from opdjax.core.errors import InputError

__all__ = ["agree", "barrier", "from_first", "gathered", "initialize", "is_multiprocess", "is_peer_failure", "row_share"]


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, heartbeat_s: int | None = None) -> bool:
    """Join a multi-process job when one is configured (arguments, else OPDJAX_* environment); True if joined.

    coordinator "auto": JAX's cluster auto-detection. Nothing configured: a single process, nothing happens.
    """
    coordinator = coordinator or os.environ.get("OPDJAX_COORDINATOR") or None
    heartbeat_s = int(heartbeat_s or os.environ.get("OPDJAX_HEARTBEAT_S") or 60)
    if coordinator is None:
        return False
    env_n, env_id = os.environ.get("OPDJAX_NUM_PROCESSES"), os.environ.get("OPDJAX_PROCESS_ID")
    num_processes = num_processes if num_processes is not None else (int(env_n) if env_n else None)
    process_id = process_id if process_id is not None else (int(env_id) if env_id else None)
    # Before any backend exists: CPU devices talk through gloo (the setting only concerns the CPU client).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator == "auto":
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_s)
        return True
    if num_processes is None or process_id is None:
        raise InputError(f"coordinator {coordinator!r} needs the process count and this process's id "
                         f"(--num-processes/--process-id or OPDJAX_NUM_PROCESSES/OPDJAX_PROCESS_ID)")
    if not 0 <= process_id < num_processes:
        raise InputError(f"process id {process_id} is outside [0, {num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=heartbeat_s)
    return True


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def row_share(n: int) -> tuple[int, int]:
    """[start, end) of this process's contiguous share of n rows; ValueError unless n divides evenly."""
    k, i = jax.process_count(), jax.process_index()
    if n % k:
        raise InputError(f"a batch of {n} rows does not split over {k} learner processes; use a multiple of {k}")
    return i * n // k, (i + 1) * n // k


def gathered(tree: Any) -> Any:
    """The tree with every array that is not fully addressable gathered to host (all processes must call)."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return x
    return jax.tree.map(one, tree)


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (no-op on one process)."""
    if is_multiprocess():
        multihost_utils.sync_global_devices(name)


def agree(value: int) -> int:
    """The maximum of `value` over processes (every process gets the same answer)."""
    if not is_multiprocess():
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def from_first(text: str, size: int = 256) -> str:
    """Process 0's `text` (ASCII, at most `size` bytes) on every process (no-op on one process)."""
    if not is_multiprocess():
        return text
    raw = text.encode("ascii")
    if len(raw) > size:
        raise InputError(f"from_first: {len(raw)} bytes, at most {size}")
    buf = np.zeros(size + 1, np.uint8)
    buf[0], buf[1:1 + len(raw)] = len(raw), np.frombuffer(raw, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(got[1:1 + int(got[0])]).decode("ascii")


_PEER_FAILURE = ("Gloo", "heartbeat", "Connection closed by peer", "UNAVAILABLE", "Barrier failed")


def is_peer_failure(e: BaseException) -> bool:
    """Whether an exception from a collective means another process of the job is gone."""
    return any(m in str(e) for m in _PEER_FAILURE)

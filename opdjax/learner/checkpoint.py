"""Orbax checkpoints of the learner's full TrainState (sharded; every process writes and restores its shards)."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import threading
from typing import Any, Iterator, Mapping

import jax
import orbax.checkpoint as ocp

from opdjax.core.errors import InputError
from opdjax.learner.learner import TrainState

__all__ = ["CheckpointMismatchError", "latest_step", "restore_checkpoint", "save_checkpoint", "sigint_deferred"]


class CheckpointMismatchError(InputError):
    """A checkpoint that does not fit the state it is restored into (another model size, another optimizer)."""

def save_checkpoint(directory: str | pathlib.Path, state: TrainState, extra: Mapping[str, Any],
                    max_to_keep: int = 2) -> None:
    """Save the full TrainState (orbax, sharded) plus JSON `extra` (pipeline/data position) under step N.

    A Ctrl-C during the save takes effect when the save has finished (`sigint_deferred`): the checkpoint on disk
    is whole, and the KeyboardInterrupt is raised then."""
    step = int(jax.device_get(state.step))
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    with sigint_deferred(), ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=opts) as mngr:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_as_tree(state)),
                                                extra=ocp.args.JsonSave(dict(extra))), force=True)
        mngr.wait_until_finished()


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) for the duration of the block, then deliver it to the handler that was in place.

    Why: a KeyboardInterrupt raised inside an orbax save breaks it half-way. `CheckpointManager.wait_until_finished`
    catches BaseException around its join of the save thread, logs "Save Finalize thread ... failed" and drops its
    record of the step being written (15 of 30 presses during saves of a tiny state), and the save's event loop is
    left closed. Held until the save is done, the press leaves a whole checkpoint and then interrupts. A no-op off
    the main thread (Python delivers signals to the main thread only) and when SIGINT is not handled by Python
    (SIG_IGN in a background job, SIG_DFL)."""
    prev = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(prev):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
    if pressed:
        prev(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt


def latest_step(directory: str | pathlib.Path) -> int | None:
    p = pathlib.Path(directory).absolute()
    if not p.exists():
        return None
    with ocp.CheckpointManager(p) as mngr:
        return mngr.latest_step()


def restore_checkpoint(directory: str | pathlib.Path, like: TrainState,
                       step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Restore the latest (or given) step into arrays with the shardings of `like`."""
    p = pathlib.Path(directory).absolute()
    with ocp.CheckpointManager(p) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {p}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _as_tree(like))
        try:
            out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                             extra=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:  # another model's (or optimizer's) state in the directory
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise CheckpointMismatchError(f"{p}: checkpoint step {step} does not fit this run's model and optimizer "
                                          f"({first}); resume with the model it was trained with, or start a fresh "
                                          f"run (pipeline.overwrite=true)") from e
    restored = out["state"]
    # Orbax hands back plain containers; put the leaves back into the live structure (nnx Variables, optax tuples).
    state = TrainState(**{k: jax.tree.unflatten(jax.tree.structure(getattr(like, k)), jax.tree.leaves(restored[k]))
                          for k in ("step", "params", "opt_state")})
    return state, dict(out["extra"])


def _as_tree(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}

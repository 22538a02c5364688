"""Orbax checkpoints of the learner's full TrainState (sharded; every process writes and restores its shards),
checked: parameters finite before a save, a manifest of every file's sha256 written last (`manifest`), verified
before a restore; a resume takes the newest checkpoint that passes and sets the damaged ones aside."""

from __future__ import annotations

import contextlib
import errno as errno_
import logging
import os
import pathlib
import re
import shutil
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from opdjax.core.errors import InputError, MachineFaultError, NonFiniteError
from opdjax.learner import manifest
from opdjax.learner.distributed import agree, barrier
from opdjax.learner.learner import TrainState

__all__ = ["CheckpointDamagedError", "CheckpointMismatchError", "latest_step", "restore_checkpoint",
           "restore_newest_good", "save_checkpoint", "sigint_deferred"]


class CheckpointMismatchError(InputError):
    """A checkpoint that does not fit the state it is restored into (another model size, another optimizer)."""


class CheckpointDamagedError(InputError):
    """A checkpoint whose files are not those its save wrote (changed, truncated, missing), or no finished save;
    `why` says what is wrong with it."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why or message


def save_checkpoint(directory: str | pathlib.Path, state: TrainState, extra: Mapping[str, Any],
                    max_to_keep: int = 2) -> None:
    """Save the full TrainState (orbax, sharded) plus JSON `extra` (pipeline/data position) under step N, then its
    manifest (size and sha256 of every file), then remove the checked checkpoints older than the newest
    `max_to_keep` (`manifest.rotate`: never the newest checked one).

    NonFiniteError, nothing written, when a parameter or optimizer value is NaN or infinite. A write the machine
    refuses (disk full, permission denied, ...) is a MachineFaultError naming the path and the cause (orbax's own
    error logs of that save are dropped); the partial step is removed and the earlier checkpoints are kept.
    A Ctrl-C during the save takes effect when the save has finished (`sigint_deferred`): the checkpoint on disk
    is whole, and the KeyboardInterrupt is raised then."""
    step = int(jax.device_get(state.step))
    root = pathlib.Path(directory).absolute()
    with sigint_deferred():  # from the check on: a Ctrl-C once the run has reached its save leaves the checkpoint
        if not _finite(_as_tree(state)):
            raise NonFiniteError(f"step {step}: the parameters hold NaN or infinite values; not saved under {root} "
                                 f"(the checkpoints there are kept)")
        existed, err, fault = (root / str(step)).exists(), None, None
        with _orbax_errors_held() as held:  # held until orbax's threads of a failed save have gone quiet
            try:
                _write(root, step, state, extra, max_to_keep)
            except Exception as e:
                err, fault = e, _machine_fault(e, root, step)
                if jax.process_index() == 0 and not existed:
                    _remove_partial(root, step)
                held.settle()
        if fault is not None:
            raise fault from err
        held.release()
        if err is not None:
            raise err


def _write(root: pathlib.Path, step: int, state: TrainState, extra: Mapping[str, Any], keep: int) -> None:
    """Orbax's save of `step`, its manifest and the rotation (the last two on process 0)."""
    opts = ocp.CheckpointManagerOptions(max_to_keep=None, create=True)
    with ocp.CheckpointManager(root, options=opts) as mngr:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_as_tree(state)),
                                                extra=ocp.args.JsonSave(dict(extra))), force=True)
        mngr.wait_until_finished()
    if jax.process_index() == 0:
        manifest.write_manifest(root / str(step), step)
        manifest.rotate(root, keep)
    barrier(f"opdjax-checkpoint-{step}")


def _remove_partial(root: pathlib.Path, step: int, settle_s: float = 2.0) -> None:
    """What a failed save of `step` left (its step directory, orbax's temporary ones); best effort. Writes of the
    failed save may still land for a moment after its exception (tensorstore's threads): removed until nothing of
    it is left, for at most `settle_s`."""
    def left() -> list[pathlib.Path]:
        return [p for p in [root / str(step), *root.glob(f"{step}.orbax-checkpoint-tmp*")] if p.exists()]

    deadline = time.monotonic() + settle_s
    while root.is_dir():
        for p in left():
            shutil.rmtree(p, ignore_errors=True)
        time.sleep(0.05)
        if not left() or time.monotonic() > deadline:
            return


_OS_CODE = re.compile(r"os_error_code='(\d+)'")
_QUOTED_PATH = re.compile(r'"(/[^"]+)"')


def _machine_fault(e: BaseException, root: pathlib.Path, step: int) -> MachineFaultError | None:
    """The one-line error for a write the machine refused: an OSError anywhere in e's chain, or tensorstore's
    ValueError carrying an os_error_code (how orbax reports ENOSPC, EACCES, EFBIG, ...). None for anything else."""
    seen: BaseException | None = e
    while seen is not None:
        code, path = None, None
        if isinstance(seen, OSError) and seen.errno:
            code, path = seen.errno, seen.filename
        elif m := _OS_CODE.search(str(seen)):
            code, found = int(m.group(1)), _QUOTED_PATH.findall(str(seen))
            path = found[-1] if found else None
        if code:
            name = errno_.errorcode.get(code, str(code))
            fault = MachineFaultError(f"checkpoint step {step} not saved: {path or root}: {os.strerror(code)} "
                                      f"({name}); the checkpoints saved before it under {root} are intact; fix the "
                                      f"cause (free space, permissions), then resume with pipeline.resume=true")
            fault.errno = code
            return fault
        seen = seen.__cause__ or seen.__context__
    return None


class _Held(logging.Filter):
    """Holds the ERROR records orbax logs (through absl) while a save runs: a failed save is reported once, by its
    exception; `release` hands them on when that exception is not one line of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.records.append(record)
            return False
        return True

    def settle(self, quiet_s: float = 0.25, limit_s: float = 3.0) -> None:
        """Wait until no new record has arrived for `quiet_s` (at most `limit_s`): a failed save's background
        threads log their errors after the save's exception is raised."""
        deadline, n = time.monotonic() + limit_s, -1
        while len(self.records) != n and time.monotonic() < deadline:
            n = len(self.records)
            time.sleep(quiet_s)

    def release(self) -> None:
        logger, records, self.records = logging.getLogger("absl"), self.records, []
        for r in records:
            logger.handle(r)


@contextlib.contextmanager
def _orbax_errors_held() -> Iterator[_Held]:
    held, logger = _Held(), logging.getLogger("absl")
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)


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
    """The newest step saved under directory (checked or not); None when there is none."""
    p = pathlib.Path(directory).absolute()
    if not p.exists():
        return None
    with ocp.CheckpointManager(p) as mngr:
        return mngr.latest_step()


def restore_checkpoint(directory: str | pathlib.Path, like: TrainState,
                       step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Restore the latest (or given) step into arrays with the shardings of `like`, after checking its files
    against its manifest: CheckpointDamagedError (naming the step and the file) when they differ, or when the
    parameters it holds are not finite."""
    p = pathlib.Path(directory).absolute()
    step = latest_step(p) if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {p}")
    why = manifest.damage(p / str(step))
    if agree(why is not None):
        why = why or "damaged as another learner process sees it"
        raise CheckpointDamagedError(f"{p}: checkpoint step {step} is damaged: {why}", why)
    state, extra = _restore(p, step, like)
    if not _finite(_as_tree(state)):
        why = "it holds NaN or infinite parameters"
        raise CheckpointDamagedError(f"{p}: checkpoint step {step} is damaged: {why}", why)
    return state, extra


def restore_newest_good(directory: str | pathlib.Path, like: TrainState,
                        log: Callable[[str], None] = print) -> tuple[TrainState, dict[str, Any]]:
    """The newest checkpoint under directory that passes `restore_checkpoint`'s checks. Newer ones that do not are
    renamed damaged-<step> (kept, out of the way of the steps saved again) and one line says which and why.
    CheckpointDamagedError, nothing moved, when none passes; CheckpointMismatchError when the newest checked one
    does not fit `like` (another model: the older ones would not fit either)."""
    p = pathlib.Path(directory).absolute()
    bad: list[tuple[int, str]] = []
    for step in reversed(manifest.step_numbers(p)):
        try:
            state, extra = restore_checkpoint(p, like, step)
        except CheckpointDamagedError as e:
            bad.append((step, e.why))
            continue
        if bad:
            _set_aside(p, [s for s, _ in bad])
            why = "; ".join(f"step {s}: {w}" for s, w in bad)
            log(f"WARNING: {p}: the newest checkpoint{'s' if len(bad) > 1 else ''} failed its check ({why}); "
                f"resuming from step {step}, the newest that passes (the damaged one{'s' if len(bad) > 1 else ''} "
                f"renamed damaged-<step>, kept)")
        return state, extra
    why = "; ".join(f"step {s}: {w}" for s, w in bad) or "none saved"
    raise CheckpointDamagedError(f"{p}: no checkpoint passes its check ({why}); the run cannot resume from it "
                                 f"(its files are kept): start a fresh run in another pipeline.out_dir")


def _set_aside(root: pathlib.Path, steps: list[int]) -> None:
    if jax.process_index() == 0:
        for s in steps:
            manifest.set_aside(root, s)
    barrier("opdjax-checkpoints-set-aside")


def _restore(p: pathlib.Path, step: int, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """Orbax's restore of a checked step into the structure and shardings of `like`."""
    with ocp.CheckpointManager(p) as mngr:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _as_tree(like))
        try:
            out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                             extra=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:  # another model's (or optimizer's) state in the directory
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise CheckpointMismatchError(f"{p}: checkpoint step {step} does not fit this run's model and optimizer "
                                          f"({first}); resume with the model it was trained with, or start a fresh "
                                          f"run in another pipeline.out_dir") from e
    restored = out["state"]
    # Orbax hands back plain containers; put the leaves back into the live structure (nnx Variables, optax tuples).
    state = TrainState(**{k: jax.tree.unflatten(jax.tree.structure(getattr(like, k)), jax.tree.leaves(restored[k]))
                          for k in ("step", "params", "opt_state")})
    return state, dict(out["extra"])


def _finite(tree: Any) -> bool:
    """Whether every floating-point value in the tree is finite (one jitted reduction, one transfer)."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    return not leaves or bool(jax.device_get(_all_finite(leaves)))


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def _as_tree(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}

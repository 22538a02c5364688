"""A run directory that nothing loses: one run at a time, no silent overwrite, atomic files.

    lock(out_dir)            an exclusive `flock` on out_dir/.opdjax.lock (holding the owner's pid and command) for
                             the whole run; a second run into the same directory is refused, naming the owner
    previous_run(out_dir)    what a finished or interrupted run left there (checkpoints, metrics.jsonl, summary.json)
    check_metrics(p)         metrics.jsonl readable before a resume appends to it (UTF-8, JSON lines but a torn last)
    truncate_metrics(p, s)   metrics.jsonl cut to the lines of steps <= s (a resumed run logs each step once), a torn
                             last line dropped with a warning
    write_json / write_text  atomic: a temporary file in the same directory, fsync'd, then `os.replace`
    run_id(out_dir, fresh)   the run's id (out_dir/run_id): kept across resumes, new for a fresh run; engine servers
                             serve one run id at a time (`remote.lease`)

A fresh run (`pipeline.resume=false`) into a directory holding a previous run is refused unless
`pipeline.overwrite=true`; `pipeline.resume=true` continues it (and is a no-op when it has finished), with the
run's own training config: `check_resume_config` refuses a resume that changes what is trained (naming the keys)
unless `pipeline.allow_config_change=true`, which records the changes in config_changes.jsonl. The resume guards
fail closed: a config.json or metrics.jsonl that cannot be read is an error naming the file.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import secrets
import sys
import tempfile
from typing import Any, Callable

from opdjax.core.errors import InputError

__all__ = ["RESUME_MAY_CHANGE", "RunDirError", "check_metrics", "check_resume_config", "config_changes", "lock",
           "previous_run", "run_id", "truncate_metrics", "write_json", "write_text"]

LOCK = ".opdjax.lock"
RUN_ID = "run_id"
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json")


class RunDirError(InputError):
    """The run directory is busy, or holds a run that this one would destroy."""


def write_text(path: str | pathlib.Path, text: str) -> None:
    """Write `text` to `path` atomically (readers see the old file or the new one, never a part)."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:  # mkstemp makes the file 0600: give it the mode a plain write would (the old file's, or 0666 & ~umask)
        os.fchmod(fd, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        pathlib.Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # a full disk: the one-line report names the file
            e.filename = str(path)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Keys a resumed run may change: how long it runs and how it is watched, logged and connected, not what it trains.
RESUME_MAY_CHANGE = ("pipeline.resume", "pipeline.overwrite", "pipeline.allow_config_change", "pipeline.progress",
                     "pipeline.tensorboard", "pipeline.wandb.", "pipeline.steps", "pipeline.eval_every",
                     "pipeline.eval_prompts", "pipeline.eval_seed", "pipeline.policy_movement",
                     "pipeline.checkpoint_every", "pipeline.out_dir", "sync.", "rollout.endpoints",
                     "teacher.endpoints", "mesh.")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict) or not d or prefix.endswith(("options.", "vllm.")):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def config_changes(old: dict, new: dict, may_change: tuple[str, ...] = RESUME_MAY_CHANGE) -> list[tuple]:
    """(key, old value, new value) for every config key that differs between a run's saved config and a resume's,
    leaving out `may_change` (exact keys, or prefixes ending in '.')."""
    a, b = _flatten(old), _flatten(new)
    keys = sorted(set(a) | set(b))
    free = lambda k: any(k == m or (m.endswith(".") and k.startswith(m)) for m in may_change)  # noqa: E731
    return [(k, a.get(k, "<unset>"), b.get(k, "<unset>")) for k in keys if not free(k) and a.get(k) != b.get(k)]


def check_resume_config(out_dir: str | pathlib.Path, new: dict, *, allow: bool) -> list[tuple]:
    """Compare a resume's config with the run's config.json: RunDirError naming the keys that differ, unless
    `allow` (pipeline.allow_config_change), when the changes are appended to config_changes.jsonl and returned.

    Fails closed: a config.json that is missing, unreadable or not a JSON object is a RunDirError naming the file
    (a run writes it before anything else, so a run without one cannot be checked), never "nothing to compare"."""
    old = _run_config(pathlib.Path(out_dir) / "config.json")
    changes = config_changes(old, new)
    if changes and not allow:
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes[:8])
        more = f" (and {len(changes) - 8} more)" if len(changes) > 8 else ""
        raise RunDirError(f"pipeline.resume=true with a config that differs from the run's ({shown}{more}); resume "
                          "with the run's own config, or add pipeline.allow_config_change=true to continue with the "
                          "new values (recorded in config_changes.jsonl)")
    if changes:
        with open(pathlib.Path(out_dir) / "config_changes.jsonl", "a") as f:
            f.write(json.dumps({"changes": [[k, a, b] for k, a, b in changes]}, default=str) + "\n")
    return changes


def _run_config(path: pathlib.Path) -> dict:
    """The run's saved config; RunDirError naming the file when it cannot be read as a JSON object."""
    try:
        old = json.loads(path.read_bytes().decode("utf-8"))
        problem = None if isinstance(old, dict) else f"holds a JSON {type(old).__name__}, not an object"
    except FileNotFoundError:
        problem = "is missing"
    except (OSError, ValueError) as e:  # unreadable, invalid UTF-8, invalid JSON
        problem = f"is unreadable ({type(e).__name__}: {str(e)[:120]})"
    if problem:
        raise RunDirError(f"{path} {problem}: a resume cannot check that it continues the same training; put the "
                          "run's config.json back (the one it was started with), or start a fresh run in another "
                          "pipeline.out_dir")
    return old


def write_json(path: str | pathlib.Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2))


class _Lock:
    def __init__(self, fd: int, path: pathlib.Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def lock(out_dir: str | pathlib.Path) -> _Lock:
    """Hold out_dir for this run; RunDirError naming the other process when another run holds it."""
    path = pathlib.Path(out_dir) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirError(f"pipeline.out_dir={str(out_dir)!r} is in use by {owner}; wait for it to finish or "
                          f"choose another pipeline.out_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} ({' '.join(sys.argv)[:200]})".encode(), 0)
    return _Lock(fd, path)


def run_id(out_dir: str | pathlib.Path, fresh: bool) -> str:
    """The id of the run in out_dir: the one out_dir/run_id holds (a resume), or a new one written there (a fresh
    run, or a directory without one)."""
    path = pathlib.Path(out_dir) / RUN_ID
    if not fresh:
        try:
            text = path.read_text().strip()
            if text.isalnum() and len(text) <= 64:
                return text
        except (OSError, UnicodeDecodeError):
            pass
    text = secrets.token_hex(8)
    write_text(path, text + "\n")
    return text


def previous_run(out_dir: str | pathlib.Path) -> list[str]:
    """The files of an earlier run in out_dir (empty: nothing to lose)."""
    d = pathlib.Path(out_dir)
    return [n for n in RUN_FILES if (d / n).exists()]


def check_metrics(path: str | pathlib.Path) -> list[str]:
    """The lines of a run's metrics.jsonl, checked before a resume appends to it: RunDirError naming the file (and
    line) when it is not UTF-8 or a line other than the last is not JSON. A last line that is not JSON (cut by a
    kill while it was written) is allowed: `truncate_metrics` repairs it."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise RunDirError(f"{path}: not UTF-8 (byte {e.start}); a run's metrics file is JSON lines: repair or move it "
                          "before resuming") from None
    except OSError as e:
        raise RunDirError(f"{path}: unreadable ({e.strerror or e}); fix it before resuming") from None
    for i, line in enumerate(lines[:-1], start=1):
        if not _record(line):
            raise RunDirError(f"{path}:{i}: not a JSON record (only the last line may be cut by a kill); repair or "
                              "move the file before resuming")
    return lines


def _record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def truncate_metrics(path: str | pathlib.Path, step: int, log: Callable[[str], None] = print) -> int:
    """Keep the lines of metrics.jsonl whose step is <= `step` (the checkpoint's); lines kept. A torn last line
    (a kill while it was written) is dropped with a warning through `log`; any other damage is a RunDirError
    (`check_metrics`)."""
    path = pathlib.Path(path)
    lines = check_metrics(path)
    if lines and _record(lines[-1]) is None:
        log(f"WARNING: {path}: its last line was cut off (the run was stopped while writing it): dropped; steps "
            f"after the checkpoint's step {step} are run again and logged once")
        lines = lines[:-1]
    kept = [line for line in lines if int(_record(line).get("step", 0)) <= step]
    if path.exists():
        write_text(path, "".join(k + "\n" for k in kept))
    return len(kept)

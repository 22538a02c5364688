"""A run directory that nothing loses: one run at a time, no silent overwrite, atomic files.

    lock(out_dir)            an exclusive `flock` on out_dir/.opdjax.lock (holding the owner's pid and command) for
                             the whole run; a second run into the same directory is refused, naming the owner
    previous_run(out_dir)    what a finished or interrupted run left there (checkpoints, metrics.jsonl, summary.json)
    truncate_metrics(p, s)   metrics.jsonl cut to the lines of steps <= s (a resumed run logs each step once)
    write_json / write_text  atomic: a temporary file in the same directory, fsync'd, then `os.replace`

A fresh run (`pipeline.resume=false`) into a directory holding a previous run is refused unless
`pipeline.overwrite=true`; `pipeline.resume=true` continues it (and is a no-op when it has finished).
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import sys
import tempfile
from typing import Any

from opdjax.core.errors import InputError

__all__ = ["RunDirError", "lock", "previous_run", "truncate_metrics", "write_json", "write_text"]

LOCK = ".opdjax.lock"
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json")


class RunDirError(InputError):
    """The run directory is busy, or holds a run that this one would destroy."""


def write_text(path: str | pathlib.Path, text: str) -> None:
    """Write `text` to `path` atomically (readers see the old file or the new one, never a part)."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


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


def previous_run(out_dir: str | pathlib.Path) -> list[str]:
    """The files of an earlier run in out_dir (empty: nothing to lose)."""
    d = pathlib.Path(out_dir)
    return [n for n in RUN_FILES if (d / n).exists()]


def truncate_metrics(path: str | pathlib.Path, step: int) -> int:
    """Keep the lines of metrics.jsonl whose step is <= `step` (and drop a torn last line); lines kept."""
    path = pathlib.Path(path)
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if int(rec.get("step", 0)) <= step:
            kept.append(line)
    write_text(path, "".join(k + "\n" for k in kept))
    return len(kept)

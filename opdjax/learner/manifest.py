"""A checkpoint that can be checked: the size and sha256 of every file a save wrote, in a manifest written last.

    write_manifest(step_dir, step)   after the save: opdjax_manifest.json lists every file under step_dir
    damage(step_dir)                 None when every listed file is there with its size and sha256; otherwise why not
                                     (no manifest: the save did not finish)
    step_numbers(root)               the steps under a checkpoint directory (directories named by an integer)
    rotate(root, keep)               the oldest checked checkpoints removed, the newest `keep` kept; a checkpoint
                                     without a manifest is never counted as one of those kept, nor removed
    set_aside(root, step)            a damaged step renamed to damaged-<step> (kept to look at; no longer a step)

Only the process that writes the manifest (process 0) rotates and sets aside; every process may check.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

__all__ = ["MANIFEST", "damage", "file_digests", "rotate", "set_aside", "step_numbers", "write_manifest"]

MANIFEST = "opdjax_manifest.json"
_CHUNK = 1 << 20


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digests(step_dir: pathlib.Path) -> dict[str, dict]:
    """{relative path: {"bytes": size, "sha256": hex}} for every file under step_dir but the manifest."""
    out = {}
    for p in sorted(step_dir.rglob("*")):
        rel = p.relative_to(step_dir).as_posix()
        if p.is_file() and rel != MANIFEST:
            out[rel] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    return out


def write_manifest(step_dir: pathlib.Path, step: int) -> None:
    """opdjax_manifest.json in step_dir (atomic: a temporary file, fsync'd, renamed), listing every file."""
    text = json.dumps({"format": 1, "step": int(step), "files": file_digests(step_dir)}, indent=1)
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", dir=step_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, step_dir / MANIFEST)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def damage(step_dir: pathlib.Path) -> str | None:
    """Why step_dir is not the checkpoint its manifest describes (None: every file there, same size and sha256)."""
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (the save did not finish, or the file was removed)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for rel, want in files.items():
        p = step_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{rel} is {size} bytes, {want['bytes']} when it was written (truncated or extended)"
        if _sha256(p) != want["sha256"]:
            return f"{rel}: its sha256 differs from the one recorded when it was written (bytes changed)"
    return None


def step_numbers(root: pathlib.Path) -> list[int]:
    """The steps saved under root, ascending (directories named by a non-negative integer)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def rotate(root: pathlib.Path, keep: int) -> list[int]:
    """Remove the checkpoints with a manifest older than the newest `keep` of them; the steps removed.

    Only a checkpoint whose save finished (it has a manifest) counts toward `keep`, so the newest finished one is
    never removed; a step without one is left alone (a resume checks it and sets it aside)."""
    done = [s for s in step_numbers(root) if (root / str(s) / MANIFEST).is_file()]
    gone = done[:-keep] if keep > 0 else []
    for s in gone:
        shutil.rmtree(root / str(s))
    return gone


def set_aside(root: pathlib.Path, step: int) -> pathlib.Path:
    """Rename root/<step> to root/damaged-<step> (damaged-<step>.1, ... when taken); the new path."""
    dest, n = root / f"damaged-{step}", 0
    while dest.exists():
        n += 1
        dest = root / f"damaged-{step}.{n}"
    (root / str(step)).rename(dest)
    return dest

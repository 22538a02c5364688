"""Transports: how a publish (manifest + tensors) reaches a `WeightReceiver`.

InProcessTransport   same Python process. Arrays are handed over as they are (JAX arrays reach torch through
                     DLPack without a copy); no checksums (nothing can corrupt or truncate them).
SnapshotTransport    another process on the same host. Each version is written to `<root>/.tmp-v<version>-...`
                     (manifest.json + tensors.bin, tensors back to back) and then renamed to `<root>/v<version>`
                     (`os.rename` of a complete directory is atomic): a reader sees a complete version or nothing.
                     Put `root` on /dev/shm (the default when it exists) and the snapshot lives in shared memory; the
                     writer copies each tensor into its slot of a memory-mapped tensors.bin (`np.copyto`, no
                     intermediate bytes), the receiver memory-maps it (zero-copy) and checks every CRC-32.
                     `SnapshotWatcher.poll()` applies the newest complete version newer than the one served.
                     Versions beyond the newest `keep` are retired: renamed to a hidden `.spare-v<version>` directory
                     (invisible to readers, like the .tmp ones) whose already allocated, already mapped tensors.bin
                     the next publish fills instead of allocating a fresh region. Recycling is guarded by file locks:
                     a reader holds a shared `flock` on tensors.bin from before it reads the manifest until the engine
                     has applied the tensors, and checks, once it holds the lock, that the file is still the one its
                     `v<version>` directory names; the writer recycles a spare only under a non-blocking exclusive
                     lock, and deletes it instead when a reader still holds it. A reader therefore never sees bytes
                     change under it, and a torn or recycled file is refused as "disappeared" and retried.
TCP                  `TcpReceiverServer` (engine side; binds 127.0.0.1 unless told otherwise, requires a shared
                     secret token) and `TcpTransport` (learner side). Protocol, all lengths little-endian:

                       client -> "OPDJ" u32 protocol
                       server -> 32-byte nonce
                       client -> HMAC-SHA256(token, nonce) (32 bytes), u64 n, manifest JSON (n bytes)
                       server -> status  (refused: bad token / manifest rejected -> connection closed)
                       client -> chunks: u64 length, u32 crc32, bytes ... ; a 0-length chunk ends the payload
                       server -> status  (applied, or the refusal: truncated, corrupt chunk/tensor, ...)

                     The client sends one chunk per tensor (tensors over `chunk` bytes are cut into chunks), whose
                     CRC-32 is the manifest's (computed once, when the publish was prepared). The server receives
                     into one buffer (reused between publishes) and computes the CRC-32 of every byte once, in 1 MiB
                     slices as they arrive; it checks each chunk's CRC-32 as the chunk completes and, at the end,
                     every tensor's CRC-32 against the manifest (combined from the chunks' when chunks and tensors
                     are cut differently), so the receiver does not checksum the payload a second time.
                     status = u32 n + JSON {"ok": bool, "error": str?, "version": int}. The token never crosses the
                     wire. A wrong or missing token is refused and logged; a truncated or corrupt payload is
                     refused; either way the engine keeps serving its previous version.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import pathlib
import re
import secrets
import shutil
import tempfile
import threading
import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from opdjax.sync.manifest import BridgeError, Manifest
from opdjax.sync.receiver import WeightReceiver, payload_views

log = logging.getLogger("opdjax.bridge")

__all__ = ["MAP_POPULATE", "InProcessTransport", "SnapshotTransport", "SnapshotWatcher", "default_snapshot_root",
           "snapshot_payload"]


# ----------------------------------------------------------------------------------------------------- in-process


class InProcessTransport:
    """Hands arrays straight to a receiver in the same process."""

    needs_checksums = False

    def __init__(self, receiver: WeightReceiver):
        self.receiver = receiver

    def send(self, manifest: Manifest, arrays: Sequence[Any]) -> None:
        self.receiver.receive(manifest, arrays)


# ----------------------------------------------------------------------------------------------------- snapshots

_VDIR = re.compile(r"v(\d{10})")


def default_snapshot_root() -> pathlib.Path:
    """/dev/shm/opdjax-bridge-<uid> when /dev/shm exists (shared memory), else the temp dir."""
    base = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())
    return base / f"opdjax-bridge-{os.getuid()}"


def _versions(root: pathlib.Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VDIR.fullmatch(p.name)) and p.is_dir())


def _fill(buf: np.ndarray, manifest: Manifest, arrays: Iterable[Any]) -> None:
    """Copy each array into its slot of `buf` (uint8, manifest.total_bytes long); one pass, no temporaries."""
    it = iter(arrays)
    for i, e in enumerate(manifest.entries):
        a = next(it, _END)
        if a is _END:
            raise BridgeError(f"v{manifest.version}: {i} arrays for {len(manifest.entries)} manifest entries")
        a = np.asarray(a)
        if a.nbytes != e.nbytes:
            raise BridgeError(f"v{manifest.version}: tensor {e.name!r} is {a.dtype}{list(a.shape)} ({a.nbytes} bytes), "
                              f"the manifest says {e.dtype}{list(e.shape)} ({e.nbytes} bytes)")
        dst = buf[e.offset:e.offset + e.nbytes]
        if a.flags.c_contiguous:
            np.copyto(dst, a.reshape(-1).view(np.uint8))
        else:
            np.copyto(dst.view(a.dtype).reshape(a.shape), a)
    if next(it, _END) is not _END:
        raise BridgeError(f"v{manifest.version}: more arrays than the {len(manifest.entries)} manifest entries")


_END = object()
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""mmap's MAP_POPULATE flag (allocate and map every page at once), or 0 where the platform has none."""


class _Region:
    """A payload file the writer keeps open and mapped read-write (pages allocated and mapped once, then reused)."""

    def __init__(self, path: pathlib.Path, size: int, *, create: bool):
        self.fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o644)
        st = os.fstat(self.fd)
        self.key = (st.st_dev, st.st_ino)
        self.size, self.mm, self.buf = st.st_size, None, np.zeros(0, np.uint8)
        try:
            self._map(size, force=True)
        except BaseException:
            os.close(self.fd)
            raise

    def _map(self, size: int, force: bool = False) -> None:
        if size == self.size and not force:
            return
        self.buf = np.zeros(0, np.uint8)
        if self.mm is not None:
            _close_map(self.mm)
            self.mm = None
        if size != os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, size)
        if size:
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | MAP_POPULATE)
            self.buf = np.frombuffer(self.mm, np.uint8)
        self.size = size

    def resize(self, size: int) -> None:
        self._map(size, force=os.fstat(self.fd).st_size != self.size)

    def lock(self) -> bool:
        """Take the exclusive lock without waiting; False while a reader holds the file."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def linked(self) -> bool:
        return os.fstat(self.fd).st_nlink > 0

    def close(self) -> None:
        self.buf = np.zeros(0, np.uint8)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        if self.mm is not None:
            _close_map(self.mm)
        os.close(self.fd)


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view is still alive (say, in a traceback's frame): unmapped when it goes
        pass


def _close_regions(regions: dict) -> None:
    while regions:
        regions.popitem()[1].close()


class SnapshotTransport:
    """Writes each publish as an atomically renamed, versioned directory under `root`; keeps the last `keep`.

    spares: retired versions kept (hidden) so that later publishes refill their shared memory instead of
    allocating it (0: delete retired versions at once). Memory held in root: at most keep + spares payloads, plus
    the one being written.
    """

    needs_checksums = True

    def __init__(self, root: str | pathlib.Path | None = None, *, keep: int = 2, spares: int = 1):
        self.root = pathlib.Path(root) if root is not None else default_snapshot_root()
        self.root.mkdir(parents=True, exist_ok=True)
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.keep, self.spares = int(keep), int(spares)
        self._regions: dict[tuple[int, int], _Region] = {}  # files this writer has mapped, by (device, inode)
        weakref.finalize(self, _close_regions, self._regions)
        self.last_stats: dict[str, Any] = {}

    def path(self, version: int) -> pathlib.Path:
        return self.root / f"v{int(version):010d}"

    def send(self, manifest: Manifest, arrays: Sequence[Any]) -> pathlib.Path:
        final = self.path(manifest.version)
        if final.exists():
            raise BridgeError(f"snapshot {final} already exists; versions are published once")
        tmp = self.root / f".tmp-v{manifest.version:010d}-{os.getpid()}-{secrets.token_hex(4)}"
        region, recycled = self._claim(tmp, manifest.total_bytes)
        try:
            _fill(region.buf, manifest, arrays)
            (tmp / "manifest.json").write_text(manifest.to_json())
            os.rename(tmp, final)  # atomic: readers see the complete directory or none
        except BaseException:
            self._forget(region)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if region.key in self._regions:
                region.unlock()
        self._retire()
        self.last_stats = {"recycled": recycled, "bytes": manifest.total_bytes}
        return final

    def close(self) -> None:
        """Unmap the regions this writer holds (the published files stay)."""
        _close_regions(self._regions)

    def _forget(self, region: _Region) -> None:
        if self._regions.pop(region.key, None) is not None:
            region.close()

    def _region(self, f: pathlib.Path) -> _Region:
        st = os.stat(f)
        r = self._regions.get((st.st_dev, st.st_ino))
        if r is None:
            r = _Region(f, st.st_size, create=False)
            self._regions[r.key] = r
        return r

    def _claim(self, tmp: pathlib.Path, size: int) -> tuple[_Region, bool]:
        """A region of `size` bytes in the new directory `tmp`, locked exclusively: a spare's, else a fresh one."""
        for spare in sorted((p for p in self.root.iterdir() if p.name.startswith(".spare-")), reverse=True):
            try:
                r = self._region(spare / "tensors.bin")
            except OSError:
                shutil.rmtree(spare, ignore_errors=True)
                continue
            if not r.lock():  # a reader is still applying it: leave it to the reader, allocate anew
                self._forget(r)
                shutil.rmtree(spare, ignore_errors=True)
                continue
            try:
                os.rename(spare, tmp)
            except OSError:  # another writer sharing the root took it first
                r.unlock()
                self._forget(r)
                continue
            try:
                r.resize(size)
            except BaseException:
                r.unlock()
                self._forget(r)
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return r, True
        tmp.mkdir()
        try:
            r = _Region(tmp / "tensors.bin", size, create=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._regions[r.key] = r
        r.lock()
        return r, False

    def _retire(self) -> None:
        """Hide the versions beyond the newest `keep` as spares; delete spares beyond `spares`."""
        for v in _versions(self.root)[:-self.keep]:
            try:
                os.rename(self.path(v), self.root / f".spare-v{v:010d}-{secrets.token_hex(4)}")
            except OSError:
                shutil.rmtree(self.path(v), ignore_errors=True)
        spares = sorted(p for p in self.root.iterdir() if p.name.startswith(".spare-"))
        for p in spares[:len(spares) - self.spares]:
            shutil.rmtree(p, ignore_errors=True)
        for r in list(self._regions.values()):
            if not r.linked():
                self._forget(r)


class SnapshotWatcher:
    """Engine side of `SnapshotTransport`: applies the newest complete version newer than the one served."""

    def __init__(self, root: str | pathlib.Path | None, receiver: WeightReceiver):
        self.root = pathlib.Path(root) if root is not None else default_snapshot_root()
        self.receiver = receiver
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}  # (device, inode) -> (fd, read-only map)
        weakref.finalize(self, SnapshotWatcher._close_maps, self._maps)

    def latest(self) -> int | None:
        vs = _versions(self.root)
        return vs[-1] if vs else None

    def poll(self) -> int | None:
        """Apply the newest snapshot if it is newer than the served version; returns the version applied or None.

        A refused snapshot raises `BridgeError` (the engine keeps its version)."""
        v = self.latest()
        if v is None or v <= self.receiver.received_version:
            return None
        d = self.root / f"v{v:010d}"
        fd = -1
        try:
            try:
                fd = os.open(d / "tensors.bin", os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # the writer is refilling this file for a newer version
                    raise FileNotFoundError(errno.ENOENT, "recycled", str(d / "tensors.bin")) from None
                st, now = os.fstat(fd), os.stat(d / "tensors.bin")
                if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                    raise FileNotFoundError(errno.ENOENT, "replaced", str(d / "tensors.bin"))
                manifest = Manifest.from_json((d / "manifest.json").read_text())
                if manifest.version != v:
                    raise BridgeError(f"snapshot {d.name} holds manifest v{manifest.version}")
                payload = self._payload(fd, st)
            except FileNotFoundError as e:  # retired or recycled by the writer while we looked: try again later
                raise self.receiver.refuse(f"snapshot v{v} disappeared while reading ({e.filename})") from None
            except BridgeError as e:
                raise self.receiver.refuse(f"snapshot v{v}: {e}") from None
            self.receiver.receive_payload(manifest, payload)
            return v
        finally:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_UN)  # the mapping holds a dup of fd: release the lock explicitly
                os.close(fd)

    def _payload(self, fd: int, st: os.stat_result) -> np.ndarray:
        """The payload file (open as `fd`, locked) as a read-only uint8 array.

        The few files a writer cycles through stay mapped between polls (no page faults on the next read); maps of
        files deleted since, or of a file whose size changed, are dropped.
        """
        for key, (mfd, mm) in list(self._maps.items()):
            if os.fstat(mfd).st_nlink == 0 or (key == (st.st_dev, st.st_ino) and len(mm) != st.st_size):
                del self._maps[key]
                self._unmap(mfd, mm)
        if not st.st_size:
            return np.zeros(0, np.uint8)
        key = (st.st_dev, st.st_ino)
        if key not in self._maps:
            while len(self._maps) >= 4:
                self._unmap(*self._maps.pop(next(iter(self._maps))))
            self._maps[key] = (os.dup(fd), mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        return np.frombuffer(self._maps[key][1], np.uint8)

    @staticmethod
    def _unmap(fd: int, mm: mmap.mmap) -> None:
        _close_map(mm)
        os.close(fd)

    @staticmethod
    def _close_maps(maps: dict) -> None:
        while maps:
            SnapshotWatcher._unmap(*maps.popitem()[1])

    def close(self) -> None:
        """Drop the cached maps (`stop` calls this; so does garbage collection)."""
        self._close_maps(self._maps)

    def start(self, interval: float = 0.05) -> "SnapshotWatcher":
        """Poll in a daemon thread; refusals are logged and kept in `errors`."""

        def loop():
            while not self._stop.wait(interval):
                try:
                    self.poll()
                except BridgeError as e:
                    self.errors.append(str(e))

        self._thread = threading.Thread(target=loop, name="opdjax-snapshot-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.close()


def snapshot_payload(root: str | pathlib.Path, version: int) -> tuple[Manifest, list[np.ndarray]]:
    """(manifest, zero-copy views) of a published snapshot (debugging and tests)."""
    d = pathlib.Path(root) / f"v{int(version):010d}"
    manifest = Manifest.from_json((d / "manifest.json").read_text())
    return manifest, payload_views(manifest, np.memmap(d / "tensors.bin", dtype=np.uint8, mode="r"))

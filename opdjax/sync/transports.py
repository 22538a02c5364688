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
import hashlib
import hmac
import json
import logging
import mmap
import os
import pathlib
import re
import secrets
import shutil
import socket
import struct
import threading
import time
import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from opdjax.sync.manifest import BridgeError, Manifest, crc32, crc32_combine
from opdjax.sync.receiver import WeightReceiver, payload_views

log = logging.getLogger("opdjax.bridge")

__all__ = ["InProcessTransport", "SnapshotTransport", "SnapshotWatcher", "TcpTransport", "TcpReceiverServer",
           "default_snapshot_root"]


def _bytes_view(a: Any) -> memoryview:
    a = np.ascontiguousarray(np.asarray(a))
    return memoryview(a.reshape(-1).view(np.uint8))


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
    import tempfile

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
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


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
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | _POPULATE)
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
        if v is None or v <= self.receiver.version:
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


# ----------------------------------------------------------------------------------------------------- TCP

MAGIC = b"OPDJ"
PROTOCOL = 1
CHUNK = 64 << 20  # the longest chunk a client sends (longer tensors are cut, and their pieces checksummed anew)
SLICE = 1 << 20   # the server receives and checksums in slices of this size
MAX_MANIFEST = 64 << 20
SOCK_BUF = 4 << 20
_CHUNK_HDR = struct.Struct("<QI")


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), what)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, what: str) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise BridgeError(f"truncated transfer: connection closed after {got} of {n} bytes of {what}")
        got += k


def _send_status(sock: socket.socket, **status) -> None:
    blob = json.dumps(status).encode()
    sock.sendall(struct.pack("<I", len(blob)) + blob)


def _recv_status(sock: socket.socket, what: str) -> dict:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4, what))
    return json.loads(_recv_exact(sock, n, what))


def _mac(token: str | bytes, nonce: bytes) -> bytes:
    key = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(key, nonce, hashlib.sha256).digest()


def _host_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose pages are allocated up front (one MAP_POPULATE call, not a page fault per 4 KiB)."""
    if not nbytes or not _POPULATE:
        return np.empty(nbytes, np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE), np.uint8)


def _entry_views(manifest: Manifest, arrays: Iterable[Any]):
    """(entry, flat uint8 view) per manifest entry; BridgeError when the arrays do not match the entries."""
    it = iter(arrays)
    for i, e in enumerate(manifest.entries):
        a = next(it, _END)
        if a is _END:
            raise BridgeError(f"v{manifest.version}: {i} arrays for {len(manifest.entries)} manifest entries")
        view = _bytes_view(a)
        if len(view) != e.nbytes:
            raise BridgeError(f"v{manifest.version}: tensor {e.name!r} has {len(view)} bytes, the manifest says "
                              f"{e.nbytes}")
        yield e, view
    if next(it, _END) is not _END:
        raise BridgeError(f"v{manifest.version}: more arrays than the {len(manifest.entries)} manifest entries")


class TcpTransport:
    """Learner side of the TCP transport: `send` connects, authenticates, streams, and waits for the verdict.

    chunk: the longest chunk sent; a tensor up to this size travels as one chunk carrying the manifest's CRC-32.
    """

    needs_checksums = True

    def __init__(self, host: str, port: int, token: str | bytes, *, timeout: float = 600.0, chunk: int = CHUNK):
        self.host, self.port = host, int(port)
        self.token = token if token is not None else b""
        self.timeout = timeout
        self.chunk = int(chunk)

    def send(self, manifest: Manifest, arrays: Sequence[Any]) -> dict:
        where = f"tcp://{self.host}:{self.port}"
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
                sock.sendall(MAGIC + struct.pack("<I", PROTOCOL))
                nonce = _recv_exact(sock, 32, "the server nonce")
                blob = manifest.to_json().encode()
                sock.sendall(_mac(self.token, nonce) + struct.pack("<Q", len(blob)) + blob)
                status = _recv_status(sock, "the handshake status")
                if not status.get("ok"):
                    raise BridgeError(f"{where} refused v{manifest.version}: {status.get('error')}")
                for e, view in _entry_views(manifest, arrays):
                    if 0 < len(view) <= self.chunk:
                        crc = e.crc32 if e.crc32 is not None else crc32(view)
                        sock.sendall(_CHUNK_HDR.pack(len(view), crc & 0xFFFFFFFF))
                        sock.sendall(view)
                        continue
                    for i in range(0, len(view), self.chunk):
                        part = view[i:i + self.chunk]
                        sock.sendall(_CHUNK_HDR.pack(len(part), crc32(part)))
                        sock.sendall(part)
                sock.sendall(_CHUNK_HDR.pack(0, 0))
                status = _recv_status(sock, "the final status")
        except (OSError, struct.error, json.JSONDecodeError) as e:
            raise BridgeError(f"publish of v{manifest.version} to {where} failed ({type(e).__name__}: {e}); the "
                              f"engine keeps its previous version") from e
        except BridgeError as e:
            if str(e).startswith(where):
                raise
            raise BridgeError(f"publish of v{manifest.version} to {where} failed: {e}") from e
        if not status.get("ok"):
            raise BridgeError(f"{where} refused v{manifest.version}: {status.get('error')}")
        return status


class TcpReceiverServer:
    """Engine side of the TCP transport: one publish at a time, applied through `receiver`.

    token: the shared secret (required; str or bytes). host defaults to 127.0.0.1; port 0 picks a free port
    (`self.port`). Refusals (bad token, bad manifest, truncated/corrupt payload) are logged and kept in
    `self.refusals`.
    """

    def __init__(self, receiver: WeightReceiver, token: str | bytes, *, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 600.0):
        if not token:
            raise ValueError("TcpReceiverServer needs a non-empty shared secret token")
        self.receiver = receiver
        self.token = token
        self.timeout = timeout
        self.refusals: list[str] = []
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)  # before listen: sets the window
            self._sock.bind((host, port))
            self._sock.listen()
        except OSError:
            self._sock.close()
            raise
        self._buf = np.zeros(0, np.uint8)  # the payload buffer, reused while publishes keep their size
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: socket.socket | None = None

    def start(self) -> "TcpReceiverServer":
        self._thread = threading.Thread(target=self._serve, name="opdjax-tcp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; a transfer in flight is cut (the learner sees an error, the engine keeps its version)."""
        self._stop.set()
        conn = self._conn
        for s in (conn, self._sock):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _refuse(self, conn: socket.socket, peer, msg: str) -> None:
        self.refusals.append(msg)
        log.warning("tcp receiver: refused %s: %s", peer, msg)
        try:
            _send_status(conn, ok=False, error=msg, version=self.receiver.version)
        except OSError:
            pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            self._conn = conn
            try:
                with conn:
                    conn.settimeout(self.timeout)
                    self._handle(conn, peer)
            except Exception as e:  # a broken client must not kill the server
                if not self._stop.is_set():
                    log.warning("tcp receiver: connection from %s failed: %s", peer, e)
            finally:
                self._conn = None

    def _handle(self, conn: socket.socket, peer) -> None:
        served = self.receiver.version
        try:
            hello = _recv_exact(conn, 8, "the hello")
        except BridgeError as e:
            self._refuse(conn, peer, str(e))
            return
        if hello[:4] != MAGIC or struct.unpack("<I", hello[4:])[0] != PROTOCOL:
            self._refuse(conn, peer, f"not an opdjax bridge client (hello {hello!r})")
            return
        nonce = secrets.token_bytes(32)
        conn.sendall(nonce)
        try:
            mac = _recv_exact(conn, 32, "the token proof")
            (n,) = struct.unpack("<Q", _recv_exact(conn, 8, "the manifest length"))
            if not hmac.compare_digest(mac, _mac(self.token, nonce)):
                self._refuse(conn, peer, f"wrong or missing token; engine keeps serving v{served}")
                return
            if n > MAX_MANIFEST:
                self._refuse(conn, peer, f"manifest of {n} bytes exceeds {MAX_MANIFEST}")
                return
            manifest = Manifest.from_json(_recv_exact(conn, n, "the manifest"))
            self.receiver.check(manifest)
        except BridgeError as e:
            self._refuse(conn, peer, str(e))
            return
        _send_status(conn, ok=True, version=served)
        t0 = time.perf_counter()
        if self._buf.size != manifest.total_bytes:
            self._buf = np.zeros(0, np.uint8)
            self._buf = _host_buffer(manifest.total_bytes)
        payload = self._buf
        try:
            self._stream(conn, manifest, payload)
        except BridgeError as e:
            msg = f"v{manifest.version}: {e}; engine keeps serving v{self.receiver.version}"
            self.receiver.refusals.append(msg)
            self._refuse(conn, peer, msg)
            return
        t1 = time.perf_counter()
        try:
            self.receiver.receive_payload(manifest, payload, verified=True)
        except BridgeError as e:
            self._refuse(conn, peer, str(e))
            return
        _send_status(conn, ok=True, version=manifest.version, recv_s=t1 - t0, apply_s=time.perf_counter() - t1)

    @staticmethod
    def _stream(conn: socket.socket, manifest: Manifest, payload: np.ndarray) -> None:
        """Receive the chunks into `payload`, checking every chunk's and every tensor's CRC-32 (BridgeError if not).

        Each byte is checksummed once, in slices, as it arrives: a segment (the part of a chunk inside one tensor)
        has a running CRC-32, combined into its chunk's and its tensor's (`crc32_combine`; a plain assignment when
        chunks are tensors, as TcpTransport sends them). Tensors are compared with the manifest once the whole
        payload has arrived and every chunk has checked out.
        """
        view = memoryview(payload)
        entries = manifest.entries
        ends = [e.offset + e.nbytes for e in entries]
        tensor_crc = [0] * len(entries)
        total, got, ti = payload.size, 0, 0
        try:
            while True:
                length, crc = _CHUNK_HDR.unpack(_recv_exact(conn, _CHUNK_HDR.size, "a chunk header"))
                if length == 0:
                    break
                if got + length > total:
                    raise BridgeError(f"payload overruns the manifest's {total} bytes")
                start, end, chunk_crc = got, got + length, 0
                while got < end:
                    while ends[ti] <= got:  # got < total, so some tensor ends after it
                        ti += 1
                    seg_start, seg_end, seg_crc = got, min(end, ends[ti]), 0
                    while got < seg_end:
                        stop = min(seg_end, got + SLICE)
                        part = view[got:stop]
                        _recv_into(conn, part, f"chunk at byte {start}")
                        seg_crc = crc32(part, seg_crc)
                        got = stop
                    chunk_crc = crc32_combine(chunk_crc, seg_crc, seg_end - seg_start)
                    tensor_crc[ti] = crc32_combine(tensor_crc[ti], seg_crc, seg_end - seg_start)
                if chunk_crc != crc:
                    raise BridgeError(f"corrupt chunk at byte {start} (crc32 mismatch)")
        except (OSError, struct.error) as e:
            raise BridgeError(f"truncated transfer: connection lost after {got} of {total} payload bytes "
                              f"({type(e).__name__}: {e})") from None
        if got != total:
            raise BridgeError(f"truncated transfer: {got} of {total} payload bytes arrived")
        for e, c in zip(entries, tensor_crc):
            if e.crc32 is not None and c != e.crc32:
                raise BridgeError(f"checksum mismatch on tensor {e.name!r} (crc32 {c:08x}, manifest "
                                  f"{e.crc32:08x}): corrupt transfer")


def snapshot_payload(root: str | pathlib.Path, version: int) -> tuple[Manifest, list[np.ndarray]]:
    """(manifest, zero-copy views) of a published snapshot (debugging and tests)."""
    d = pathlib.Path(root) / f"v{int(version):010d}"
    manifest = Manifest.from_json((d / "manifest.json").read_text())
    return manifest, payload_views(manifest, np.memmap(d / "tensors.bin", dtype=np.uint8, mode="r"))

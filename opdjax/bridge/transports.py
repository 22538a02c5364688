"""Transports: how a publish (manifest + tensors) reaches a `WeightReceiver`.

InProcessTransport   same Python process. Arrays are handed over as they are (JAX arrays reach torch through
                     DLPack without a copy); no checksums (nothing can corrupt or truncate them).
SnapshotTransport    another process on the same host. Each version is written to `<root>/.tmp-v<version>-...`
                     (manifest.json + tensors.bin, tensors back to back) and then renamed to `<root>/v<version>`
                     (`os.rename` of a complete directory is atomic): a reader sees a complete version or nothing.
                     Put `root` on /dev/shm (the default when it exists) and the snapshot lives in shared memory; the
                     receiver memory-maps tensors.bin (zero-copy) and checks every CRC-32. `SnapshotWatcher.poll()`
                     applies the newest complete version newer than the one served; old versions are pruned.
TCP                  `TcpReceiverServer` (engine side; binds 127.0.0.1 unless told otherwise, requires a shared
                     secret token) and `TcpTransport` (learner side). Protocol, all lengths little-endian:

                       client -> "OPDJ" u32 protocol
                       server -> 32-byte nonce
                       client -> HMAC-SHA256(token, nonce) (32 bytes), u64 n, manifest JSON (n bytes)
                       server -> status  (refused: bad token / manifest rejected -> connection closed)
                       client -> chunks: u64 length, u32 crc32, bytes ... ; a 0-length chunk ends the payload
                       server -> status  (applied, or the refusal: truncated, corrupt chunk/tensor, ...)

                     status = u32 n + JSON {"ok": bool, "error": str?, "version": int}. The token never crosses the
                     wire. A wrong or missing token is refused and logged; a truncated or corrupt payload is
                     refused; either way the engine keeps serving its previous version.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pathlib
import re
import secrets
import shutil
import socket
import struct
import threading
import time
import zlib
from typing import Any, Sequence

import numpy as np

from opdjax.bridge.manifest import BridgeError, Manifest
from opdjax.bridge.receiver import WeightReceiver, payload_views

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


class SnapshotTransport:
    """Writes each publish as an atomically renamed, versioned directory under `root`; keeps the last `keep`."""

    needs_checksums = True

    def __init__(self, root: str | pathlib.Path | None = None, *, keep: int = 2):
        self.root = pathlib.Path(root) if root is not None else default_snapshot_root()
        self.root.mkdir(parents=True, exist_ok=True)
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = int(keep)

    def path(self, version: int) -> pathlib.Path:
        return self.root / f"v{int(version):010d}"

    def send(self, manifest: Manifest, arrays: Sequence[Any]) -> pathlib.Path:
        final = self.path(manifest.version)
        if final.exists():
            raise BridgeError(f"snapshot {final} already exists; versions are published once")
        tmp = self.root / f".tmp-v{manifest.version:010d}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            with open(tmp / "tensors.bin", "wb", buffering=0) as f:
                for a in arrays:
                    f.write(_bytes_view(a))
            (tmp / "manifest.json").write_text(manifest.to_json())
            os.rename(tmp, final)  # atomic: readers see the complete directory or none
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for v in _versions(self.root)[:-self.keep]:
            shutil.rmtree(self.path(v), ignore_errors=True)
        return final


class SnapshotWatcher:
    """Engine side of `SnapshotTransport`: applies the newest complete version newer than the one served."""

    def __init__(self, root: str | pathlib.Path | None, receiver: WeightReceiver):
        self.root = pathlib.Path(root) if root is not None else default_snapshot_root()
        self.receiver = receiver
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

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
        try:
            manifest = Manifest.from_json((d / "manifest.json").read_text())
            if manifest.version != v:
                raise BridgeError(f"snapshot {d.name} holds manifest v{manifest.version}")
            data = d / "tensors.bin"
            size = data.stat().st_size
            payload = np.memmap(data, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        except FileNotFoundError as e:  # pruned by the writer between listing and reading: try again later
            raise self.receiver.refuse(f"snapshot v{v} disappeared while reading ({e.filename})") from None
        except BridgeError as e:
            raise self.receiver.refuse(f"snapshot v{v}: {e}") from None
        self.receiver.receive_payload(manifest, payload)
        return v

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


# ----------------------------------------------------------------------------------------------------- TCP

MAGIC = b"OPDJ"
PROTOCOL = 1
CHUNK = 8 << 20
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


class TcpTransport:
    """Learner side of the TCP transport: `send` connects, authenticates, streams, and waits for the verdict."""

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
                for a in arrays:
                    view = _bytes_view(a)
                    for i in range(0, len(view), self.chunk):
                        part = view[i:i + self.chunk]
                        sock.sendall(_CHUNK_HDR.pack(len(part), zlib.crc32(part) & 0xFFFFFFFF))
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
        self._sock = socket.create_server((host, port))
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
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
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
        payload = np.empty(manifest.total_bytes, np.uint8)
        view = memoryview(payload)
        got = 0
        try:
            while True:
                length, crc = _CHUNK_HDR.unpack(_recv_exact(conn, _CHUNK_HDR.size, "a chunk header"))
                if length == 0:
                    break
                if got + length > payload.size:
                    raise BridgeError(f"payload overruns the manifest's {payload.size} bytes")
                part = view[got:got + length]
                _recv_into(conn, part, f"chunk at byte {got}")
                if zlib.crc32(part) & 0xFFFFFFFF != crc:
                    raise BridgeError(f"corrupt chunk at byte {got} (crc32 mismatch)")
                got += length
            if got != payload.size:
                raise BridgeError(f"truncated transfer: {got} of {payload.size} payload bytes arrived")
        except (BridgeError, OSError, struct.error) as e:
            if not isinstance(e, BridgeError):
                e = BridgeError(f"truncated transfer: connection lost after {got} of {payload.size} payload "
                                f"bytes ({type(e).__name__}: {e})")
            msg = f"v{manifest.version}: {e}; engine keeps serving v{self.receiver.version}"
            self.receiver.refusals.append(msg)
            self._refuse(conn, peer, msg)
            return
        t1 = time.perf_counter()
        try:
            self.receiver.receive_payload(manifest, payload)
        except BridgeError as e:
            self._refuse(conn, peer, str(e))
            return
        _send_status(conn, ok=True, version=manifest.version, recv_s=t1 - t0, apply_s=time.perf_counter() - t1)


def snapshot_payload(root: str | pathlib.Path, version: int) -> tuple[Manifest, list[np.ndarray]]:
    """(manifest, zero-copy views) of a published snapshot (debugging and tests)."""
    d = pathlib.Path(root) / f"v{int(version):010d}"
    manifest = Manifest.from_json((d / "manifest.json").read_text())
    return manifest, payload_views(manifest, np.memmap(d / "tensors.bin", dtype=np.uint8, mode="r"))

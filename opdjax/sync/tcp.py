"""The TCP transport: a publisher streams a manifest and checksummed chunks to a `TcpReceiverServer` in the engine's
process, authenticated by an HMAC challenge over a shared secret; the server validates everything before applying
(see `opdjax.sync.transports` for the protocol overview)."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import mmap
import secrets
import socket
import struct
import threading
import time
from typing import Any, Iterable, Sequence

import numpy as np

from opdjax.sync.manifest import BridgeError, Manifest, crc32, crc32_combine
from opdjax.sync.receiver import WeightReceiver
from opdjax.sync.transports import MAP_POPULATE

log = logging.getLogger("opdjax.bridge")

__all__ = ["TcpReceiverServer", "TcpTransport"]



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


def _drain(sock: socket.socket, limit: int, seconds: float) -> None:
    """Read and discard until the peer closes, `limit` bytes have come, or `seconds` have passed."""
    deadline, buf = time.monotonic() + seconds, bytearray(SLICE)
    while limit > 0:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        sock.settimeout(left)
        k = sock.recv_into(buf, min(len(buf), limit))
        if k == 0:
            return
        limit -= k


def _mac(token: str | bytes, nonce: bytes) -> bytes:
    key = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(key, nonce, hashlib.sha256).digest()


_END = object()  # the end of an iterator, for next(it, _END)


def _bytes_view(a: Any) -> memoryview:
    """A flat byte view of an array (copied only when it is not C-contiguous)."""
    a = np.ascontiguousarray(np.asarray(a))
    return memoryview(a.reshape(-1).view(np.uint8))


def _host_buffer(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose pages are allocated up front (one MAP_POPULATE call, not a page fault per 4 KiB)."""
    if not nbytes or not MAP_POPULATE:
        return np.empty(nbytes, np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_POPULATE), np.uint8)


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
    """Engine side of the TCP transport: publishes applied through `receiver`, one at a time.

    token: the shared secret (required; str or bytes). host defaults to 127.0.0.1; port 0 picks a free port
    (`self.port`). Refusals (bad token, bad manifest, truncated/corrupt payload) are logged and kept in
    `self.refusals`.

    Every connection gets its own thread (at most `max_connections` at once; more are closed at once), and must
    complete the handshake (hello, token proof, manifest) within `handshake_timeout` seconds. Only then does it
    queue for the one transfer slot (the payload buffer). A transfer that stalls — no byte for `idle_timeout`
    seconds — is dropped (the engine keeps its version) and frees the slot, and `timeout` bounds a whole transfer.
    So an idle, slow or half-open socket delays a good publisher by at most `idle_timeout`.
    """

    def __init__(self, receiver: WeightReceiver, token: str | bytes, *, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 600.0, handshake_timeout: float = 5.0, max_connections: int = 256,
                 idle_timeout: float = 30.0):
        if not token:
            raise ValueError("TcpReceiverServer needs a non-empty shared secret token")
        self.receiver = receiver
        self.token = token
        self.timeout = timeout
        self.handshake_timeout = float(handshake_timeout)
        self.idle_timeout = float(min(idle_timeout, timeout))
        self.refusals: list[str] = []
        self._slots = threading.BoundedSemaphore(int(max_connections))
        self._transfer = threading.Lock()  # one payload buffer: one transfer at a time
        self._conns: set[socket.socket] = set()
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

    def start(self) -> "TcpReceiverServer":
        self._thread = threading.Thread(target=self._serve, name="opdjax-tcp-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; a transfer in flight is cut (the learner sees an error, the engine keeps its version)."""
        self._stop.set()
        for s in (*list(self._conns), self._sock):
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

    def _refuse(self, conn: socket.socket, peer, msg: str, *, unread: int = MAX_MANIFEST,
                within: float | None = None) -> None:
        """Log the refusal and tell the client why, then read what it still sends (at most `unread` bytes, for at
        most `within` seconds; the handshake timeout by default) before the connection closes.

        Closing a socket with unread bytes makes the kernel answer with a reset, and a client still sending then
        sees "connection reset" instead of the reason; draining lets it finish sending and read the status.
        """
        self.refusals.append(msg)
        log.warning("tcp receiver: refused %s: %s", peer, msg)
        try:
            _send_status(conn, ok=False, error=msg, version=self.receiver.version)
            conn.shutdown(socket.SHUT_WR)
            _drain(conn, unread, self.handshake_timeout if within is None else within)
        except OSError:
            pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("tcp receiver: refused %s: too many open connections", peer)
                conn.close()
                continue
            self._conns.add(conn)
            threading.Thread(target=self._connection, args=(conn, peer), name="opdjax-tcp-conn", daemon=True).start()

    def _connection(self, conn: socket.socket, peer) -> None:
        try:
            with conn:
                conn.settimeout(self.handshake_timeout)
                try:
                    self._handle(conn, peer)
                except TimeoutError:
                    self._refuse(conn, peer, "the client went silent (handshake or transfer timed out)")
        except Exception as e:  # a broken or silent client must not kill the server
            if not self._stop.is_set():
                log.warning("tcp receiver: connection from %s failed: %s", peer, e)
        finally:
            self._conns.discard(conn)
            self._slots.release()

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
        except Exception as e:  # noqa: BLE001 - a manifest no check anticipated: refused with a status all the same
            self._refuse(conn, peer, f"malformed manifest ({type(e).__name__}: {e}); engine keeps serving v{served}")
            return
        conn.settimeout(self.idle_timeout)  # authenticated: every recv may wait this long, no longer
        with self._transfer:
            self._receive(conn, peer, manifest, served)

    def _receive(self, conn: socket.socket, peer, manifest: Manifest, served: int) -> None:
        _send_status(conn, ok=True, version=served)
        t0 = time.perf_counter()
        if self._buf.size != manifest.total_bytes:
            self._buf = np.zeros(0, np.uint8)
            self._buf = _host_buffer(manifest.total_bytes)
        payload = self._buf
        try:
            self._stream(conn, manifest, payload, deadline=t0 + self.timeout)
        except BridgeError as e:
            msg = f"v{manifest.version}: {e}; engine keeps serving v{self.receiver.version}"
            self.receiver.refusals.append(msg)
            self._refuse(conn, peer, msg, unread=manifest.total_bytes + MAX_MANIFEST,
                         within=min(self.idle_timeout, self.handshake_timeout))
            return
        t1 = time.perf_counter()
        try:
            self.receiver.receive_payload(manifest, payload, verified=True)
        except BridgeError as e:
            self._refuse(conn, peer, str(e))
            return
        _send_status(conn, ok=True, version=manifest.version, recv_s=t1 - t0, apply_s=time.perf_counter() - t1)

    @staticmethod
    def _stream(conn: socket.socket, manifest: Manifest, payload: np.ndarray, deadline: float = float("inf")
                ) -> None:
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
                if time.perf_counter() > deadline:
                    raise BridgeError(f"transfer exceeded its time limit after {got} of {total} payload bytes")
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
        except TimeoutError:
            raise BridgeError(f"stalled transfer: no data for {conn.gettimeout():g}s after {got} of {total} payload "
                              "bytes; dropped") from None
        except (OSError, struct.error) as e:
            raise BridgeError(f"truncated transfer: connection lost after {got} of {total} payload bytes "
                              f"({type(e).__name__}: {e})") from None
        if got != total:
            raise BridgeError(f"truncated transfer: {got} of {total} payload bytes arrived")
        for e, c in zip(entries, tensor_crc):
            if e.crc32 is not None and c != e.crc32:
                raise BridgeError(f"checksum mismatch on tensor {e.name!r} (crc32 {c:08x}, manifest "
                                  f"{e.crc32:08x}): corrupt transfer")

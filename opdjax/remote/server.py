"""An engine server: a rollout engine or a teacher in its own process, behind the `protocol` HTTP API.

    GET  /health              liveness ({"ok": true}); no token needed, returns no model output
    GET  /v1/opdjax/info      role, model spec fingerprint, served version, bridge port, teacher temperature,
                              the run that holds the server
    POST /v1/opdjax/bind      bind the server to a run (`lease`); 409 naming the holder when another run has it
    POST /v1/opdjax/release   free it (the holding session only)
    POST /v1/completions      rollouts (role "rollout") or prompt log-probs (role "teacher"); see `protocol`
    POST /v1/opdjax/poll_snapshot   (with `shm_root`) apply the newest snapshot a same-host learner wrote there

Weights reach a rollout server through the bridge: a `TcpReceiverServer` on `bridge_port` (the same shared secret,
HMAC challenge), which validates a publish completely and applies it all or nothing; the engine tags the new
version and every later response carries it. A server on the learner's host can also take them from shared memory:
with `shm_root` it reads the snapshots a `SnapshotTransport` writes into that directory (its own, configured here;
a client only asks it to look), validated and applied the same way. Every endpoint but /health needs `Authorization: Bearer <token>`
(compared in constant time); a wrong or missing token gets 401 and is logged. The server binds 127.0.0.1 unless
told otherwise. Requests are served one at a time per engine (a lock), publishes concurrently with them.

A server serves one run at a time (`lease.Lease`): once a run has bound it, requests and publishes of any other
session are refused with HTTP 409 (error type `lease_<kind>`), a rollout server samples for a new session only after
that session's first publish, and every rollout choice names the run and session it was sampled for. A client that
never binds is served only while no run holds the server.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import io
import json
import logging
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from opdjax.remote import protocol
from opdjax.remote.lease import DEFAULT_IDLE_TIMEOUT, SESSION_HEADER, Lease, LeaseError
from opdjax.sync import BridgeError, ModelSpec, SnapshotWatcher, TcpReceiverServer

log = logging.getLogger("opdjax.serve")

__all__ = ["EngineServer", "MAX_BODY", "RefusalLog", "spec_fingerprint"]

MAX_BODY = 64 << 20  # bytes of one request body


def spec_fingerprint(spec: ModelSpec) -> str:
    """sha256 of what a publish must fit: family, dtype, every tensor's name and shape."""
    text = json.dumps({"model_type": spec.model_type, "dtype": spec.dtype,
                       "shapes": {k: list(v) for k, v in spec.shapes.items()}}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class DeadlineReader(io.RawIOBase):
    """A connection's reads, each bounded by the idle timeout and by the current request's `deadline` (monotonic
    seconds): a client trickling a byte at a time cannot hold a connection (and a server thread) past
    `ServerLimits.request_timeout`. Writes keep the idle timeout."""

    def __init__(self, sock: socket.socket, idle: float):
        self.sock, self.idle, self.deadline = sock, float(idle), math.inf

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received within the request timeout")
        self.sock.settimeout(min(self.idle, left))
        try:
            return self.sock.recv_into(b)
        finally:
            self.sock.settimeout(self.idle)


class EngineServer:
    """Serve `engine` (role "rollout") or `teacher` (role "teacher"); see the module docstring.

    token: the shared secret (str). port / bridge_port 0: pick free ports (`self.port`, `self.bridge_port`).
    lease_timeout: seconds without a call from the run that holds the server before another run may bind it.
    """

    def __init__(self, *, token: str, engine=None, teacher=None, host: str = "127.0.0.1", port: int = 0,
                 bridge_port: int = 0, model_name: str = "opdjax", publish_timeout: float = 600.0,
                 shm_root: str | None = None, limits: protocol.ServerLimits = protocol.ServerLimits(),
                 lease_timeout: float = DEFAULT_IDLE_TIMEOUT):
        if (engine is None) == (teacher is None):
            raise ValueError("EngineServer serves exactly one of engine= or teacher=")
        if not token:
            raise ValueError("EngineServer needs a non-empty shared secret token")
        self.role = "rollout" if engine is not None else "teacher"
        self.engine, self.teacher, self.token, self.model_name = engine, teacher, token, model_name
        self.limits = limits
        mcfg = (engine if engine is not None else teacher).cfg
        self.vocab_size, self.max_positions = int(mcfg.usable_size), int(mcfg.max_position_embeddings)  # ids it takes
        self.refusal_log = RefusalLog(per_min=limits.refusal_log_per_min)
        self.refusals = self.refusal_log.recent  # the last refusals (bounded); refusal_log.count counts them all
        self._lock = threading.Lock()
        self.lease = Lease(lease_timeout, on_new_session=engine.receiver.restart_order if engine is not None else None)
        self.bridge: TcpReceiverServer | None = None
        if engine is not None:
            engine.receiver.gate = self._gate
            self.bridge = TcpReceiverServer(engine.receiver, token, host=host, port=bridge_port,
                                            timeout=publish_timeout, idle_timeout=limits.transfer_idle_timeout)
        self.shm_root = str(shm_root) if shm_root and engine is not None else None
        self.watcher = SnapshotWatcher(self.shm_root, engine.receiver) if self.shm_root else None
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = limits.idle_timeout  # a silent connection is closed; a trickling one by the request deadline

            def setup(self):
                super().setup()
                self._reader = DeadlineReader(self.connection, limits.idle_timeout)
                self.rfile = io.BufferedReader(self._reader)

            def handle_one_request(self):
                self._reader.deadline = time.monotonic() + limits.request_timeout
                super().handle_one_request()

            def log_message(self, fmt, *args):  # quiet: refusals and errors are logged explicitly
                log.debug("%s " + fmt, self.client_address[0], *args)

            def do_GET(self):  # noqa: N802 (http.server API)
                server._dispatch(self, "GET")

            def do_POST(self):  # noqa: N802
                server._dispatch(self, "POST")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self.bridge_port = self.bridge.port if self.bridge is not None else None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> "EngineServer":
        if self.bridge is not None:
            self.bridge.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="opdjax-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        if self.bridge is not None:
            self.bridge.start()
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.bridge is not None:
            self.bridge.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- requests ------------------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        if self.engine is not None:
            spec = self.engine.receiver.spec
            return {"role": self.role, "model": self.model_name, "model_type": spec.model_type, "dtype": spec.dtype,
                    "spec_sha256": spec_fingerprint(spec), "version": int(self.engine.version),
                    "received_version": int(self.engine.receiver.received_version),
                    "bridge": {"transport": "tcp", "port": self.bridge_port}, "lease": self.lease.info(),
                    **({"shm": {"root": self.shm_root}} if self.shm_root else {})}
        cfg = self.teacher.cfg
        return {"role": self.role, "model": self.model_name, "model_type": cfg.model_type,
                "vocab_size": cfg.vocab_size, "usable_vocab": cfg.usable_size,
                "temperature": float(getattr(self.teacher, "temperature", 1.0)),
                "lease": self.lease.info()}

    def _gate(self, manifest) -> None:
        """The weight receiver's check of a publish: it must come from the session that holds the server."""
        try:
            self.lease.admit(manifest.session)
        except LeaseError as e:
            raise BridgeError(str(e)) from None

    def _admit(self, h: BaseHTTPRequestHandler) -> str | None:
        """The request's session, admitted by the lease (LeaseError otherwise); a rollout server samples for a
        session only after its first publish."""
        session = h.headers.get(SESSION_HEADER)
        self.lease.admit(session)
        if self.engine is not None and self.lease.holder is not None and self.engine.receiver.received_version < 0:
            raise LeaseError("unpublished", "this run has published no weights to this server yet; publish the "
                                            "starting weights before the first rollout")
        return session

    def _authorized(self, h: BaseHTTPRequestHandler) -> bool:
        got = h.headers.get("Authorization", "")
        want = f"Bearer {self.token}"
        return hmac.compare_digest(got.encode(), want.encode())

    def _dispatch(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = h.path.split("?", 1)[0]
        try:
            if method == "GET" and path == "/health":
                return _reply(h, 200, {"ok": True, "role": self.role})
            if not self._authorized(h):
                shown = path if len(path) <= 120 else f"{path[:120]}... ({len(path)} chars)"
                self.refusal_log.add(f"refused {method} {shown!r} from {h.client_address[0]}: missing or wrong token")
                return _reply(h, 401, {"error": {"message": "missing or wrong bearer token", "type": "auth"}})
            if method == "GET" and path == "/v1/opdjax/info":
                return _reply(h, 200, self.info())
            if method == "POST" and path in ("/v1/opdjax/bind", "/v1/opdjax/release"):
                return self._lease_call(h, path)
            if method == "POST" and path == "/v1/opdjax/poll_snapshot" and self.watcher is not None:
                self.lease.admit(h.headers.get(SESSION_HEADER))
                self.watcher.poll()  # a refused snapshot raises BridgeError (a ValueError): 400 with the reason
                return _reply(h, 200, {"received_version": int(self.engine.receiver.received_version)})
            if method == "POST" and path == "/v1/completions":
                body = _read_json(h, self.limits.max_body_bytes)
                with self._lock:
                    session = self._admit(h)
                    out = self._complete(body)
                return _reply(h, 200, _tagged(out, self.lease, session))
            return _reply(h, 404, {"error": {"message": f"no endpoint {method} {path}", "type": "not_found"}})
        except LeaseError as e:  # another run holds the server, or this one lost it: 409, named
            if e.kind in ("held", "lost"):
                self.refusal_log.add(f"refused {method} {path} from {h.client_address[0]}: {e}")
            return _reply(h, 409, {"error": {"message": str(e), "type": f"lease_{e.kind}"}})
        except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:  # bad request content, named
            return _reply(h, 400, {"error": {"message": f"{type(e).__name__}: {str(e)[:500]}",
                                             "type": "invalid_request"}})
        except (TimeoutError, ConnectionError):  # a client that went silent or away mid-request: nothing to answer
            h.close_connection = True
            return None
        except Exception as e:  # noqa: BLE001  the server keeps serving; the client sees a 500 and retries
            log.exception("request %s %s failed", method, path)
            return _reply(h, 500, {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})

    def _lease_call(self, h: BaseHTTPRequestHandler, path: str) -> None:
        body = _read_json(h, 4096)
        if path.endswith("/bind"):
            return _reply(h, 200, {**self.lease.bind(body), "received_version":
                                   None if self.engine is None else int(self.engine.receiver.received_version)})
        return _reply(h, 200, {"released": self.lease.release(body.get("session"))})

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.engine is not None:
            if body.get("prompt_logprobs"):
                raise ValueError("this is a rollout server; prompt_logprobs are served by a teacher server")
            prompts, sp, seed = protocol.sampling_from_request(body, vocab_size=self.vocab_size,
                                                               max_positions=self.max_positions, limits=self.limits)
            return protocol.completion_response(self.engine.generate(prompts, sp, seed=seed), self.model_name)
        rows, k = protocol.score_from_request(body, vocab_size=self.vocab_size, max_positions=self.max_positions,
                                              limits=self.limits)
        T = max(len(r) for r in rows)
        tokens = np.zeros((len(rows), T), np.int32)
        valid = np.zeros((len(rows), T), bool)
        for i, r in enumerate(rows):
            tokens[i, T - len(r):], valid[i, T - len(r):] = r, True  # left-padded, as the engines lay prompts out
        needs = frozenset({"teacher_logp", "teacher_topk"} if k else {"teacher_logp"})
        scores = self.teacher.score(tokens, valid, needs, top_k=k)
        return protocol.score_response(scores, tokens, valid, k, self.model_name)


def _tagged(out: dict[str, Any], lease: Lease, session: str | None) -> dict[str, Any]:
    """The response with the run and session it was computed for on it and on every choice (none when unbound)."""
    h = lease.holder
    if h is None or session is None:
        return out
    tag = {"run": h.run, "session": session}
    return {**out, **tag, "choices": [{**c, **tag} for c in out.get("choices", [])]}


class RefusalLog:
    """Refusals of one server: all counted, the last `keep` kept, at most `per_min` logged a minute (each cut to
    300 characters), the rest summed up in one line — so a flood of bad requests cannot fill memory or the log."""

    def __init__(self, per_min: int = 20, keep: int = 100):
        self.per_min, self.count, self.suppressed = int(per_min), 0, 0
        self.recent: collections.deque[str] = collections.deque(maxlen=keep)
        self._window, self._logged = time.monotonic(), 0
        self._lock = threading.Lock()

    def add(self, msg: str) -> None:
        msg = msg if len(msg) <= 300 else f"{msg[:300]}... ({len(msg)} chars)"
        with self._lock:
            self.count += 1
            self.recent.append(msg)
            now = time.monotonic()
            if now - self._window >= 60.0:
                if self.suppressed:
                    log.warning("%d more refusals in the last minute were not logged", self.suppressed)
                self._window, self._logged, self.suppressed = now, 0, 0
            if self._logged < self.per_min:
                self._logged += 1
                log.warning("%s", msg)
            else:
                self.suppressed += 1


def _read_json(h: BaseHTTPRequestHandler, max_bytes: int = MAX_BODY) -> dict[str, Any]:
    try:
        n = int(h.headers.get("Content-Length") or 0)
    except ValueError:
        raise ValueError("Content-Length must be an integer") from None
    if n <= 0 or n > max_bytes:
        raise ValueError(f"request body of {n} bytes; expected 1..{max_bytes}")
    body = json.loads(h.rfile.read(n))
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


def _reply(h: BaseHTTPRequestHandler, status: int, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    if status >= 400:  # the request body may be unread: do not reuse the connection
        h.send_header("Connection", "close")
        h.close_connection = True
    h.end_headers()
    h.wfile.write(data)

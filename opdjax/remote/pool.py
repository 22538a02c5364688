"""The clients' plumbing: one engine server over HTTP (`Server`: token, session header, error mapping) and the
pool of servers of one role with the shared retry / wait / resynchronise policy (`Pool`), bound to the run
(`lease`). `remote.client` builds the rollout engine and the teacher on it; its module docstring states the fault
and version rules.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from opdjax.core.errors import InputError, UnavailableError
from opdjax.remote.lease import SESSION_HEADER, RunId
from opdjax.sync import BridgeError

log = logging.getLogger("opdjax.remote")

__all__ = ["BoundClient", "CallSettings", "NotFound", "Pool", "Server", "ServerBusy", "ServerDown", "ServerRefused",
           "ServersUnavailable", "error_message", "read_token", "split_rows"]


class ServerRefused(InputError):
    """A server refused a request for a reason retrying cannot fix (token, model, request)."""


class ServerBusy(ServerRefused):
    """A server serves another run (it refused this run's bind, or another run took it over)."""


class ServersUnavailable(UnavailableError):
    """No server answered within the wait bound."""


class ServerDown(Exception):
    """One server failed this request (connection, timeout, 5xx): retry elsewhere."""


class NotFound(ServerRefused):
    """The server has no such endpoint (HTTP 404)."""


@dataclasses.dataclass(frozen=True)
class CallSettings:
    """How a client calls its servers (one value shared by `RemoteEngine` and `RemoteTeacher`).

    timeout   seconds one generate/score request may take (`sync.request_timeout`)
    retries   extra attempts of a failed share before the run waits for a server (`sync.retries`)
    backoff   seconds before the first retry, doubled on each (exponential backoff)
    wait_s    how long to wait, probing /health, when no server answers before `ServersUnavailable` (`sync.wait_s`)
    """

    timeout: float = 120.0
    retries: int = 3
    backoff: float = 0.5
    wait_s: float = 60.0

    def __post_init__(self):
        for name in ("timeout", "backoff", "wait_s"):
            if not float(getattr(self, name)) > 0:
                raise InputError(f"CallSettings.{name} must be > 0, got {getattr(self, name)!r}")
        if int(self.retries) != self.retries or self.retries < 0:
            raise InputError(f"CallSettings.retries must be an integer >= 0, got {self.retries!r}")


def read_token(path: str) -> str:
    """The shared secret from a file (never from the command line); InputError when missing or empty."""
    try:
        token = open(path).read().strip()
    except OSError as e:
        raise InputError(f"token file {path!r}: {e.strerror or e}") from None
    if not token:
        raise InputError(f"token file {path!r} is empty; put the shared secret in it")
    return token


def split_rows(n: int, k: int) -> list[tuple[int, int]]:
    """[start, end) of k contiguous near-equal shares of n rows (empty shares dropped)."""
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


class Server:
    def __init__(self, endpoint: str, token: str, timeout: float, session: str | None = None):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"endpoint {endpoint!r}: expected host:port")
        self.endpoint, self.host, self.port = endpoint, host.strip("[]"), int(port)
        self.url = f"http://{endpoint}"
        self.token, self.timeout, self.session = token, timeout, session
        self.up = False          # reachable and (for rollouts) synchronised
        self.bound = False       # this run bound it (and has not released it)
        self.info: dict[str, Any] = {}
        self.dialect = "opdjax"  # "opdjax": `opdjax serve --engine jax`; "vllm": vLLM's own server + opdjax extension

    def fetch_info(self) -> dict[str, Any]:
        """The server's opdjax info (role, model spec fingerprint, versions, bridge port); detects the dialect."""
        try:
            self.info, self.dialect = self.call("GET", "/v1/opdjax/info"), "opdjax"
        except NotFound:
            try:
                out = self.call("POST", "/collective_rpc", {"method": "opdjax_info"})
            except NotFound:
                raise ServerRefused(f"{self.endpoint} is neither an opdjax server nor vLLM's server with the opdjax "
                                    f"extension (start it with `opdjax serve`, or vllm serve with "
                                    f"VLLM_SERVER_DEV_MODE=1 --worker-extension-cls "
                                    f"opdjax.remote.vllm_server.OpdjaxWorker)") from None
            self.info, self.dialect = out["results"][0], "vllm"
        return self.info

    def call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        if self.session:
            headers[SESSION_HEADER] = self.session
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
                return json.loads(raw) if raw.strip() else {}
        except urllib.error.HTTPError as e:
            msg, kind = error_message(e)
            if e.code == 409 and kind in ("lease_unbound", "lease_unpublished"):  # restarted: bind and resync again
                raise ServerDown(f"{self.endpoint}: {msg}") from None
            if e.code == 409:
                raise ServerBusy(f"server {self.endpoint} serves another run: {msg}") from None
            if e.code == 404:
                raise NotFound(f"server {self.endpoint} has no {method} {path}: {msg}") from None
            if e.code >= 500:
                raise ServerDown(f"{self.endpoint}: HTTP {e.code} {msg}") from None
            raise ServerRefused(f"server {self.endpoint} refused {method} {path}: HTTP {e.code} {msg}") from None
        except (OSError, ValueError) as e:  # URLError, timeouts, resets, a torn JSON body
            raise ServerDown(f"{self.endpoint}: {type(e).__name__}: {getattr(e, 'reason', e)}") from None


def error_message(e: urllib.error.HTTPError) -> tuple[str, str | None]:
    """(message, error type) of an error response."""
    try:
        body = json.loads(e.read())
        if "error" in body:
            return str(body["error"]["message"]), body["error"].get("type")
        return str(body.get("detail", body)), None
    except Exception:  # noqa: BLE001  any unreadable error body
        return e.reason or "", None


class Pool:
    """Servers of one role with the shared retry / wait / resync policy."""

    def __init__(self, role: str, endpoints: Sequence[str], token: str, calls: CallSettings, *,
                 check: Callable[[Server], None], run: RunId, log_fn=None):
        if not endpoints:
            raise InputError(f"{role}.endpoints is empty; give host:port of at least one server")
        self.role, self.calls, self.run = role, calls, run
        self.servers = [Server(e, token, calls.timeout, run.session) for e in endpoints]
        self.check = check
        self.outages: list[dict[str, Any]] = []
        self.log = log_fn or log.info
        self._lock = threading.Lock()

    def mark_down(self, s: Server, why: str) -> None:
        with self._lock:
            if s.up:
                s.up = False
                self.outages.append({"endpoint": s.endpoint, "event": "down", "time": time.time(), "why": why})
                self.log(f"{self.role} server {s.endpoint} is down ({why}); continuing on the others")

    def try_up(self, s: Server) -> bool:
        """Probe a down server; when it answers, check and resynchronise it. True when it is up."""
        try:
            s.call("GET", "/health", timeout=min(s.timeout, 5.0))
            s.fetch_info()
            self.check(s)
        except ServerDown:
            return False
        except BridgeError as e:
            log.warning("%s server %s: resync failed: %s", self.role, s.endpoint, e)
            return False
        with self._lock:
            if not s.up:
                s.up = True
                if any(o["endpoint"] == s.endpoint for o in self.outages):
                    self.outages.append({"endpoint": s.endpoint, "event": "up", "time": time.time()})
                    self.log(f"{self.role} server {s.endpoint} is back (resynchronised)")
        return True

    def bind(self, s: Server) -> None:
        """Bind server `s` to this run (`lease`); ServerBusy naming the run that holds it. Updates the server's
        received version (-1 when this session is new to it)."""
        body = self.run.bind_body()
        if s.dialect == "vllm":
            got = s.call("POST", "/collective_rpc", {"method": "opdjax_bind", "args": [json.dumps(body)]})["results"][0]
            if not got.get("ok"):
                raise ServerBusy(f"{self.role} server {s.endpoint} serves another run: {got.get('error')}")
        else:
            try:
                got = s.call("POST", "/v1/opdjax/bind", body)
            except ServerBusy as e:
                raise ServerBusy(f"{self.role} {e}") from None
        s.bound = True
        if got.get("received_version") is not None:
            s.info["received_version"] = int(got["received_version"])

    def release(self) -> None:
        """Free every server this run bound (best effort: a server that is gone frees itself by its lease timeout)."""
        for s in self.servers:
            if not s.bound:
                continue
            s.bound = False
            try:
                if s.dialect == "vllm":
                    s.call("POST", "/collective_rpc", {"method": "opdjax_release", "args": [self.run.session]},
                           timeout=5.0)
                else:
                    s.call("POST", "/v1/opdjax/release", {"session": self.run.session}, timeout=5.0)
            except (ServerDown, ServerRefused) as e:
                log.info("%s server %s: release failed (%s); its lease expires by itself", self.role, s.endpoint, e)

    def live(self) -> list[Server]:
        """The servers up now; probes the down ones; waits (bounded) while none is up."""
        deadline = time.time() + self.calls.wait_s
        delay = self.calls.backoff
        while True:
            for s in self.servers:
                if not s.up:
                    self.try_up(s)
            up = [s for s in self.servers if s.up]
            if up:
                return up
            if time.time() >= deadline:
                raise ServersUnavailable(f"no {self.role} server answered within {self.calls.wait_s:.0f}s: "
                                         + ", ".join(s.endpoint for s in self.servers))
            time.sleep(min(delay, max(deadline - time.time(), 0.01)))
            delay = min(delay * 2, 5.0)

    def map(self, n: int, fn: Callable[[Server, int, int, int], Any]) -> list[Any]:
        """Split rows [0, n) over the live servers, call fn(server, start, end, share) in parallel, retry failed
        shares on the remaining servers; the results in row order."""
        pending = [(a, b, i) for i, (a, b) in enumerate(split_rows(n, len(self.live())))]
        results: dict[int, Any] = {}
        attempt = 0
        while pending:
            servers = self.live()
            jobs = [(servers[j % len(servers)], a, b, i) for j, (a, b, i) in enumerate(pending)]
            with ThreadPoolExecutor(max_workers=len(jobs)) as ex:
                futs = [(ex.submit(fn, s, a, b, i), s, a, b, i) for s, a, b, i in jobs]
                pending = []
                for f, s, a, b, i in futs:
                    try:
                        results[i] = f.result()
                    except ServerDown as e:
                        self.mark_down(s, str(e))
                        pending.append((a, b, i))
            if pending:
                attempt += 1
                if attempt > self.calls.retries + len(self.servers):
                    raise ServersUnavailable(f"{self.role}: rows {pending} failed {attempt} times")
                time.sleep(self.calls.backoff * 2 ** min(attempt - 1, 5))
        return [results[i] for i in sorted(results)]


class BoundClient:
    """What `RemoteEngine` and `RemoteTeacher` share: a `Pool` of servers of one role, bound to the run (`run`,
    a fresh `RunId` when None) from the first contact until `close` frees them (also as a context manager)."""

    shared = True  # the servers outlive the run: bound to it while it runs, freed by `close`
    pool: Pool

    def _bind_pool(self, role: str, endpoints: Sequence[str], token: str, calls: CallSettings, run: RunId | None,
                   log_fn, then: Callable[[], None] = lambda: None) -> None:
        """Make `self.pool` and wait (bounded) for a live server; `then()` checks more. On any failure the servers
        bound so far are freed before the error propagates."""
        self.run = run or RunId.fresh(f"{socket.gethostname()}:pid{os.getpid()}")
        self.pool = Pool(role, endpoints, token, calls, check=self._check, run=self.run, log_fn=log_fn)
        try:
            self.pool.live()
            then()
        except BaseException:
            self.pool.release()
            raise

    def _check(self, s: Server) -> None:
        raise NotImplementedError

    @property
    def outages(self) -> list[dict[str, Any]]:
        return self.pool.outages

    def close(self, release: bool = True) -> None:
        """The run is over: free the servers for the next run (`release=False`: another process of the run does)."""
        if release:
            self.pool.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The pipeline's side of engine servers: `RemoteEngine` (rollouts, data-parallel over servers) and
`RemoteTeacher` (scores), with the publish link that fans each version out to every rollout server.

Faults. A request that fails (connection refused or reset, a timeout, a 5xx) marks its server down; its share of
the batch is retried, with exponential backoff, on the servers still up. When none is up the client waits,
probing the down servers' /health, for at most `wait_s` seconds, then raises `ServersUnavailable`. A server that
answers again is resynchronised before it serves: its model spec is checked against the learner's (a server that
now serves another model is refused for good) and it receives the newest published weights over the bridge. A
401/400 is not retried (a wrong token or a bad request does not heal). `outages` records every down/up event.

Versions. Every rollout carries the weight version that produced it (the protocol refuses a response without
one). In sync mode a publish returns only when every live server has applied the version, and a rollout whose
version is not the newest published is refused and its server resynchronised, so the loop never trains on a
rollout of unknown or unintended version; in async mode the loop's staleness bound applies as in-process.
"""

from __future__ import annotations

import dataclasses

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from opdjax.core.errors import InputError, UnavailableError
from opdjax.models.config import ModelConfig
from opdjax.remote import protocol
from opdjax.remote.server import spec_fingerprint
from opdjax.rollout.base import RolloutBatch, SamplingParams
from opdjax.sync import BridgeError, Manifest, ModelSpec, SnapshotTransport, TcpTransport
from opdjax.sync.manifest import np_dtype
from opdjax.teacher.base import TeacherScores

log = logging.getLogger("opdjax.remote")

__all__ = ["CallSettings", "RemoteEngine", "RemoteTeacher", "ServerRefused", "ServersUnavailable", "read_token"]


class ServerRefused(InputError):
    """A server refused a request for a reason retrying cannot fix (token, model, request)."""


class ServersUnavailable(UnavailableError):
    """No server answered within the wait bound."""


class _Down(Exception):
    """One server failed this request (connection, timeout, 5xx): retry elsewhere."""


class _NotFound(ServerRefused):
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


def _split(n: int, k: int) -> list[tuple[int, int]]:
    """[start, end) of k contiguous near-equal shares of n rows (empty shares dropped)."""
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


class _Server:
    def __init__(self, endpoint: str, token: str, timeout: float):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"endpoint {endpoint!r}: expected host:port")
        self.endpoint, self.host, self.port = endpoint, host.strip("[]"), int(port)
        self.url = f"http://{endpoint}"
        self.token, self.timeout = token, timeout
        self.up = False          # reachable and (for rollouts) synchronised
        self.info: dict[str, Any] = {}
        self.dialect = "opdjax"  # "opdjax": `opdjax serve --engine jax`; "vllm": vLLM's own server + opdjax extension

    def fetch_info(self) -> dict[str, Any]:
        """The server's opdjax info (role, model spec fingerprint, versions, bridge port); detects the dialect."""
        try:
            self.info, self.dialect = self.call("GET", "/v1/opdjax/info"), "opdjax"
        except _NotFound:
            try:
                out = self.call("POST", "/collective_rpc", {"method": "opdjax_info"})
            except _NotFound:
                raise ServerRefused(f"{self.endpoint} is neither an opdjax server nor vLLM's server with the opdjax "
                                    f"extension (start it with `opdjax serve`, or vllm serve with "
                                    f"VLLM_SERVER_DEV_MODE=1 --worker-extension-cls "
                                    f"opdjax.remote.vllm_server.OpdjaxWorker)") from None
            self.info, self.dialect = out["results"][0], "vllm"
        return self.info

    def call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
                return json.loads(raw) if raw.strip() else {}
        except urllib.error.HTTPError as e:
            msg = _error_message(e)
            if e.code == 404:
                raise _NotFound(f"server {self.endpoint} has no {method} {path}: {msg}") from None
            if e.code >= 500:
                raise _Down(f"{self.endpoint}: HTTP {e.code} {msg}") from None
            raise ServerRefused(f"server {self.endpoint} refused {method} {path}: HTTP {e.code} {msg}") from None
        except (OSError, ValueError) as e:  # URLError, timeouts, resets, a torn JSON body
            raise _Down(f"{self.endpoint}: {type(e).__name__}: {getattr(e, 'reason', e)}") from None


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read())
        return str(body["error"]["message"] if "error" in body else body.get("detail", body))
    except Exception:  # noqa: BLE001  any unreadable error body
        return e.reason or ""


class _Pool:
    """Servers of one role with the shared retry / wait / resync policy."""

    def __init__(self, role: str, endpoints: Sequence[str], token: str, calls: CallSettings, *,
                 check: Callable[[_Server], None], log_fn=None):
        if not endpoints:
            raise InputError(f"{role}.endpoints is empty; give host:port of at least one server")
        self.role, self.calls = role, calls
        self.servers = [_Server(e, token, calls.timeout) for e in endpoints]
        self.check = check
        self.outages: list[dict[str, Any]] = []
        self.log = log_fn or log.info
        self._lock = threading.Lock()

    def mark_down(self, s: _Server, why: str) -> None:
        with self._lock:
            if s.up:
                s.up = False
                self.outages.append({"endpoint": s.endpoint, "event": "down", "time": time.time(), "why": why})
                self.log(f"{self.role} server {s.endpoint} is down ({why}); continuing on the others")

    def try_up(self, s: _Server) -> bool:
        """Probe a down server; when it answers, check and resynchronise it. True when it is up."""
        try:
            s.call("GET", "/health", timeout=min(s.timeout, 5.0))
            s.fetch_info()
            self.check(s)
        except _Down:
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

    def live(self) -> list[_Server]:
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

    def map(self, n: int, fn: Callable[[_Server, int, int, int], Any]) -> list[Any]:
        """Split rows [0, n) over the live servers, call fn(server, start, end, share) in parallel, retry failed
        shares on the remaining servers; the results in row order."""
        pending = [(a, b, i) for i, (a, b) in enumerate(_split(n, len(self.live())))]
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
                    except _Down as e:
                        self.mark_down(s, str(e))
                        pending.append((a, b, i))
            if pending:
                attempt += 1
                if attempt > self.calls.retries + len(self.servers):
                    raise ServersUnavailable(f"{self.role}: rows {pending} failed {attempt} times")
                time.sleep(self.calls.backoff * 2 ** min(attempt - 1, 5))
        return [results[i] for i in sorted(results)]


class _FanOutLink:
    """Publishes each version to every rollout server; keeps the newest one to resync a server that comes back.
    `send` returns once every live server has applied the version.

    kind "tcp": each server's TCP bridge. kind "shm": one shared-memory snapshot in `shm_root` (a
    `SnapshotTransport`), which every server (on this host, started with the same `--shm-root`) then reads."""

    needs_checksums = True

    def __init__(self, engine: "RemoteEngine", timeout: float, kind: str = "tcp", shm_root: str | None = None):
        if kind not in ("tcp", "shm"):
            raise InputError(f"remote servers take weights over 'tcp' or 'shm', not {kind!r}")
        if kind == "shm" and not shm_root:
            raise InputError("sync.transport=shm with servers needs sync.root: the directory the servers read "
                             "(opdjax serve --shm-root DIR)")
        self.engine, self.timeout, self.kind = engine, timeout, kind
        self.shm_root = str(shm_root) if shm_root else None
        self.snapshots = SnapshotTransport(self.shm_root) if kind == "shm" else None
        self.last: tuple[Manifest, list[Any]] | None = None

    def send(self, manifest: Manifest, arrays: Sequence[Any]) -> None:
        self.last = (manifest, [np.asarray(a) for a in arrays])
        if self.snapshots is not None:
            self.snapshots.send(manifest, self.last[1])
        pool = self.engine.pool
        acked = 0
        for s in list(pool.servers):
            if not s.up:
                continue
            try:
                self.push(s, manifest, self.last[1])
                acked += 1
            except (OSError, BridgeError) as e:
                pool.mark_down(s, f"publish v{manifest.version} failed: {e}")
        self.engine.published = manifest.version
        if not acked:  # none took it: wait (bounded) for one to come back; try_up pushes the weights
            pool.live()

    def push(self, s: _Server, manifest: Manifest, arrays: Sequence[Any]) -> None:
        """Give server `s` this version (over its bridge, or from the snapshot already written) and apply it."""
        if self.snapshots is not None:
            self._from_snapshot(s, manifest.version)
        else:
            port = s.info.get("bridge", {}).get("port")
            if not port:
                raise BridgeError(f"server {s.endpoint} has no weight bridge")
            TcpTransport(s.host, int(port), s.token, timeout=self.timeout).send(manifest, arrays)
        if s.dialect == "vllm":  # validated and staged in vLLM's worker: load it between engine steps
            _vllm_apply(s, manifest.version)
        s.info["received_version"] = manifest.version

    def _from_snapshot(self, s: _Server, version: int) -> None:
        root = (s.info.get("shm") or {}).get("root")
        if root != self.shm_root:
            raise ServerRefused(f"server {s.endpoint} reads snapshots from {root!r}, the run writes them to "
                                f"{self.shm_root!r}: start it with --shm-root {self.shm_root} on this host, or "
                                f"use sync.transport=tcp")
        try:
            if s.dialect == "vllm":
                got = s.call("POST", "/collective_rpc", {"method": "opdjax_poll_snapshot"})["results"][0]
                have = got.get("staged") if got.get("staged") is not None else got.get("version")
            else:
                have = s.call("POST", "/v1/opdjax/poll_snapshot", {})["received_version"]
        except ServerRefused as e:  # the snapshot was refused (checksum, shape, ...): the server keeps its version
            raise BridgeError(str(e)) from None
        if int(have) != int(version):
            raise BridgeError(f"server {s.endpoint} found v{have}, not v{version}, in {self.shm_root}: is it on "
                              f"another host? (shm works on one host; use sync.transport=tcp across hosts)")

    def close(self) -> None:
        self.last = None
        if self.snapshots is not None:
            self.snapshots.close()


def _retag(s: _Server) -> None:
    """After a failed apply: tag every later token with the version the server says it serves now (a reload that
    failed part-way leaves it serving its checkpoint, v0), and empty its prefix cache. A server that is gone (it
    restarts itself when it cannot recover) is left to the outage logic."""
    try:
        info = s.call("POST", "/collective_rpc", {"method": "opdjax_info"})["results"][0]
        s.call("POST", "/update_weight_version", {"new_version": str(int(info["version"]))})
        s.call("POST", "/reset_prefix_cache")
    except (_Down, KeyError, IndexError, TypeError, ValueError):
        pass


def _vllm_apply(s: _Server, version: int) -> None:
    """Make vLLM's server serve the staged `version`: requests in flight finish on the old weights, then the
    weights are loaded, every later token is tagged `version`, and the prefix cache is emptied."""
    s.call("POST", "/pause?mode=wait")
    try:
        try:
            s.call("POST", "/collective_rpc", {"method": "opdjax_apply", "args": [str(int(version))]})
        except _Down as e:  # vLLM answers a failed RPC with a 500; it is not a dead server
            _retag(s)
            raise BridgeError(f"{s.endpoint} could not apply v{version}: {e}") from None
        s.call("POST", "/update_weight_version", {"new_version": str(int(version))})
        s.call("POST", "/reset_prefix_cache")
    finally:
        s.call("POST", "/resume")


class RemoteEngine:
    """A RolloutEngine whose rows are sampled by rollout servers (see the module docstring).

    `version` is the newest version published to the servers; `link` is the publish transport the pipeline's
    Publisher sends through. The servers must serve `cfg`'s model (checked by spec fingerprint).
    """

    def __init__(self, endpoints: Sequence[str], token: str, cfg: ModelConfig, *, pad_id: int,
                 calls: CallSettings = CallSettings(), sync: bool = True, publish_timeout: float = 60.0,
                 transport: str = "tcp", shm_root: str | None = None, log_fn=None):
        self.cfg, self.pad_id, self.sync = cfg, int(pad_id), bool(sync)
        self.published: int | None = None
        self.link = _FanOutLink(self, publish_timeout, transport, shm_root)
        self.pool = _Pool("rollout", endpoints, token, calls, check=self._check, log_fn=log_fn)
        self.pool.live()  # at least one server at start
        dtypes = {s.info.get("dtype") for s in self.pool.servers if s.up}
        if len(dtypes) != 1:
            raise ServerRefused(f"rollout servers serve different dtypes {sorted(map(str, dtypes))}")
        self.spec = ModelSpec.from_config(cfg, np_dtype(dtypes.pop()))

    @property
    def version(self) -> int:
        return -1 if self.published is None else int(self.published)

    def mark_published(self, version: int) -> None:
        """Another learner process published `version` to the servers (this one expects it from now on)."""
        self.published = int(version)

    @property
    def outages(self) -> list[dict[str, Any]]:
        return self.pool.outages

    def _check(self, s: _Server) -> None:
        info = s.info
        if info.get("role") != "rollout":
            raise ServerRefused(f"{s.endpoint} is a {info.get('role')!r} server, expected a rollout server")
        want = spec_fingerprint(ModelSpec.from_config(self.cfg, np_dtype(info.get("dtype", "F32"))))
        if info.get("spec_sha256") != want:
            raise ServerRefused(f"rollout server {s.endpoint} serves another model ({info.get('model_type')}, spec "
                                f"{str(info.get('spec_sha256'))[:12]}) than the learner's ({self.cfg.model_type}, "
                                f"{want[:12]}); restart it with the student's checkpoint")
        last = self.link.last
        have = int(info.get("received_version", -1))
        behind = self.published is not None and have < self.published
        if self.sync and self.published is not None and s.dialect != "vllm":  # what it serves must be the version
            behind = behind or int(info.get("version", have)) != self.published  # (weights changed behind the run)
        if behind and last is not None:  # it missed versions (restarted) or serves another: give it the run's newest
            self.link.push(s, dataclasses.replace(last[0], rewind=True), last[1])  # whatever it held before
        elif behind:  # another learner process publishes; wait until it has resynchronised this server
            raise _Down(f"serves v{info.get('received_version')}, the run is at v{self.published}")
        if s.dialect == "vllm":  # a fresh vLLM server tags its tokens "default": give them the served version
            served = str(int(s.info.get("received_version", 0)))
            if str(s.call("GET", "/weight_info").get("weight_version")) != served:
                s.call("POST", "/update_weight_version", {"new_version": served})

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample one completion per prompt, the rows shared over the live servers (share i uses seed + i)."""
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("generate: no prompts")

        def one(s: _Server, a: int, b: int, i: int) -> dict:
            if s.dialect == "vllm":
                resp = _vllm_generate(s, prompts[a:b], sampling, seed + 7919 * i)
            else:
                resp = s.call("POST", "/v1/completions", protocol.completion_request(prompts[a:b], sampling,
                                                                                     seed + 7919 * i))
            vs = {c.get("weight_version") for c in resp.get("choices", [])}
            if self.sync and self.published is not None and vs != {self.published}:
                s.info["received_version"] = -1
                raise _Down(f"answered with weight version(s) {sorted(map(str, vs))}, expected v{self.published}")
            return resp

        resps = self.pool.map(len(prompts), one)
        choices, k = [], 0
        for r in resps:
            for c in sorted(r["choices"], key=lambda c: int(c.get("index", 0))):
                choices.append({**c, "index": k})
                k += 1
        return protocol.rollout_batch(prompts, {"choices": choices}, sampling, self.pad_id)


def _vllm_generate(s: _Server, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                   seed: int) -> dict[str, Any]:
    """Rows sampled by vLLM's token-in-token-out endpoint (one request per row, concurrently), as the completions
    response `protocol.rollout_batch` reads; each row's version: the oldest of its tokens' `weight_versions`."""
    served = s.info.get("eos_token_ids") or ([s.info["eos_token_id"]] if s.info.get("eos_token_id") is not None else [])
    stop = sorted(set(map(int, sampling.stop_token_ids)) | set(map(int, served)))

    def row(j: int) -> dict[str, Any]:
        body = {"token_ids": [int(t) for t in prompts[j]], "output_mode": "tokens",
                "sampling_params": {"max_tokens": int(sampling.max_new_tokens),
                                    "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                                    "top_k": int(sampling.top_k), "seed": (int(seed) * 1_000_003 + j) & 0x7FFFFFFF,
                                    "stop_token_ids": stop, "logprobs": 0, "detokenize": False}}
        c = s.call("POST", "/inference/v1/generate", body)["choices"][0]
        spans = c.get("weight_versions") or []
        try:
            version = min(int(sp["version"]) for sp in spans) if spans else None
        except ValueError:
            raise protocol.ProtocolError(f"{s.endpoint}: row {j} was sampled by weights tagged "
                                         f"{[sp['version'] for sp in spans]}, not an opdjax version") from None
        content = (c.get("logprobs") or {}).get("content") or []
        return {"index": j, "token_ids": c.get("token_ids"), "finish_reason": c.get("finish_reason"),
                "logprobs": {"token_logprobs": [x["logprob"] for x in content]}, "weight_version": version}

    with ThreadPoolExecutor(max_workers=min(len(prompts), 32)) as ex:
        return {"choices": list(ex.map(row, range(len(prompts))))}


class RemoteTeacher:
    """A Teacher whose scores come from teacher servers (rows shared over them); see the module docstring."""

    def __init__(self, endpoints: Sequence[str], token: str, cfg: ModelConfig, *, temperature: float,
                 calls: CallSettings = CallSettings(), log_fn=None):
        self.cfg, self.temperature = cfg, float(temperature)
        self.pool = _Pool("teacher", endpoints, token, calls, check=self._check, log_fn=log_fn)
        self.pool.live()

    @property
    def outages(self) -> list[dict[str, Any]]:
        return self.pool.outages

    def _check(self, s: _Server) -> None:
        info = s.info
        if info.get("role") != "teacher":
            raise ServerRefused(f"{s.endpoint} is a {info.get('role')!r} server, expected a teacher server")
        served = (info.get("model_type"), info.get("vocab_size"), info.get("usable_vocab", info.get("vocab_size")))
        if served != (self.cfg.model_type, self.cfg.vocab_size, self.cfg.usable_size):
            raise ServerRefused(f"teacher server {s.endpoint} serves a {served[0]} with vocab {served[1]} ({served[2]} "
                                f"usable), expected the teacher's {self.cfg.model_type} with vocab "
                                f"{self.cfg.vocab_size} ({self.cfg.usable_size} usable)")
        if abs(float(info.get("temperature", 1.0)) - self.temperature) > 1e-9:
            raise ServerRefused(f"teacher server {s.endpoint} scores at temperature {info.get('temperature')}, the "
                                f"run asks for teacher.temperature={self.temperature}")

    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, needs: frozenset[str] = frozenset({"teacher_logp"}),
              top_k: int = 16) -> TeacherScores:
        if "teacher_logits" in needs:
            raise InputError("a remote teacher returns log-probs and top-k, not full logits; choose a loss that "
                             "needs teacher_logp / teacher_topk, or teacher.engine=jax in-process")
        k = top_k if "teacher_topk" in needs else 0
        tokens_BT, valid_BT = np.asarray(tokens_BT), np.asarray(valid_BT, bool)

        def one(s: _Server, a: int, b: int, i: int) -> TeacherScores:
            resp = s.call("POST", "/v1/completions", protocol.score_request(tokens_BT[a:b], valid_BT[a:b], k))
            return protocol.teacher_scores(tokens_BT[a:b], valid_BT[a:b], resp, k)

        parts = self.pool.map(len(tokens_BT), one)
        cat = lambda f: None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts])  # noqa: E731
        return TeacherScores(teacher_logp_BT=cat("teacher_logp_BT"), teacher_topk_ids_BTK=cat("teacher_topk_ids_BTK"),
                             teacher_topk_logp_BTK=cat("teacher_topk_logp_BTK"))

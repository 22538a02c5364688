"""The pipeline's side of engine servers: `RemoteEngine` (rollouts, data-parallel over servers) and
`RemoteTeacher` (scores), with the publish link that fans each version out to every rollout server.

Faults. A request that fails (connection refused or reset, a timeout, a 5xx) marks its server down; its share of
the batch is retried, with exponential backoff, on the servers still up. When none is up the client waits,
probing the down servers' /health, for at most `wait_s` seconds, then raises `ServersUnavailable`. A server that
answers again is resynchronised before it serves: its model spec is checked against the learner's (a server that
now serves another model is refused for good) and it receives the newest published weights over the bridge. A
401/400 is not retried (a wrong token or a bad request does not heal). `outages` records every down/up event.

Runs. A server serves one run at a time (`lease`): every client binds each server on first contact (and again
after the server restarts) with the run's `RunId`, sends the run's session with every request and publish, and
releases the servers when the run ends (`close`). A server another run holds refuses the bind in one line
(`ServerBusy`); a server taken over from this run fails its next call loudly (`ServerBusy`), never silently. A
`RemoteEngine` samples nothing before this run has published its weights to the servers: the pipeline publishes
the starting weights (or the resumed checkpoint's) first, and every rollout must carry this run's session.

Versions. Every rollout carries the weight version that produced it (the protocol refuses a response without
one). In sync mode a publish returns only when every live server has applied the version, and a rollout whose
version is not the newest published is refused and its server resynchronised, so the loop never trains on a
rollout of unknown or unintended version; in async mode the loop's staleness bound applies as in-process.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from opdjax.core.errors import InputError
from opdjax.models.config import ModelConfig
from opdjax.remote import protocol
from opdjax.remote.lease import RunId
from opdjax.remote.pool import (BoundClient, CallSettings, Server, ServerBusy, ServerDown, ServerRefused,
                                ServersUnavailable, read_token)
from opdjax.remote.server import spec_fingerprint
from opdjax.rollout.base import RolloutBatch, SamplingParams
from opdjax.sync import BridgeError, Manifest, ModelSpec, SnapshotTransport, TcpTransport
from opdjax.sync.manifest import np_dtype
from opdjax.teacher.base import TeacherScores

log = logging.getLogger("opdjax.remote")

__all__ = ["CallSettings", "RemoteEngine", "RemoteTeacher", "ServerBusy", "ServerRefused", "ServersUnavailable",
           "read_token"]


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
        manifest = dataclasses.replace(manifest, session=self.engine.run.session)  # the servers take only this run's
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

    def push(self, s: Server, manifest: Manifest, arrays: Sequence[Any]) -> None:
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

    def _from_snapshot(self, s: Server, version: int) -> None:
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


def _retag(s: Server) -> None:
    """After a failed apply: tag every later token with the version the server says it serves now (a reload that
    failed part-way leaves it serving its checkpoint, v0), and empty its prefix cache. A server that is gone (it
    restarts itself when it cannot recover) is left to the outage logic."""
    try:
        info = s.call("POST", "/collective_rpc", {"method": "opdjax_info"})["results"][0]
        s.call("POST", "/update_weight_version", {"new_version": _vllm_tag(int(info["version"]), s.session)})
        s.call("POST", "/reset_prefix_cache")
    except (ServerDown, KeyError, IndexError, TypeError, ValueError):
        pass


def _vllm_tag(version: int, session: str | None) -> str:
    """The tag vLLM puts on every token it samples after an apply: "<version>@<session>"."""
    return f"{int(version)}@{session or ''}"


def _vllm_version(tag: Any, endpoint: str, row: int) -> tuple[int, str]:
    """(version, session) of a vLLM weight tag; ProtocolError for a tag no opdjax run set (e.g. vLLM's "default")."""
    version, at, session = str(tag).partition("@")
    if not at or not version.lstrip("-").isdigit():
        raise protocol.ProtocolError(f"{endpoint}: row {row} was sampled by weights tagged {str(tag)[:40]!r}, not "
                                     f"an opdjax run's version (publish this run's weights first)")
    return int(version), session


def _vllm_apply(s: Server, version: int) -> None:
    """Make vLLM's server serve the staged `version`: requests in flight finish on the old weights, then the
    weights are loaded, every later token is tagged `version`, and the prefix cache is emptied."""
    s.call("POST", "/pause?mode=wait")
    try:
        try:
            s.call("POST", "/collective_rpc", {"method": "opdjax_apply", "args": [str(int(version))]})
        except ServerDown as e:  # vLLM answers a failed RPC with a 500; it is not a dead server
            _retag(s)
            raise BridgeError(f"{s.endpoint} could not apply v{version}: {e}") from None
        s.call("POST", "/update_weight_version", {"new_version": _vllm_tag(version, s.session)})
        s.call("POST", "/reset_prefix_cache")
    finally:
        s.call("POST", "/resume")


class RemoteEngine(BoundClient):
    """A RolloutEngine whose rows are sampled by rollout servers (see the module docstring).

    `version` is the newest version published to the servers; `link` is the publish transport the pipeline's
    Publisher sends through. The servers must serve `cfg`'s model (checked by spec fingerprint).
    """

    # shared (BoundClient): the servers outlive the run and may hold other weights: a run publishes its own first

    def __init__(self, endpoints: Sequence[str], token: str, cfg: ModelConfig, *, pad_id: int,
                 calls: CallSettings = CallSettings(), sync: bool = True, publish_timeout: float = 60.0,
                 transport: str = "tcp", shm_root: str | None = None, run: RunId | None = None, log_fn=None):
        self.cfg, self.pad_id, self.sync = cfg, int(pad_id), bool(sync)
        self.published: int | None = None
        self.link = _FanOutLink(self, publish_timeout, transport, shm_root)
        self._bind_pool("rollout", endpoints, token, calls, run, log_fn, then=self._one_dtype)

    def _one_dtype(self) -> None:
        """The live servers' one dtype sets the spec publishes are checked against (ServerRefused for several)."""
        dtypes = {s.info.get("dtype") for s in self.pool.servers if s.up}
        if len(dtypes) != 1:
            raise ServerRefused(f"rollout servers serve different dtypes {sorted(map(str, dtypes))}")
        self.spec = ModelSpec.from_config(self.cfg, np_dtype(dtypes.pop()))

    @property
    def version(self) -> int:
        return -1 if self.published is None else int(self.published)

    def mark_published(self, version: int) -> None:
        """Another learner process published `version` to the servers (this one expects it from now on)."""
        self.published = int(version)

    def _check(self, s: Server) -> None:
        info = s.info
        if info.get("role") != "rollout":
            raise ServerRefused(f"{s.endpoint} is a {info.get('role')!r} server, expected a rollout server")
        want = spec_fingerprint(ModelSpec.from_config(self.cfg, np_dtype(info.get("dtype", "F32"))))
        if info.get("spec_sha256") != want:
            raise ServerRefused(f"rollout server {s.endpoint} serves another model ({info.get('model_type')}, spec "
                                f"{str(info.get('spec_sha256'))[:12]}) than the learner's ({self.cfg.model_type}, "
                                f"{want[:12]}); restart it with the student's checkpoint")
        self.pool.bind(s)
        last = self.link.last
        have = int(info.get("received_version", -1))  # -1: this session is new to the server (it restarted)
        behind = self.published is not None and have < self.published
        if self.sync and self.published is not None and s.dialect != "vllm":  # what it serves must be the version
            behind = behind or int(info.get("version", have)) != self.published  # (weights changed behind the run)
        served = max(have, int(info.get("version", have)))
        if last is not None and served > self.published:
            raise ServerRefused(f"rollout server {s.endpoint} serves v{served}, newer than this run's newest "
                                f"v{self.published}: its weights were changed by something other than this run; "
                                f"restart it (this run never rewinds a server)")
        if behind and last is not None:  # it missed versions (restarted): give it the run's newest
            self.link.push(s, last[0], last[1])
        elif behind:  # another learner process publishes; wait until it has resynchronised this server
            raise ServerDown(f"serves v{info.get('received_version')}, the run is at v{self.published}")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample one completion per prompt, the rows shared over the live servers (share i uses seed + i)."""
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts:
            raise ValueError("generate: no prompts")
        if self.published is None:
            raise InputError("RemoteEngine.generate before this run published its weights: the servers may hold "
                             "another run's; publish the starting weights first")

        def one(s: Server, a: int, b: int, i: int) -> dict:
            if s.dialect == "vllm":
                resp = _vllm_generate(s, prompts[a:b], sampling, seed + 7919 * i)
            else:
                resp = s.call("POST", "/v1/completions", protocol.completion_request(prompts[a:b], sampling,
                                                                                     seed + 7919 * i))
            _check_session(s, resp, self.run.session)
            vs = {c.get("weight_version") for c in resp.get("choices", [])}
            if self.sync and self.published is not None and vs != {self.published}:
                s.info["received_version"] = -1
                raise ServerDown(f"answered with weight version(s) {sorted(map(str, vs))}, expected v{self.published}")
            return resp

        resps = self.pool.map(len(prompts), one)
        choices, k = [], 0
        for r in resps:
            for c in sorted(r["choices"], key=lambda c: int(c.get("index", 0))):
                choices.append({**c, "index": k})
                k += 1
        return protocol.rollout_batch(prompts, {"choices": choices}, sampling, self.pad_id)


def _check_session(s: Server, resp: dict[str, Any], session: str) -> None:
    """Every choice must have been sampled for this run's session (ServerBusy otherwise: another run's weights)."""
    got = [c.get("session") for c in resp.get("choices", [])]
    if any(g != session for g in got):
        other = sorted({str(g) for g in got if g != session})
        raise ServerBusy(f"rollout server {s.endpoint} answered for session(s) {other}, not this run's {session}: "
                         f"another run holds it; this run stops before it trains on that rollout")


def _vllm_generate(s: Server, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
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
        tags = [_vllm_version(sp["version"], s.endpoint, j) for sp in c.get("weight_versions") or []]
        sessions = {t[1] for t in tags}
        content = (c.get("logprobs") or {}).get("content") or []
        return {"index": j, "token_ids": c.get("token_ids"), "finish_reason": c.get("finish_reason"),
                "logprobs": {"token_logprobs": [x["logprob"] for x in content]},
                "weight_version": min(t[0] for t in tags) if tags else None,
                "session": sessions.pop() if len(sessions) == 1 else sorted(sessions)}

    with ThreadPoolExecutor(max_workers=min(len(prompts), 32)) as ex:
        return {"choices": list(ex.map(row, range(len(prompts))))}


class RemoteTeacher(BoundClient):
    """A Teacher whose scores come from teacher servers (rows shared over them); see the module docstring."""

    def __init__(self, endpoints: Sequence[str], token: str, cfg: ModelConfig, *, temperature: float,
                 calls: CallSettings = CallSettings(), run: RunId | None = None, log_fn=None):
        self.cfg, self.temperature = cfg, float(temperature)
        self._bind_pool("teacher", endpoints, token, calls, run, log_fn)

    def _check(self, s: Server) -> None:
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
        self.pool.bind(s)

    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, needs: frozenset[str] = frozenset({"teacher_logp"}),
              top_k: int = 16) -> TeacherScores:
        if "teacher_logits" in needs:
            raise InputError("a remote teacher returns log-probs and top-k, not full logits; choose a loss that "
                             "needs teacher_logp / teacher_topk, or teacher.engine=jax in-process")
        k = top_k if "teacher_topk" in needs else 0
        tokens_BT, valid_BT = np.asarray(tokens_BT), np.asarray(valid_BT, bool)

        def one(s: Server, a: int, b: int, i: int) -> TeacherScores:
            resp = s.call("POST", "/v1/completions", protocol.score_request(tokens_BT[a:b], valid_BT[a:b], k))
            return protocol.teacher_scores(tokens_BT[a:b], valid_BT[a:b], resp, k)

        parts = self.pool.map(len(tokens_BT), one)
        cat = lambda f: None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts])  # noqa: E731
        return TeacherScores(teacher_logp_BT=cat("teacher_logp_BT"), teacher_topk_ids_BTK=cat("teacher_topk_ids_BTK"),
                             teacher_topk_logp_BTK=cat("teacher_topk_logp_BTK"))

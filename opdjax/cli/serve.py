"""`opdjax serve`: a rollout engine or a teacher as its own process, for `rollout.endpoints` / `teacher.endpoints`.

    opdjax serve --role rollout --token-file secret --port 8300 student=DIR rollout.recipe=fp8_w8a8
    opdjax serve --role teacher --token-file secret --port 8400 teacher=DIR
    opdjax serve --role rollout --engine vllm --token-file secret --port 8000 student=DIR [--print-command]

The same TrainConfig keys as `train` choose the model and the engine's knobs (rollout.engine jax|vllm, recipe,
weight noise, staleness, dtype, rollout.vllm; teacher.engine, dtype, temperature). Binds 127.0.0.1 unless --host
says otherwise. `--engine jax`: opdjax's own server (`opdjax.remote.server`) around the embedded engine or teacher.
`--engine vllm`: vLLM's own OpenAI-compatible server with opdjax's extension (`opdjax.remote.vllm_server`), started
as a child process whose logs go to stderr; `--print-command` prints that command instead (to run `vllm serve`
yourself). When ready it prints one JSON line {"event": "ready", "role", "url", "port", "bridge_port", "version"}.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from opdjax import config, quant
from opdjax.cli.common import KEYS_HINT, guard
from opdjax.core.errors import InputError
from opdjax.models import ModelConfig, hf
from opdjax.models.sharding import make_mesh
from opdjax.models.tiny import load_tokenizer
from opdjax.pipeline.components import make_engine, make_teacher
from opdjax.pipeline.inputs import resolve_models
from opdjax.remote.client import read_token
from opdjax.remote.protocol import ServerLimits
from opdjax.remote.lease import DEFAULT_IDLE_TIMEOUT
from opdjax.remote.server import EngineServer
from opdjax.remote.vllm_server import shell_line, vllm_command
from opdjax.rollout.vllm_engine import DEFAULT_KV_CACHE_BYTES, llm_kwargs
from opdjax.rollout.vllm_settings import engine_dtype, served_activations

__all__ = ["add_serve_command"]


def _serve(args) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # vLLM logs to stdout by default
    if args.engine is not None:
        section = "rollout" if args.role == "rollout" else "teacher"
        args.overrides = [f"{section}.engine={args.engine}", *args.overrides]
    # rollout.endpoints / teacher.endpoints are where the learner finds the servers: a server ignores them, so one
    # config file serves every command of a run
    cfg = config.load(config.TrainConfig, args.config,
                      [*args.overrides, "rollout.endpoints=[]", "teacher.endpoints=[]"])
    token = "" if args.print_command else read_token(args.token_file)  # a printed command runs elsewhere: its
    for what, port in (("--port", args.port), ("--bridge-port", args.bridge_port)):  # token file and ports there
        if not args.print_command:
            _check_port_free(args.host, port, what)  # before minutes of model loading, not after
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731  stdout carries the ready line only
    student_path, teacher_path = resolve_models(cfg, log)
    if (cfg.rollout.engine if args.role == "rollout" else cfg.teacher.engine) == "vllm":
        return _serve_vllm(args, cfg, student_path if args.role == "rollout" else teacher_path, token)
    if args.print_command:
        raise config.ConfigError("--print-command prints the vLLM server command; add --engine vllm")
    if args.role == "rollout":
        tok = load_tokenizer(student_path)
        mcfg = ModelConfig.from_dir(student_path).with_tokenizer(tok)
        _, params = hf.load_state(student_path, mcfg, param_dtype=cfg.student.dtype)
        server = EngineServer(engine=make_engine(cfg, student_path, mcfg, params, tok), token=token, host=args.host,
                              port=args.port, bridge_port=args.bridge_port, model_name=student_path,
                              shm_root=args.shm_root, limits=_limits(args), lease_timeout=args.lease_timeout)
    else:
        teacher = make_teacher(dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, endpoints=())),
                               teacher_path, make_mesh(cfg.mesh.shape))
        server = EngineServer(teacher=teacher, token=token, host=args.host, port=args.port, model_name=teacher_path,
                              limits=_limits(args), lease_timeout=args.lease_timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(json.dumps({"event": "ready", "role": args.role, "url": f"http://{server.host}:{server.port}",
                      "port": server.port, "bridge_port": server.bridge_port,
                      "version": server.info().get("version")}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
        if server.bridge is not None:
            server.bridge.stop()
    return 0


def _check_port_free(host: str, port: int, what: str) -> None:
    """InputError naming the flag when `port` (nonzero) cannot be bound on `host` (in use, or not allowed)."""
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise InputError(f"{what} {port}: cannot listen on {host}:{port} ({e.strerror}); pick a free port or 0 "
                             "(a free one, printed when ready)") from None


def _limits(args) -> ServerLimits:
    """The server limits `opdjax serve` flags set (defaults: `ServerLimits`)."""
    return ServerLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_batch=args.max_batch,
                        max_tokens=args.max_tokens, max_top_k=args.max_top_k, idle_timeout=args.idle_timeout,
                        request_timeout=args.request_timeout, transfer_idle_timeout=args.transfer_idle_timeout,
                        refusal_log_per_min=args.refusal_log_per_min)


def _vllm_settings(cfg: config.TrainConfig, role: str, path: str, *, check_hardware: bool = True) -> dict:
    """vllm.LLM keywords of the served model: the rollout engine's (recipe translated) or the teacher's.
    check_hardware=False (--print-command) prepares the command for another machine without asking this one."""
    mcfg = ModelConfig.from_dir(path)
    if role == "teacher":
        return {"dtype": engine_dtype(cfg.teacher.dtype, quant.as_recipe(None), where="teacher.dtype"),
                "kv_cache_memory_bytes": DEFAULT_KV_CACHE_BYTES,
                "max_model_len": min(mcfg.max_position_embeddings, 2048)}
    r = cfg.rollout
    named = set(inspect.signature(llm_kwargs).parameters)
    kw = llm_kwargs(path, mcfg, dtype=r.dtype, seed=r.seed, recipe=None if r.recipe == "none" else r.recipe,
                    fp8_emulation=r.fp8_emulation, check_hardware=check_hardware,
                    **{k: v for k, v in r.vllm.items() if k in named})
    kw.update({k: v for k, v in r.vllm.items() if k not in named})
    return kw


def _emulation(cfg: config.TrainConfig, role: str) -> str | None:
    """The activation scheme of the FP8 CPU emulation the served engine needs (None: no emulation)."""
    r = cfg.rollout
    if role != "rollout" or not r.fp8_emulation:
        return None
    return served_activations(quant.as_recipe(r.recipe))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_ready(proc, url: str, token: str, timeout: float) -> dict:
    """The extension's opdjax_info once vLLM's server answers; RuntimeError when it exits or times out first."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        try:
            req = urllib.request.Request(url + "/collective_rpc", data=json.dumps({"method": "opdjax_info"}).encode(),
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())["results"][0]
        except (OSError, ValueError):
            time.sleep(1.0)
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)
        raise RuntimeError(f"vLLM's server did not answer within --start-timeout={timeout:.0f}s")
    raise RuntimeError(f"vLLM's server exited with {proc.returncode} before it was ready (its log: above)")


def _serve_vllm(args, cfg: config.TrainConfig, path: str, token: str) -> int:
    """vLLM's own server with opdjax's extension as a child process; the ready line once it answers.

    A child that asks to be restarted (a weight reload that failed part-way and whose in-place recovery from the
    checkpoint failed too: the extension writes the reason to OPDJAX_RESTART_FILE and exits) is started again from
    its checkpoint, serving version 0, with a {"event": "restarted", "reason"} line; clients then publish the newest
    weights to it again.
    """
    port = args.port or _free_port(args.host)
    argv, env = vllm_command(path, role=args.role, token_file=os.path.abspath(args.token_file), host=args.host,
                             port=port, bridge_port=args.bridge_port, shm_root=args.shm_root,
                             llm_kwargs=_vllm_settings(cfg, args.role, path, check_hardware=not args.print_command),
                             fp8_emulation=_emulation(cfg, args.role),
                             lease_timeout=getattr(args, "lease_timeout", DEFAULT_IDLE_TIMEOUT))
    env["OPDJAX_BRIDGE_IDLE_TIMEOUT"] = str(getattr(args, "transfer_idle_timeout", ServerLimits.transfer_idle_timeout))
    if args.print_command:
        print(shell_line(argv, env))
        return 0
    restart_file = pathlib.Path(tempfile.mkdtemp(prefix="opdjax-serve-")) / "restart"
    env["OPDJAX_RESTART_FILE"] = str(restart_file)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{port}"
    event = {"event": "ready"}
    while True:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=sys.stderr)  # stdout: the ready line only
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda n, f, p=proc: p.send_signal(n))
        info = _wait_ready(proc, url, token, args.start_timeout)
        print(json.dumps({**event, "role": args.role, "engine": "vllm", "url": f"http://{args.host}:{port}",
                          "port": port, "bridge_port": (info.get("bridge") or {}).get("port"),
                          "version": info.get("received_version")}), flush=True)
        rc = proc.wait()
        if not restart_file.exists():
            return 0 if rc in (0, -signal.SIGTERM, -signal.SIGINT) else (rc if rc > 0 else 1)
        event = {"event": "restarted", "reason": restart_file.read_text()[:500]}
        restart_file.unlink()
        print(f"opdjax serve: restarting vLLM's server from its checkpoint: {event['reason']}", file=sys.stderr,
              flush=True)


def add_serve_command(subparsers) -> None:
    sp = subparsers.add_parser("serve", help="serve a rollout engine or a teacher for remote runs")
    sp.add_argument("--role", choices=("rollout", "teacher"), required=True)
    sp.add_argument("--engine", choices=("jax", "vllm"), default=None,
                    help="shortcut for rollout.engine= / teacher.engine= (default: the config's)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sp.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one, printed when ready)")
    sp.add_argument("--bridge-port", type=int, default=0, help="weight bridge TCP port (rollout role; 0: free)")
    sp.add_argument("--shm-root", default=None,
                    help="rollout role on the learner's host: also take weights from the shared-memory snapshots a "
                         "run with sync.transport=shm sync.root=DIR writes into DIR")
    sp.add_argument("--token-file", required=True, help="file holding the shared secret (never on the command line)")
    sp.add_argument("--config", default=None, help="YAML config (the same keys as train)")
    sp.add_argument("--print-command", action="store_true",
                    help="--engine vllm: print the `vllm serve` command (and its environment) and exit")
    sp.add_argument("--start-timeout", type=float, default=900.0,
                    help="--engine vllm: seconds to wait for vLLM's server to answer (default 900)")
    lim = ServerLimits()
    sp.add_argument("--max-batch", type=int, default=lim.max_batch, help="prompts or sequences per request")
    sp.add_argument("--max-tokens", type=int, default=lim.max_tokens, help="max_tokens of one request")
    sp.add_argument("--max-top-k", type=int, default=lim.max_top_k, help="top_k / prompt_logprobs of one request")
    sp.add_argument("--max-body-mb", type=float, default=lim.max_body_bytes / (1 << 20), help="request body size")
    sp.add_argument("--idle-timeout", type=float, default=lim.idle_timeout,
                    help="seconds an HTTP connection may be silent before it is closed")
    sp.add_argument("--request-timeout", type=float, default=lim.request_timeout,
                    help="seconds a client may take to send one whole request (slow-loris bound)")
    sp.add_argument("--transfer-idle-timeout", type=float, default=lim.transfer_idle_timeout,
                    help="seconds a weight transfer over the bridge may stall before it is dropped")
    sp.add_argument("--lease-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT,
                    help="seconds without a call from the run that holds the server before another run may bind it "
                         f"(default {DEFAULT_IDLE_TIMEOUT:.0f}; a run frees it when it ends)")
    sp.add_argument("--refusal-log-per-min", type=int, default=lim.refusal_log_per_min,
                    help="refused requests logged per minute (all are counted)")
    sp.add_argument("overrides", nargs="*",
                    help=f"key=value overrides, e.g. student=DIR rollout.recipe=fp8_w8a8 {KEYS_HINT}")
    sp.set_defaults(func=guard(_serve))

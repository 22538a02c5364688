"""`opdjax serve`: a rollout engine or a teacher as its own process, for `rollout.endpoints` / `teacher.endpoints`.

    opdjax serve --role rollout --token-file secret student=DIR rollout.recipe=fp8_w8a8 --port 8300
    opdjax serve --role teacher --token-file secret teacher=DIR --port 8400

The same TrainConfig keys as `train` choose the model and the engine's knobs (rollout.engine jax|vllm, recipe,
weight noise, staleness, dtype; teacher.engine, dtype, temperature). Binds 127.0.0.1 unless --host says otherwise.
When ready it prints one JSON line {"event": "ready", "role", "url", "port", "bridge_port", "version"}.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys

from opdjax import config
from opdjax.cli.common import guard
from opdjax.models import ModelConfig, hf
from opdjax.models.sharding import make_mesh
from opdjax.models.tiny import load_tokenizer
from opdjax.pipeline.build import make_engine, make_teacher, resolve_models
from opdjax.remote.client import read_token
from opdjax.remote.server import EngineServer

__all__ = ["add_serve_command"]


def _serve(args) -> int:
    if args.engine is not None:
        section = "rollout" if args.role == "rollout" else "teacher"
        args.overrides = [f"{section}.engine={args.engine}", *args.overrides]
    cfg = config.load(config.TrainConfig, args.config, args.overrides)
    if cfg.rollout.endpoints or cfg.teacher.endpoints:
        raise config.ConfigError("a server runs its engine itself: drop rollout.endpoints / teacher.endpoints")
    token = read_token(args.token_file)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731  stdout carries the ready line only
    student_path, teacher_path = resolve_models(cfg, log)
    if args.role == "rollout":
        mcfg = ModelConfig.from_dir(student_path)
        tok = load_tokenizer(student_path)
        _, params = hf.load_state(student_path, mcfg, param_dtype=cfg.student.dtype)
        server = EngineServer(engine=make_engine(cfg, student_path, mcfg, params, tok), token=token, host=args.host,
                              port=args.port, bridge_port=args.bridge_port, model_name=student_path)
    else:
        teacher = make_teacher(dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, endpoints=())),
                               teacher_path, make_mesh(cfg.mesh.shape))
        server = EngineServer(teacher=teacher, token=token, host=args.host, port=args.port, model_name=teacher_path)
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


def add_serve_command(subparsers) -> None:
    sp = subparsers.add_parser("serve", help="serve a rollout engine or a teacher for remote runs")
    sp.add_argument("--role", choices=("rollout", "teacher"), required=True)
    sp.add_argument("--engine", choices=("jax", "vllm"), default=None,
                    help="shortcut for rollout.engine= / teacher.engine= (default: the config's)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sp.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one, printed when ready)")
    sp.add_argument("--bridge-port", type=int, default=0, help="weight bridge TCP port (rollout role; 0: free)")
    sp.add_argument("--token-file", required=True, help="file holding the shared secret (never on the command line)")
    sp.add_argument("--config", default=None, help="YAML config (the same keys as train)")
    sp.add_argument("overrides", nargs="*", help="key=value overrides, e.g. student=DIR rollout.recipe=fp8_w8a8")
    sp.set_defaults(func=guard(_serve))

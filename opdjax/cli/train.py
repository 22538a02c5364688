"""`opdjax train`: on-policy distillation as configured (default: the embedded tiny CPU config)."""

from __future__ import annotations

import os
import sys

import jax

from opdjax import config
from opdjax.cli.common import KEYS_HINT, guard
from opdjax.learner import distributed
from opdjax.pipeline import loop

__all__ = ["add_train_command"]


def _train(args) -> int:
    cfg = config.load(config.TrainConfig, args.config, args.overrides)
    if args.print_config:
        print(config.dump_yaml(cfg), end="")
        return 0
    if distributed.initialize(args.coordinator, args.num_processes, args.process_id):
        print(f"opdjax train: learner process {jax.process_index()} of {jax.process_count()} "
              f"({jax.local_device_count()} local / {jax.device_count()} devices). If a process dies the job stops; "
              f"restart every process with pipeline.resume=true to continue from the last checkpoint.",
              file=sys.stderr, flush=True)
    first = jax.process_index() == 0  # several learner processes: one of them talks
    try:
        summary = loop.train(cfg, log=print if first else (lambda m: None))
    except Exception as e:
        if distributed.is_multiprocess() and distributed.is_peer_failure(e):
            print(f"opdjax train: learner process {jax.process_index()} lost a peer ({str(e).splitlines()[0][:200]}); "
                  f"the job stops. Restart every process with pipeline.resume=true to continue from the last "
                  f"checkpoint.", file=sys.stderr, flush=True)
            os._exit(3)  # not a normal exit: JAX's shutdown barrier would abort with its own trace
        raise
    if first:
        print(loop.format_summary(summary))
    return 0


def add_train_command(subparsers) -> None:
    tr = subparsers.add_parser("train", help="on-policy distillation (default: the embedded tiny CPU config)")
    tr.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu defaults)")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.add_argument("--coordinator", default=None,
                    help="multi-process learner: host:port of process 0's coordinator, or 'auto' (JAX detects the "
                         "cluster); default: $OPDJAX_COORDINATOR, else one process")
    tr.add_argument("--num-processes", type=int, default=None, help="learner processes (default $OPDJAX_NUM_PROCESSES)")
    tr.add_argument("--process-id", type=int, default=None, help="this process's id (default $OPDJAX_PROCESS_ID)")
    tr.add_argument("overrides", nargs="*",
                    help=f"key=value overrides, e.g. rollout.temperature=0.8 student=DIR {KEYS_HINT}")
    tr.set_defaults(func=guard(_train))

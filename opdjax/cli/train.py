"""`opdjax train`: on-policy distillation as configured (default: the embedded tiny CPU config)."""

from __future__ import annotations

from opdjax import config
from opdjax.cli.common import guard
from opdjax.pipeline import loop

__all__ = ["add_train_command"]


def _train(args) -> int:
    cfg = config.load(config.TrainConfig, args.config, args.overrides)
    if args.print_config:
        print(config.dump_yaml(cfg), end="")
        return 0
    summary = loop.train(cfg)
    print(loop.format_summary(summary))
    return 0


def add_train_command(subparsers) -> None:
    tr = subparsers.add_parser("train", help="on-policy distillation (default: the embedded tiny CPU config)")
    tr.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu defaults)")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.temperature=0.8 student=DIR")
    tr.set_defaults(func=guard(_train))

"""opdjax: on-policy distillation under training-inference mismatch. train runs OPD (the embedded CPU default, or
your HF student and teacher); serve puts a rollout engine or a teacher behind HTTP for learners on other hosts;
measure reports the mismatch of one engine configuration; study calibrates the mismatch budget B of a
student/teacher pair; admit screens rollout configurations against B in seconds; sensitivity, recipe-search and
capacity pick an FP8 recipe that fits B and show the KV-cache tokens it buys; bench times the running engines and
plan predicts each admitted candidate's time to quality from those times and the study's steps-to-quality;
make-tiny and convert write HF checkpoints; data convert writes a dataset (messages, question/answer, prompt/completion) as opdjax's JSONL; keys
lists every config key with its default, choices and help. `opdjax COMMAND --help` lists a command's options."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys


class _NoTorchAdvice(logging.Filter):
    """Drop transformers' import-time "PyTorch was not found" advice: opdjax needs only its tokenizers and
    configuration utilities, so on a core install (no torch) the line reads as an error where there is none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


logging.getLogger("transformers").addFilter(_NoTorchAdvice())  # before anything imports transformers

import jax  # noqa: E402

from opdjax.cli.admission import add_admission_commands  # noqa: E402
from opdjax.cli.data import add_data_command  # noqa: E402
from opdjax.cli.keys import add_keys_command  # noqa: E402
from opdjax.cli.measure import add_measure_command  # noqa: E402
from opdjax.cli.plan import add_plan_commands  # noqa: E402
from opdjax.cli.serve import add_serve_command  # noqa: E402
from opdjax.cli.study import add_study_command  # noqa: E402
from opdjax.cli.tools import add_tool_commands  # noqa: E402
from opdjax.cli.train import add_train_command  # noqa: E402

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opdjax", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = p.add_subparsers(dest="command", required=True)
    add_train_command(sub)
    add_measure_command(sub)
    add_serve_command(sub)
    add_tool_commands(sub)
    add_data_command(sub)
    add_study_command(sub)
    add_admission_commands(sub)
    add_plan_commands(sub)
    add_keys_command(sub)
    return p


def _enable_compilation_cache() -> None:
    """Reuse compiled XLA programs across runs (OPDJAX_JAX_CACHE, default ~/.cache/opdjax/jax; empty = off)."""
    path = os.environ.get("OPDJAX_JAX_CACHE", str(pathlib.Path.home() / ".cache" / "opdjax" / "jax"))
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _enable_compilation_cache()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

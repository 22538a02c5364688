"""`opdjax` command line: train | measure | make-tiny | convert (more commands register themselves below)."""

from __future__ import annotations

import argparse
import sys


def _make_tiny(args) -> int:
    from opdjax.models.tiny import make_tiny

    out = make_tiny(args.out_dir, args.family, args.size, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.family}/{args.size} checkpoint and tokenizer to {out}")
    return 0


def _convert(args) -> int:
    import jax.numpy as jnp

    from opdjax.models import hf

    cfg, model = hf.load_model(args.src)
    hf.save_model(args.dst, cfg, model, dtype=jnp.dtype(args.dtype),
                  max_shard_bytes=int(args.max_shard_mb * 2**20) if args.max_shard_mb else None)
    try:
        from opdjax.models.tiny import load_tokenizer

        load_tokenizer(args.src).save_pretrained(args.dst)
    except (OSError, ValueError):
        pass
    print(f"converted {args.src} -> {args.dst} ({args.dtype})")
    return 0


def _train(args) -> int:
    from opdjax import config
    from opdjax.pipeline import loop as pipeline

    cfg = config.load(config.TrainConfig, args.config, args.overrides)
    if args.print_config:
        print(config.dump_yaml(cfg), end="")
        return 0
    summary = pipeline.train(cfg)
    print(pipeline.format_summary(summary))
    return 0


def _measure(args) -> int:
    from opdjax.budget import measure

    measure.run(args.student, engine=args.engine, options=measure.parse_options(args.options),
                prompts_file=args.prompts, task=args.task, n=args.n, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                batch_size=args.batch_size, out=args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opdjax", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="on-policy distillation (default: the embedded tiny CPU config)")
    tr.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu defaults)")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.temperature=0.8 student=DIR")
    tr.set_defaults(func=_train)

    m = sub.add_parser("measure", help="sample with an engine, rescore with the learner, report the mismatch")
    m.add_argument("--student", required=True, help="student HF checkpoint directory (with tokenizer)")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", default=None, help="JSONL file with a 'prompt' field per line")
    src.add_argument("--task", default=None, help="built-in task name (held-out prompts), e.g. addition")
    m.add_argument("--engine", default="jax", choices=["jax", "vllm"])
    m.add_argument("--n", type=int, default=64, help="number of prompts")
    m.add_argument("--max-new-tokens", type=int, default=16)
    m.add_argument("--temperature", type=float, default=1.0)
    m.add_argument("--top-k", type=int, default=0)
    m.add_argument("--top-p", type=float, default=1.0)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--batch-size", type=int, default=32)
    m.add_argument("--out", default=None, help="write the JSON report here")
    m.add_argument("options", nargs="*", help="engine options key=value, e.g. dtype=bfloat16 kv_cache_dtype=fp8")
    m.set_defaults(func=_measure)

    t = sub.add_parser("make-tiny", help="write a random-init HF checkpoint + locally trained BPE tokenizer")
    t.add_argument("out_dir")
    t.add_argument("--family", default="qwen3", choices=["llama", "qwen2", "qwen3"])
    t.add_argument("--size", default="tiny", choices=["tiny", "small", "base", "100m"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    t.set_defaults(func=_make_tiny)

    c = sub.add_parser("convert", help="re-save a HF checkpoint (dtype change, sharding)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--max-shard-mb", type=float, default=None)
    c.set_defaults(func=_convert)

    from opdjax.budget.admission import add_admission_commands
    from opdjax.budget.study import add_study_command

    add_study_command(sub)
    add_admission_commands(sub)
    return p


def _enable_compilation_cache() -> None:
    """Reuse compiled XLA programs across runs (OPDJAX_JAX_CACHE, default ~/.cache/opdjax/jax; empty = off)."""
    import os
    import pathlib

    path = os.environ.get("OPDJAX_JAX_CACHE", str(pathlib.Path.home() / ".cache" / "opdjax" / "jax"))
    if not path:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that report bad input (a config, a checkpoint, a vocabulary, a recipe, a budget, a weight
    manifest): the CLI prints their message, not a traceback, and exits 2."""
    from opdjax.budget.admission import AdmissionError
    from opdjax.sync.manifest import BridgeError
    from opdjax.config import ConfigError
    from opdjax.models.safetensors_io import CheckpointError
    from opdjax.quant import RecipeError
    from opdjax.teacher.jax_teacher import VocabMismatchError

    return ConfigError, CheckpointError, VocabMismatchError, RecipeError, AdmissionError, BridgeError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _enable_compilation_cache()
    try:
        return int(args.func(args) or 0)
    except user_errors() as e:
        print(f"opdjax {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

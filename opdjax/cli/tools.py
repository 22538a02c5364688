"""`opdjax make-tiny` (a random-init HF checkpoint + a locally trained tokenizer) and `opdjax convert`."""

from __future__ import annotations

import jax.numpy as jnp

from opdjax.cli.common import guard
from opdjax.models import hf
from opdjax.models.config import FAMILIES
from opdjax.models.tiny import CHAT_FORMATS, SIZES, load_tokenizer, make_tiny

__all__ = ["add_tool_commands"]


def _make_tiny(args) -> int:
    out = make_tiny(args.out_dir, args.family, args.size, seed=args.seed, dtype=args.dtype, chat=args.chat,
                    vocab_multiple=args.vocab_multiple)
    chat = f" (chat template: {args.chat})" if args.chat else ""
    print(f"wrote {args.family}/{args.size} checkpoint and tokenizer{chat} to {out}")
    return 0


def _convert(args) -> int:
    cfg, model = hf.load_model(args.src)
    hf.save_model(args.dst, cfg, model, dtype=jnp.dtype(args.dtype),
                  max_shard_bytes=int(args.max_shard_mb * 2**20) if args.max_shard_mb else None)
    try:
        load_tokenizer(args.src).save_pretrained(args.dst)
    except (OSError, ValueError):
        pass
    print(f"converted {args.src} -> {args.dst} ({args.dtype})")
    return 0


def add_tool_commands(subparsers) -> None:
    """Register make-tiny and convert (choices come from the model registries)."""
    t = subparsers.add_parser("make-tiny", help="write a random-init HF checkpoint + locally trained BPE tokenizer")
    t.add_argument("out_dir")
    t.add_argument("--family", default="qwen3", choices=sorted(FAMILIES))
    t.add_argument("--size", default="tiny", choices=list(SIZES))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--chat", default=None, choices=sorted(CHAT_FORMATS),
                   help="give the tokenizer this family's chat template and special tokens")
    t.add_argument("--vocab-multiple", type=int, default=64,
                   help="vocab_size = the tokenizer's length rounded up to this (rows past it are padding)")
    t.set_defaults(func=guard(_make_tiny))

    c = subparsers.add_parser("convert", help="re-save a HF checkpoint (dtype change, sharding)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--max-shard-mb", type=float, default=None)
    c.set_defaults(func=guard(_convert))

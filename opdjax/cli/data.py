"""`opdjax data convert IN OUT [--layout auto]`: a dataset in a common layout (messages, question/answer as in GSM8K,
prompt/completion) written as opdjax's JSONL (`data.convert`)."""

from __future__ import annotations

import pathlib

from opdjax.cli.common import guard
from opdjax.core.errors import InputError
from opdjax.data.convert import LAYOUTS, convert_file

__all__ = ["add_data_command"]


def _convert(args) -> int:
    if pathlib.Path(args.dst).exists() and not args.overwrite:
        raise InputError(f"{args.dst} exists; pass --overwrite to replace it")
    counts = convert_file(args.src, args.dst, args.layout)
    rows = ", ".join(f"{n} {layout}" for layout, n in sorted(counts.items()))
    print(f"wrote {sum(counts.values())} rows ({rows}) to {args.dst}")
    return 0


def add_data_command(subparsers) -> None:
    """Register `opdjax data convert`."""
    d = subparsers.add_parser("data", help="prepare prompt files: convert common dataset layouts to opdjax's JSONL")
    sub = d.add_subparsers(dest="data_command", required=True)
    c = sub.add_parser("convert", help="convert a JSONL dataset (messages, question/answer, prompt/completion) to "
                                       "opdjax's JSONL; a malformed row is named by file:line")
    c.add_argument("src", metavar="IN", help="the dataset, one JSON object per line")
    c.add_argument("dst", metavar="OUT", help="the opdjax JSONL to write (task.name=jsonl task.options.path=OUT)")
    c.add_argument("--layout", default="auto", choices=["auto", *LAYOUTS],
                   help="the rows' layout; auto picks each row's by its keys (messages, question, prompt)")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    c.set_defaults(func=guard(_convert))

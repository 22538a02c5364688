"""`opdjax measure`: the mismatch of one engine configuration, as the admission probe measures it.

Takes the same config file and `key=value` overrides as `train` and `admit` (the engine and its options are
`rollout.*`: `rollout.engine=vllm rollout.vllm={kv_cache_dtype: fp8}`, `rollout.recipe=fp8_w8a8`,
`rollout.weight_noise=0.01`, `student=DIR`, `prompts=FILE.jsonl`, ...). Samples `--batches` batches of
training prompts, rescores exactly those tokens with the learner's JAX forward (logits / T), and prints
`mismatch.metrics`: k1/k2/k3 estimates of KL(mu‖pi), |log-ratio| mean/p95/max, chi², perplexity ratio, IS
diagnostics. Top-k/top-p truncation renormalises the engine's distribution but not the learner's; it shows up as
mismatch.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from opdjax.admission.probe import probe
from opdjax.admission.records import write_json
from opdjax.cli.common import KEYS_HINT, guard
from opdjax.config import TrainConfig, load, to_dict
from opdjax.core import mismatch

__all__ = ["TABLE_KEYS", "add_measure_command", "format_table"]

TABLE_KEYS = ("k1", "k3", "abs_log_ratio_mean", "abs_log_ratio_p95", "abs_log_ratio_max", "chi2_token",
              "ppl_ratio", "ess", "num_tokens")


def format_table(rows: Sequence[tuple[str, Mapping[str, float]]], keys: Sequence[str] = TABLE_KEYS) -> str:
    """A fixed-width table: one row per (label, metrics)."""
    w = max([len("engine")] + [len(label) for label, _ in rows])
    head = f"{'engine':<{w}}  " + "  ".join(f"{k:>18}" for k in keys)
    lines = [head, "-" * len(head)]
    for label, m in rows:
        cells = []
        for k in keys:
            v = m.get(k, float("nan"))
            cells.append(f"{int(v):>18d}" if k == "num_tokens" else f"{v:>18.3e}")
        lines.append(f"{label:<{w}}  " + "  ".join(cells))
    return "\n".join(lines)


def _measure(args) -> int:
    cfg: TrainConfig = load(TrainConfig, args.config, args.overrides)
    res = probe(cfg, batches=args.batches, metric=args.metric, seed=args.seed)
    r = cfg.rollout
    label = " ".join([r.engine] + [o for o in args.overrides if o.startswith(("rollout.", "student"))][:6])
    print(format_table([(label, res.metrics)]))
    print(f"{res.metric} = {res.m:.4e}  95% CI [{res.ci_low:.4e}, {res.ci_high:.4e}]  ({res.tokens} tokens, "
          f"{res.seconds:.1f}s)")
    if args.out:
        write_json(args.out, {**res.to_dict(), "label": label, "overrides": list(args.overrides),
                              "config": to_dict(cfg)})
        print(f"wrote {args.out}")
    return 0


def add_measure_command(subparsers) -> None:
    """Register `opdjax measure [--config F] [--batches N] [--metric k3] [--seed S] [--out F] key=value ...`."""
    m = subparsers.add_parser("measure", help="sample with an engine, rescore with the learner, report the mismatch")
    m.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_cpu defaults)")
    m.add_argument("--batches", type=int, default=4, help="probe batches (rollout.batch_size prompts each)")
    m.add_argument("--metric", default="k3", choices=list(mismatch.ESTIMATORS), help="the M reported with a CI")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", default=None, help="write the JSON report here")
    m.add_argument("overrides", nargs="*", help="config overrides key=value, as for train, e.g. student=DIR "
                                                "rollout.engine=vllm 'rollout.vllm={kv_cache_dtype: fp8}' " + KEYS_HINT)
    m.set_defaults(func=guard(_measure))



"""What running S seeds together in one program could buy a study, measured on the study's own OPD step.

A study trains many short runs of one configuration that differ only in their seed. Stacking S seeds in one
program (vmap over seeds, or S runs' rows in one batch) does the same arithmetic as one run with S x the rows: the
same generation, teacher scoring and learner matmuls, with the per-seed weight gradients as separate (equally
sized) products. So the time of one public `opd_step` with S x B rows is what an S-seed stack costs, and

    speed-up bound = S * t(B rows) / t(S*B rows)

is the most any seed stacking can gain over running the S seeds one at a time (it saves dispatch and per-call
overhead, nothing else). A step that is overhead-bound scales sublinearly in rows (bound >> 1); a compute-bound
step scales linearly (bound ~ 1), and then the way to more seeds is a cheaper run, not a stacked one.

Both sizes are built once (`pipeline.build`, compiled by two warm-up steps), then timed alternately
(B, S*B, B, S*B, ...) so a change in machine load hits both. Prints the median step time of each, the split into
generate / score / train, and the bound.

Run: .venv/bin/python benchmarks/bench_seed_batching.py [--seeds 8 --repeats 6] [overrides ...]
     (overrides as for `opdjax train`, e.g. rollout.batch_size=32 task.name=sort)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import jax

from opdjax.config import TrainConfig, load
from opdjax.data.prompts import PromptStream
from opdjax.pipeline.build import build
from opdjax.pipeline.opd import opd_step, rollout_seed

PHASES = ("time/generate", "time/score", "time/train", "time/publish")


def built(overrides: list[str], rows: int):
    """A built run whose rollout batch has `rows` prompts, its initial train state and a prompt stream."""
    cfg = load(TrainConfig, None, [*overrides, f"rollout.batch_size={rows}", "pipeline.overwrite=true",
                                   "pipeline.tensorboard=false", f"pipeline.out_dir=/tmp/bench_seed_batching_{rows}"])
    run = build(cfg, log=lambda s: None)
    return run, run.parts.learner.init(run.params), PromptStream(run.parts.task, seed=cfg.seed)


def timed_step(run, state, stream, rows: int, step: int):
    """One `opd_step` on `rows` fresh prompts; returns the new state and its metrics (wall time in time/step)."""
    import time

    t = time.perf_counter()
    state, m = opd_step(run.parts, state, stream.next(rows), seed=rollout_seed(0, step))
    jax.block_until_ready(state.params)
    m["time/step"] = time.perf_counter() - t
    return state, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8, help="S, the seeds one program would stack")
    ap.add_argument("--repeats", type=int, default=6, help="timed steps of each size")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    base = load(TrainConfig, None, a.overrides).rollout.batch_size
    sizes = {"one run": base, f"{a.seeds} seeds stacked": base * a.seeds}
    runs = {k: built(a.overrides, rows) for k, rows in sizes.items()}
    times: dict[str, list[dict]] = {k: [] for k in sizes}
    load_before = os.getloadavg()[0]
    for i in range(2 + a.repeats):  # two warm-up steps compile every program, then alternate
        for k, rows in sizes.items():
            run, state, stream = runs[k]
            state, m = timed_step(run, state, stream, rows, i)
            runs[k] = (run, state, stream)
            if i >= 2:
                times[k].append(m)
    med = {k: {p: statistics.median(m[p] for m in ms) for p in (*PHASES, "time/step")} for k, ms in times.items()}
    one, stacked = (med[k]["time/step"] for k in sizes)
    bound = a.seeds * one / stacked
    print(f"rows per step: {sizes}; load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    for k, m in med.items():
        print(f"  {k:>18}: step {m['time/step'] * 1e3:8.1f} ms  (" +
              ", ".join(f"{p.split('/')[1]} {m[p] * 1e3:.1f}" for p in PHASES) + ")")
    print(f"  seed-stacking speed-up bound: {a.seeds} x {one * 1e3:.1f} ms / {stacked * 1e3:.1f} ms = {bound:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sizes": sizes, "median_seconds": med, "speedup_bound": bound}, f, indent=1)


if __name__ == "__main__":
    main()

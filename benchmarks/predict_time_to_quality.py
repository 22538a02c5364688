"""The predicted time-to-quality of FP8 + async versus sync BF16 for a named student on a named GPU.

    python benchmarks/predict_time_to_quality.py --study docs/results/plan_sort_cpu/budget.json --admission admit.json
        [--model qwen3-1.7b] [--bandwidth h100-sxm] [--memory-gb 40] [--context 2048] [--rollout-share 0.5 0.65 0.8]

F = S * C per candidate of the admission report, through `opdjax.admission.plan` (the same code as `opdjax plan`):

    S  steps factor: MEASURED on this CPU by the study (`--study`: steps to 0.9 of the way to the baseline's final
       reverse KL, per seed, with its bootstrap interval)
    C  per-step cost: MODELLED. A sync BF16 step is split into a rollout share phi (decode) and a learner share
       1 - phi (teacher scoring, training, weight sync); phi is ASSUMED (`--rollout-share`, one row each). An FP8
       recipe divides the rollout share by the decode speed-up r of `opdjax.quant.decode_cost` (tokens/s at the batch
       equal memory allows, FP8 vs BF16: bytes moved / bandwidth, a model, not a GPU measurement); staleness k >= 1
       runs async on separate hardware, C = max(rollout, learner) (ideal overlap).

Every input is printed with its source; nothing here ran on a GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from opdjax import quant
from opdjax.admission.plan import PhaseTimes, format_plan, plan
from opdjax.models.presets import model_config
from opdjax.quant.decode_cost import bandwidth_of, decode_model


def decode_speedup(model: str, bandwidth: str, memory_gb: float, context: int) -> float:
    """Modelled decode tokens/s of fp8_w8a8_kv at its own batch over BF16 at its own, at equal memory."""
    cfg, bw, mem = model_config(model), bandwidth_of(bandwidth), memory_gb * (1 << 30)
    bf16 = decode_model(cfg, mem, context, bw)
    fp8 = decode_model(cfg, mem, context, bw, recipe=quant.as_recipe("fp8_w8a8_kv"))
    return fp8["tok_s"] / bf16["tok_s"]


def modelled_times(candidates: list[str], phi: float, r: float) -> list[PhaseTimes]:
    """Per-step seconds (a sync BF16 step = 1): rollout phi (phi / r with an FP8 recipe), learner 1 - phi."""
    rows = [PhaseTimes("baseline", generate=phi, learner=1 - phi, step=1.0, steps=0)]
    for c in candidates:
        g = phi / r if "rollout.recipe=fp8" in c else phi
        rows.append(PhaseTimes(c, generate=g, learner=1 - phi, step=g + 1 - phi, steps=0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True, help="the study's budget.json (steps-to-quality per point)")
    ap.add_argument("--admission", required=True, help="`opdjax admit --out` report of the candidates")
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--bandwidth", default="h100-sxm")
    ap.add_argument("--memory-gb", type=float, default=40.0, help="memory for weights + KV cache")
    ap.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    ap.add_argument("--rollout-share", type=float, nargs="+", default=[0.5, 0.65, 0.8])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    points = json.loads(pathlib.Path(args.study).read_text())["points"]
    admitted = json.loads(pathlib.Path(args.admission).read_text())["candidates"]
    r = decode_speedup(args.model, args.bandwidth, args.memory_gb, args.context)
    print(f"inputs: steps factors MEASURED (CPU study {args.study}); decode speed-up r = {r:.2f}x MODELLED "
          f"({args.model}, {args.bandwidth}, {args.memory_gb:g} GiB, context {args.context}, fp8_w8a8_kv); rollout "
          f"share phi ASSUMED; async overlap IDEAL")
    out = []
    for phi in args.rollout_share:
        rows = plan(admitted, points, modelled_times([a["candidate"] for a in admitted], phi, r))
        print(f"\nrollout share phi = {phi:g} of a sync BF16 step")
        print(format_plan(rows))
        out.append({"phi": phi, "rows": [dict(vars(x)) for x in rows]})
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"decode_speedup": r, "model": args.model,
                                                      "bandwidth": args.bandwidth, "by_phi": out}, indent=1))


if __name__ == "__main__":
    main()

"""Per-step time of the same OPD run with in-process engines and with loopback engine servers, side by side.

    python benchmarks/bench_remote.py [--steps 30] [--batch 64] [--json out.json]

Both runs use the built-in pair (prepared once and cached) on this machine, the same config and seed. The remote run
starts `opdjax serve --role rollout` and `opdjax serve --role teacher` as separate OS processes on 127.0.0.1 and
points `rollout.endpoints` / `teacher.endpoints` at them; weights go over the tcp bridge after every step. The table
shows the median seconds per step of each phase (the loop's `time/*` metrics, steps after the first 3 so compilation
is excluded) and the remote/in-process ratio; the last row is the whole step.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from opdjax.config import TrainConfig, load
from opdjax.pipeline import loop
from opdjax.pipeline.inputs import resolve_models

PHASES = ("time/generate", "time/score", "time/train", "time/publish")


def _run(overrides: list[str], out: pathlib.Path) -> dict[str, float]:
    loop.train(load(TrainConfig, None, [*overrides, f"pipeline.out_dir={out}"]), log=lambda s: None)
    steps = [x for x in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in x][3:]
    med = {k: statistics.median(x[k] for x in steps) for k in PHASES}
    med["step"] = sum(med.values())
    return med


def _serve(role: str, token: pathlib.Path, models: tuple[str, str]) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-m", "opdjax.cli", "serve", "--role", role, "--token-file", str(token),
                          f"student={models[0]}", f"teacher={models[1]}"], stdout=subprocess.PIPE, text=True)
    return p, json.loads(p.stdout.readline())["port"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = [f"pipeline.steps={args.steps}", f"rollout.batch_size={args.batch}", "pipeline.eval_every=0",
            "pipeline.eval_prompts=16", "pipeline.progress=false", "pipeline.tensorboard=false"]
    models = resolve_models(load(TrainConfig, None, base), log=print)
    base += [f"student={models[0]}", f"teacher={models[1]}"]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-remote-"))
    local = _run(base, tmp / "local")
    token = tmp / "token"
    token.write_text("bench-secret")
    (rp, rport), (tp, tport) = _serve("rollout", token, models), _serve("teacher", token, models)
    try:
        remote = _run([*base, f"rollout.endpoints=[127.0.0.1:{rport}]", f"teacher.endpoints=[127.0.0.1:{tport}]",
                       f"sync.token_file={token}"], tmp / "remote")
    finally:
        for p in (rp, tp):
            p.terminate()
            p.wait(timeout=30)
    print(f"\nper-step seconds (median of steps 4..{args.steps}), batch {args.batch}, built-in pair\n")
    print("| phase | in-process | loopback servers | ratio |\n|---|---|---|---|")
    for k in (*PHASES, "step"):
        print(f"| {k.removeprefix('time/')} | {local[k]:.4f} | {remote[k]:.4f} | {remote[k] / local[k]:.2f}x |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"in_process": local, "remote": remote}, indent=2))


if __name__ == "__main__":
    main()

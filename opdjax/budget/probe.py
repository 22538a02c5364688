"""The admission probe: the mismatch M of a candidate engine configuration, without training.

Sample a few batches of training prompts with the candidate engine (`cfg.rollout`: engine, recipe, weight noise,
staleness, vLLM options), rescore the same tokens with the learner's forward (f32/bf16, no quantization), and
compute `mismatch.metrics`. For staleness k the probe first trains through the learning-rate warm-up and k more
steps (W + k throwaway steps, W = optim.warmup_steps, each published to the engine, which serves the weights k
versions back), so the engine is k versions behind a learner at its peak learning rate with warmed-up Adam
moments — what a training step sees. (k steps at step 0 would be either inside the warm-up, several times too
small, or Adam's first sign-like steps at full learning rate, an order of magnitude too large.)

M is the chosen metric (default k3) over all probe tokens, with a 95% bootstrap CI over sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.core import mismatch
from opdjax.config import TrainConfig
from opdjax.data.prompts import PromptStream


@dataclasses.dataclass
class ProbeResult:
    metric: str
    m: float
    ci_low: float
    ci_high: float
    metrics: dict[str, float]
    seconds: float
    tokens: int
    staleness: int = 0  # learner version - the version the engine sampled with (k for stale_versions=k)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def per_sequence_terms(metric: str, student_logp_BL: np.ndarray, rollout_logp_BL: np.ndarray,
                       mask_BL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per-sequence sum of the metric's token terms, per-sequence token counts) for a ratio-of-sums bootstrap.

    k1: -r;  k2: r²/2;  k3: exp(r) - r - 1;  abs_log_ratio_mean: |r|;  r = clip(student - rollout, ±20).
    """
    r = np.clip(student_logp_BL.astype(np.float64) - rollout_logp_BL, -mismatch.LOG_RATIO_CLAMP,
                mismatch.LOG_RATIO_CLAMP)
    terms = {"k1": -r, "k2": r * r / 2, "k3": np.expm1(r) - r, "abs_log_ratio_mean": np.abs(r)}
    if metric not in terms:
        raise ValueError(f"probe metric {metric!r} is not supported; choose one of {sorted(terms)}")
    m = mask_BL.astype(np.float64)
    return (terms[metric] * m).sum(1), m.sum(1)


def bootstrap_ci(sums_B: np.ndarray, counts_B: np.ndarray, *, n: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile CI of Σ sums / Σ counts, resampling sequences with replacement."""
    rows = np.flatnonzero(counts_B > 0)
    if rows.size == 0:
        return 0.0, 0.0
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, rows.size, (n, rows.size))
    est = sums_B[rows][idx].sum(1) / np.maximum(counts_B[rows][idx].sum(1), 1)
    a = (1 - level) / 2
    return float(np.quantile(est, a)), float(np.quantile(est, 1 - a))


def probe(cfg: TrainConfig, *, batches: int = 4, metric: str = "k3", seed: int = 0, log=print) -> ProbeResult:
    """Measure M for the engine configuration in `cfg.rollout` on the configured student (no training)."""
    from opdjax.pipeline import loop as pipeline

    t0 = time.time()
    run = pipeline.build(cfg, log=log, with_teacher=bool(cfg.rollout.stale_versions))
    state = run.learner.init(run.params)
    stream = PromptStream(run.task, seed=cfg.seed + 31 + seed)
    k = cfg.rollout.stale_versions
    learner_version = 0
    if k:
        # Throwaway steps, each published: the engine (stale_versions=k) serves version W while the learner is at
        # W + k.
        for i in range(cfg.optim.warmup_steps + k):
            examples = stream.next(cfg.rollout.batch_size)
            batch = pipeline.generate(run, examples, seed=10_000 + i)
            state, _ = run.learner.train_step(state, pipeline.learner_batch(run, batch, examples))
            learner_version = i + 1
            pipeline.publish(run, state.params, learner_version)
    sums, counts, tokens = [], [], 0
    s_all, r_all, m_all, served = [], [], [], []
    for b in range(batches):
        examples = stream.next(cfg.rollout.batch_size)
        batch = pipeline.generate(run, examples, seed=20_000 + 97 * seed + b)
        student = run.learner.logp(state.params, batch.tokens_BL, batch.valid_BL)
        s, c = per_sequence_terms(metric, student, batch.rollout_logp_BL, batch.completion_mask_BL)
        sums.append(s)
        counts.append(c)
        tokens += int(batch.completion_mask_BL.sum())
        s_all.append(student)
        r_all.append(batch.rollout_logp_BL.astype(np.float32))
        m_all.append(batch.completion_mask_BL)
        served.append(int(np.min(batch.version_B)))
    sums_B, counts_B = np.concatenate(sums), np.concatenate(counts)
    L = max(x.shape[1] for x in s_all)
    pad = lambda xs: np.concatenate([np.pad(x, ((0, 0), (0, L - x.shape[1]))) for x in xs])  # noqa: E731
    full = mismatch.metrics(jnp.asarray(pad(s_all)), jnp.asarray(pad(r_all)), jnp.asarray(pad(m_all)))
    lo, hi = bootstrap_ci(sums_B, counts_B, seed=seed)
    m = float(sums_B.sum() / max(counts_B.sum(), 1))
    return ProbeResult(metric=metric, m=m, ci_low=lo, ci_high=hi,
                       metrics={k_: float(v) for k_, v in full.items()}, seconds=time.time() - t0, tokens=tokens,
                       staleness=learner_version - min(served))


def cache_amax(graphdef, params, mcfg, tokens_BL, valid_BL) -> np.ndarray:
    """Per-layer [max |K|, max |V|] -> [L, 2] over the real-token slots of the KV cache the decoder fills for
    tokens_BL (post-RoPE keys, as engines cache them)."""
    return np.asarray(_cache_amax(graphdef, mcfg, params, jnp.asarray(tokens_BL), jnp.asarray(valid_BL, bool)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _cache_amax(graphdef, mcfg, params, tokens_BL, valid_BL):
    from opdjax.models import decoder

    B, L = tokens_BL.shape
    _, cache = decoder.forward(graphdef, params, tokens_BL, valid_BT=valid_BL,
                               cache=decoder.init_cache(mcfg, B, L))
    m = valid_BL[:, None, :, None]  # cache [B, K, S, D]
    return jnp.stack([jnp.stack([jnp.max(jnp.where(m, jnp.abs(k), 0)), jnp.max(jnp.where(m, jnp.abs(v), 0))])
                      for k, v in zip(cache.k, cache.v)])


def kv_amax(cfg: TrainConfig, *, batches: int = 2, seed: int = 0, log=print) -> np.ndarray:
    """Per-layer max |key| and max |value| [L, 2] of the student's KV cache on its own samples.

    The clean engine (`cfg.rollout` with no recipe, noise or staleness) samples `batches` batches of training
    prompts (a stream disjoint from the probe's); `cache_amax` of each whole sequence, max over batches. Feed the
    result to `quant.calibrate_kv_scales` for per-layer FP8 KV scales (scale = amax / fmt_max).
    """
    from opdjax.pipeline import loop as pipeline

    clean = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, recipe="none", weight_noise=0.0,
                                                                  stale_versions=0))
    run = pipeline.build(clean, log=log, with_teacher=False)
    stream = PromptStream(run.task, seed=cfg.seed + 977 + seed)
    out = np.zeros((run.student_cfg.num_layers, 2))
    for b in range(batches):
        batch = pipeline.generate(run, stream.next(cfg.rollout.batch_size), seed=30_000 + 97 * seed + b)
        out = np.maximum(out, cache_amax(run.graphdef, run.params, run.student_cfg, batch.tokens_BL, batch.valid_BL))
    return out

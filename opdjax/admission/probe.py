"""The admission probe: the mismatch M of a candidate engine configuration, without training.

Sample a few batches of training prompts with the candidate engine (`cfg.rollout`: engine, recipe, weight noise,
staleness, vLLM options), rescore the same tokens with the learner's forward (f32/bf16, no quantization), and
compute `mismatch.metrics`. For staleness k the probe first trains through the learning-rate warm-up and k more
steps (W + k throwaway steps, W = optim.warmup_steps, each published to the engine, which serves the weights k
versions back), so the engine is k versions behind a learner at its peak learning rate with warmed-up Adam
moments — what a training step sees. (k steps at step 0 would be either inside the warm-up, several times too
small, or Adam's first sign-like steps at full learning rate, an order of magnitude too large.)

M is the chosen metric (default k3) over all probe tokens. `probe` samples a fixed number of batches and gives M a
95% bootstrap CI over sequences (behind `measure`, the study and the recipe search); `probe_sequential` (behind
`admit`) samples the same batches one at a time until M's bounds clear a budget B (`opdjax.admission.sequential`).
`rescore` is the one sample -> rescore loop both use, as can any caller with its own engine and learner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opdjax import quant
from opdjax.admission import sequential
from opdjax.admission.records import ProbeResult
from opdjax.config import TrainConfig
from opdjax.core import mismatch
from opdjax.data.prompts import PromptStream
from opdjax.models import decoder
from opdjax.pipeline.build import build
from opdjax.pipeline.opd import generate, opd_step
from opdjax.rollout import EngineMismatch, RolloutBatch

__all__ = ["DEFAULT_MAX_BATCHES", "Rescored", "bootstrap_ci", "cache_amax", "calibrate_kv", "kv_amax",
           "per_sequence_terms", "probe", "probe_sequential", "rescore"]

DEFAULT_MAX_BATCHES = 6  # the sequential probe's cap (batches of rollout.batch_size); see README for its cost


def per_sequence_terms(metric: str, student_logp_BT: np.ndarray, rollout_logp_BT: np.ndarray,
                       mask_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(per-sequence sum of the metric's token terms, per-sequence token counts) for a ratio-of-sums bootstrap.

    Terms: `mismatch.estimator_terms(r, metric)` on r = clip(student - rollout, ±20), in float64.
    """
    if metric not in mismatch.ESTIMATORS:
        raise ValueError(f"probe metric {metric!r} is not supported; choose one of {sorted(mismatch.ESTIMATORS)}")
    r = np.clip(student_logp_BT.astype(np.float64) - rollout_logp_BT, -mismatch.LOG_RATIO_CLAMP,
                mismatch.LOG_RATIO_CLAMP)
    m = mask_BT.astype(np.float64)
    return (mismatch.estimator_terms(r, metric) * m).sum(1), m.sum(1)


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


@dataclasses.dataclass(frozen=True)
class Rescored:
    """Engine samples rescored by the learner, padded to one T: what every mismatch number is computed from."""

    student_logp_BT: np.ndarray
    rollout_logp_BT: np.ndarray
    mask_BT: np.ndarray
    min_version: int            # the oldest weight version the engine sampled with
    seconds_generate: float
    seconds_rescore: float

    @property
    def tokens(self) -> int:
        return int(self.mask_BT.sum())

    def metrics(self) -> dict[str, float]:
        """`mismatch.metrics` over all tokens (host floats)."""
        m = mismatch.metrics(jnp.asarray(self.student_logp_BT), jnp.asarray(self.rollout_logp_BT),
                             jnp.asarray(self.mask_BT))
        return {k: float(v) for k, v in m.items()}

    def estimate(self, metric: str, seed: int = 0) -> tuple[float, float, float]:
        """(M, ci_low, ci_high): the metric over all tokens and its 95% bootstrap CI over sequences."""
        sums_B, counts_B = per_sequence_terms(metric, self.student_logp_BT, self.rollout_logp_BT, self.mask_BT)
        lo, hi = bootstrap_ci(sums_B, counts_B, seed=seed)
        return float(sums_B.sum() / max(counts_B.sum(), 1)), lo, hi

    @classmethod
    def join(cls, parts: "Sequence[Rescored]") -> "Rescored":
        """Rows of all `parts`, padded to the longest T (mask 0); times added, the oldest version kept."""
        T = max(p.mask_BT.shape[1] for p in parts)
        pad = lambda xs: np.concatenate([np.pad(x, ((0, 0), (0, T - x.shape[1]))) for x in xs])  # noqa: E731
        return cls(pad([p.student_logp_BT for p in parts]), pad([p.rollout_logp_BT for p in parts]),
                   pad([p.mask_BT for p in parts]), min(p.min_version for p in parts),
                   sum(p.seconds_generate for p in parts), sum(p.seconds_rescore for p in parts))


def rescore(sample: Callable[[int], RolloutBatch], logp: Callable[[RolloutBatch], np.ndarray],
            batches: Iterable[int]) -> Rescored:
    """The one sample -> rescore loop: for each b in `batches`, `sample(b)` a RolloutBatch with the engine and
    `logp(batch)` its tokens with the learner; rows are padded to the longest T (mask 0) and concatenated."""
    parts = []
    for b in batches:
        t0 = time.perf_counter()
        batch = sample(b)
        t1 = time.perf_counter()
        student = np.asarray(logp(batch), np.float32)
        parts.append(Rescored(student, batch.rollout_logp_BT.astype(np.float32), batch.completion_mask_BT,
                              int(np.min(batch.version_B)), t1 - t0, time.perf_counter() - t1))
    return Rescored.join(parts)


@contextlib.contextmanager
def _session(cfg: TrainConfig, seed: int, log) -> Iterator[tuple[Callable[[Iterable[int]], Rescored], int]]:
    """Build the candidate's engine and the learner; for staleness k, train the W + k published throwaway steps.
    Yields (score(batches) -> Rescored of those probe batches, the learner's version)."""
    k = cfg.rollout.stale_versions
    with build(cfg, log=log, with_teacher=bool(k)) as run:
        state = run.parts.learner.init(run.params)
        stream = PromptStream(run.parts.task, seed=cfg.seed + 31 + seed)
        learner_version = 0
        if k:
            # Throwaway steps, each published: the engine (stale_versions=k) serves version W while the learner is at
            # W + k.
            for i in range(cfg.optim.warmup_steps + k):
                state, _ = opd_step(run.parts, state, stream.next(cfg.rollout.batch_size), seed=10_000 + i)
                learner_version = i + 1  # = state.step, the version opd_step published
        p = run.parts
        yield (lambda batches: rescore(
            lambda b: generate(p.engine, p.tokenizer, stream.next(cfg.rollout.batch_size), p.sampling,
                               seed=20_000 + 97 * seed + b, samples_per_prompt=p.samples_per_prompt),
            lambda batch: p.learner.logp(state.params, batch.tokens_BT, batch.valid_BT), batches)), learner_version


def probe(cfg: TrainConfig, *, batches: int = 4, metric: str = "k3", seed: int = 0, log=print) -> ProbeResult:
    """Measure M for the engine configuration in `cfg.rollout` on the configured student (no training): `batches`
    batches, M with its 95% bootstrap CI."""
    t0 = time.time()
    with _session(cfg, seed, log) as (score, learner_version):
        res = score(range(batches))
    m, lo, hi = res.estimate(metric, seed)
    return ProbeResult(metric=metric, m=m, ci_low=lo, ci_high=hi, metrics=res.metrics(), seconds=time.time() - t0,
                       tokens=res.tokens, staleness=learner_version - res.min_version, batches=batches)


def probe_sequential(cfg: TrainConfig, budget: float, *, metric: str = "k3", risk: float = 0.05,
                     max_batches: int = DEFAULT_MAX_BATCHES, seed: int = 0, log=print,
                     budget_high: float | None = None) -> ProbeResult:
    """M for the engine configuration in `cfg.rollout`, sampled batch by batch until its bounds clear `budget` (B's
    interval [budget, budget_high] when given) or `max_batches` batches are in (`sequential.run_sequential`:
    P(false ADMIT) and P(false REJECT) each < `risk`).

    The batches are the fixed probe's (same prompts and seeds, in order); ci_low/ci_high are the last look's
    one-sided bounds (each at that look's share of `risk`), and `reason` says why the probe stopped.
    """
    t0 = time.time()
    per_sequence_terms(metric, np.zeros((0, 0)), np.zeros((0, 0)), np.zeros((0, 0)))  # an unknown metric fails here
    parts: list[Rescored] = []

    def next_batch(b: int) -> tuple[np.ndarray, np.ndarray]:
        parts.append(score([b]))
        p = parts[-1]
        return per_sequence_terms(metric, p.student_logp_BT, p.rollout_logp_BT, p.mask_BT)

    with _session(cfg, seed, log) as (score, learner_version):
        seq = sequential.run_sequential(next_batch, budget, alpha=risk, max_batches=max_batches,
                                        budget_high=budget_high)
    res = Rescored.join(parts)
    return ProbeResult(metric=metric, m=seq.m, ci_low=seq.ci_low, ci_high=seq.ci_high, metrics=res.metrics(),
                       seconds=time.time() - t0, tokens=res.tokens, staleness=learner_version - res.min_version,
                       batches=seq.batches, reason=seq.reason)


def cache_amax(graphdef, params, mcfg, tokens_BT, valid_BT) -> np.ndarray:
    """Per-layer [max |K|, max |V|] -> [L, 2] over the real-token slots of the KV cache the decoder fills for
    tokens_BT (post-RoPE keys, as engines cache them)."""
    return np.asarray(_cache_amax(graphdef, mcfg, params, jnp.asarray(tokens_BT), jnp.asarray(valid_BT, bool)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _cache_amax(graphdef, mcfg, params, tokens_BT, valid_BT):
    B, T = tokens_BT.shape
    _, cache = decoder.forward(graphdef, params, tokens_BT, valid_BT=valid_BT, cache=decoder.init_cache(mcfg, B, T))
    m = valid_BT[:, None, :, None]  # cache [B, K, S, D]
    return jnp.stack([jnp.stack([jnp.max(jnp.where(m, jnp.abs(k), 0)), jnp.max(jnp.where(m, jnp.abs(v), 0))])
                      for k, v in zip(cache.k, cache.v)])


def kv_amax(cfg: TrainConfig, *, batches: int = 2, seed: int = 0, log=print) -> np.ndarray:
    """Per-layer max |key| and max |value| [L, 2] of the student's KV cache on its own samples.

    The clean engine (`cfg.rollout` with no recipe, noise or staleness) samples `batches` batches of training
    prompts (a stream disjoint from the probe's); `cache_amax` of each whole sequence, max over batches. Feed the
    result to `quant.calibrate_kv_scales` for per-layer FP8 KV scales (scale = amax / fmt_max).
    """
    clean = dataclasses.replace(cfg, rollout=cfg.rollout.with_mismatch(EngineMismatch()))
    with build(clean, log=log, with_teacher=False) as run:
        stream = PromptStream(run.parts.task, seed=cfg.seed + 977 + seed)
        out = np.zeros((run.student_cfg.num_layers, 2))
        for b in range(batches):
            p = run.parts
            batch = generate(p.engine, p.tokenizer, stream.next(cfg.rollout.batch_size), p.sampling,
                             seed=30_000 + 97 * seed + b, samples_per_prompt=p.samples_per_prompt)
            amax = cache_amax(run.graphdef, run.params, run.student_cfg, batch.tokens_BT, batch.valid_BT)
            out = np.maximum(out, amax)
    return out


def calibrate_kv(cfg: TrainConfig, *, batches: int = 2, seed: int = 0, log=print) -> tuple:
    """Per-layer (k_scale, v_scale) of an e4m3 KV cache from the student's K/V amax on its own samples."""
    return quant.calibrate_kv_scales(kv_amax(cfg, batches=batches, seed=seed, log=lambda m: None))

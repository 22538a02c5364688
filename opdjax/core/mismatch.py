"""Training–inference mismatch: metrics on sampled tokens and full-distribution metrics.

Everything here is a pure JAX function of arrays: jit-able, vmap-able and sharding-agnostic (plain ``jnp`` ops, so
inputs sharded over the batch axis just work). This is a base module: it imports nothing from the rest of opdjax.

Notation. On the engine's own sampled tokens, ``mu`` is the rollout engine's distribution and ``pi`` the learner's
(student). Per token ``r_t = clip(student_logp_t - rollout_logp_t, -20, 20)`` is the log of the importance ratio
``rho_t = pi/mu``. ``mask_BT`` (bool or float 0/1) marks response tokens. Masked means divide by ``max(Σ mask, 1)``.
Per sequence ``b``: ``n_b = Σ_t mask``, ``S_b = Σ_t mask·r_t``; a sequence counts iff ``n_b ≥ 1``.

Non-finite inputs. Outside ``jax.jit`` (concrete inputs) a NaN/inf log-prob on an unmasked token raises
``ValueError`` (see :func:`check_inputs`). Under ``jit`` we cannot raise, so such tokens are counted in
``nan_count`` and excluded (treated as masked out); padding positions (mask 0) may hold anything.

Keys of :func:`metrics` (all scalars; float unless noted; every key is 0 when no token counts, except
``ppl_ratio`` = 1):

=====================  ======================================================================================
key                    definition
=====================  ======================================================================================
k1                     mean_t(-r)                                   — unbiased estimate of KL(mu‖pi)
k2                     mean_t(r²/2)                                 — low variance, biased
k3                     mean_t(exp(r) - r - 1)                       — unbiased, ≥ 0
abs_log_ratio_mean     mean_t |r|
abs_log_ratio_p95      95th percentile of |r| over unmasked tokens (linear interpolation, as ``np.percentile``)
abs_log_ratio_max      max_t |r|
chi2_token             mean_t(rho² - 1)                             — chi²(pi‖mu) per token
chi2_seq               mean_b(exp(clip(2·S_b, ±20)) - 1)            — chi² of the sequence ratio Π rho
log_ppl_gap_mean       mean_b g_b,  g_b = mean_t(rollout_logp) - mean_t(student_logp)  (raw, unclipped logps)
log_ppl_gap_abs_mean   mean_b |g_b|
log_ppl_gap_max        max_b g_b
log_ppl_gap_min        min_b g_b
ppl_ratio              exp(clip(log_ppl_gap_mean, ±20)) = ppl_student / ppl_rollout (geometric over sequences)
is_ratio_mean          mean_t rho
is_ratio_std           sqrt(mean_t (rho - is_ratio_mean)²)
is_ratio_min           min_t rho
is_ratio_max           max_t rho
ess                    (Σ rho)² / (n · Σ rho²) ∈ (0, 1]             — normalised effective sample size
frac_ratio_out         fraction of tokens with rho < 1/C or rho > C   (C = ratio_threshold)
abs_prob_diff_mean     mean_t |exp(student_logp) - exp(rollout_logp)|  (logps clamped ≤ 20 before exp)
num_tokens             n = Σ mask over finite tokens                (int32)
num_seqs               number of sequences with ≥ 1 counted token   (int32)
nan_count              unmasked tokens whose student or rollout logp is non-finite (int32)
=====================  ======================================================================================

:func:`full_distribution_metrics` keys: ``kl_full``, ``kl_full_max``, ``tv_full``, and with ``top_k``:
``kl_topk``, ``tv_topk``, ``topk_mass_rollout``, ``topk_mass_student``.

Corrections (importance weights, rejection masks, the CORRECTIONS registry) live in :mod:`opdjax.core.corrections`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Metrics = dict[str, Array]

LOG_RATIO_CLAMP = 20.0
"""Log-ratios (and log-sums of them) are clamped to ±LOG_RATIO_CLAMP before ``exp``."""

METRIC_KEYS = (
    "k1", "k2", "k3",
    "abs_log_ratio_mean", "abs_log_ratio_p95", "abs_log_ratio_max",
    "chi2_token", "chi2_seq",
    "log_ppl_gap_mean", "log_ppl_gap_abs_mean", "log_ppl_gap_max", "log_ppl_gap_min", "ppl_ratio",
    "is_ratio_mean", "is_ratio_std", "is_ratio_min", "is_ratio_max", "ess",
    "frac_ratio_out", "abs_prob_diff_mean",
    "num_tokens", "num_seqs", "nan_count",
)  # fmt: skip
"""The stable key set of :func:`metrics`."""



# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------


def is_concrete(x) -> bool:
    """True when ``x`` holds values this process can inspect now: not a tracer (under jit/vmap/grad) and not a
    global array with shards on other hosts (multi-process runs). Value checks (NaN, mask values, id ranges) run
    only on concrete inputs."""
    if isinstance(x, jax.core.Tracer):
        return False
    return not (isinstance(x, jax.Array) and not x.is_fully_addressable)


def _check_shapes(student_logp_BT, rollout_logp_BT, mask_BT) -> None:
    s, r, m = np.shape(student_logp_BT), np.shape(rollout_logp_BT), np.shape(mask_BT)
    if s != r:
        raise ValueError(f"shape mismatch: student_logp_BT has shape {s} but rollout_logp_BT has shape {r}")
    if m != s:
        raise ValueError(f"shape mismatch: mask_BT has shape {m} but the log-probs have shape {s}")
    if len(s) != 2:
        raise ValueError(f"expected [B, T] log-probs and mask, got shape {s}")


def _check_mask_values(mask) -> None:
    """Raise ValueError unless a concrete mask is bool or holds only 0/1. Skipped for tracers."""
    if not is_concrete(mask):
        return
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        return
    try:
        m = m.astype(np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"mask_BT must be bool or numeric 0/1, got dtype {m.dtype}") from None
    ok = (m == 0) | (m == 1)
    if not ok.all():
        bad = np.unique(m[~ok])[:5]
        raise ValueError(f"mask_BT must be bool or contain only 0/1; found values {bad.tolist()}")


def _check_finite_masked(name: str, x, mask) -> None:
    if not (is_concrete(x) and is_concrete(mask)):
        return
    xv = np.asarray(x, dtype=np.float64)
    mv = np.asarray(mask).astype(bool)
    bad = mv & ~np.isfinite(xv)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) on unmasked tokens (first at index {idx}: "
            f"{xv[idx]}); expected finite log-probs"
        )


def check_inputs(student_logp_BT, rollout_logp_BT, mask_BT) -> None:
    """Validate sampled-token inputs; raise ``ValueError`` naming the problem.

    Checks: equal ``[B, T]`` shapes (message names both shapes); mask is bool or 0/1; no NaN/inf on unmasked
    tokens. Value checks run only on concrete arrays (outside ``jit``); under ``jit`` only shapes are checked and
    non-finite tokens are reported by the ``nan_count`` metric instead.
    """
    _check_shapes(student_logp_BT, rollout_logp_BT, mask_BT)
    _check_mask_values(mask_BT)
    _check_finite_masked("student_logp_BT", student_logp_BT, mask_BT)
    _check_finite_masked("rollout_logp_BT", rollout_logp_BT, mask_BT)


# ----------------------------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------------------------


def float_dtype(*xs) -> jnp.dtype:
    """The compute dtype of ``xs``: at least float32 (bf16/fp16 inputs are upcast); float64 stays float64."""
    return jnp.result_type(jnp.float32, *[jnp.asarray(x).dtype for x in xs])


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """Σ mask·x / max(Σ mask, 1) over ``axis``; 0 where nothing is unmasked.

    Masked-out entries of ``x`` are replaced by 0 first, so they may hold anything (inf, NaN)."""
    m = mask.astype(x.dtype)
    return jnp.sum(jnp.where(mask, x, 0), axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1)


def masked_max(x: Array, mask: Array, axis=None) -> Array:
    """max over unmasked entries; 0 where nothing is unmasked."""
    out = jnp.max(x, axis=axis, where=mask, initial=-jnp.inf)
    return jnp.where(jnp.any(mask, axis=axis), out, 0).astype(x.dtype)


def masked_min(x: Array, mask: Array, axis=None) -> Array:
    """min over unmasked entries; 0 where nothing is unmasked."""
    out = jnp.min(x, axis=axis, where=mask, initial=jnp.inf)
    return jnp.where(jnp.any(mask, axis=axis), out, 0).astype(x.dtype)


def masked_quantile(x: Array, mask: Array, q: float) -> Array:
    """q-quantile of the unmasked entries of ``x`` (all axes), linear interpolation as ``np.quantile``.

    Masked entries are set to +inf and sorted to the end; the result interpolates between ranks
    ``floor(q·(n-1))`` and the next one among the ``n`` unmasked entries. 0 when ``n == 0`` or ``x`` is empty.
    """
    x1, m1 = x.reshape(-1), mask.reshape(-1)
    if x1.shape[0] == 0:
        return jnp.zeros((), x.dtype)
    n = jnp.sum(m1.astype(jnp.int32))
    xs = jnp.sort(jnp.where(m1, x1, jnp.inf))
    xs = jnp.where(jnp.arange(x1.shape[0]) < n, xs, 0)  # keep the tail finite
    last = jnp.maximum(n, 1) - 1
    pos = q * last.astype(x.dtype)
    lo = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, last)
    hi = jnp.minimum(lo + 1, last)
    frac = pos - lo.astype(x.dtype)
    v = xs[lo] + frac * (xs[hi] - xs[lo])
    return jnp.where(n > 0, v, 0).astype(x.dtype)


def effective_sample_size(w: Array, mask: Array) -> Array:
    """Normalised effective sample size of weights ``w``: (Σ w)² / (n Σ w²) ∈ (0, 1] over the n unmasked entries
    (any shape, ``mask`` bool of the same shape); 0 when none (or all weights are 0)."""
    wm = jnp.where(mask, w, 0)
    n = jnp.sum(mask.astype(w.dtype))
    s1, s2 = jnp.sum(wm), jnp.sum(wm * wm)
    den = n * s2
    return jnp.where(den > 0, s1 * s1 / jnp.where(den > 0, den, 1), 0)


def prepare_log_ratios(student_logp_BT, rollout_logp_BT, mask_BT):
    """Shared front end of the sampled-token metrics and corrections (inputs already validated by
    :func:`check_inputs`): upcast to :func:`float_dtype`, exclude non-finite tokens.

    Returns ``(student, rollout, valid_BT (bool), r_BT (clamped log-ratio, 0 where invalid), nan_count)``.
    """
    dt = float_dtype(student_logp_BT, rollout_logp_BT)
    s = jnp.asarray(student_logp_BT, dt)
    r = jnp.asarray(rollout_logp_BT, dt)
    mask = jnp.asarray(mask_BT)
    m = mask if mask.dtype == jnp.bool_ else mask != 0
    finite = jnp.isfinite(s) & jnp.isfinite(r)
    nan_count = jnp.sum((m & ~finite).astype(jnp.int32))
    valid = m & finite
    s = jnp.where(valid, s, 0)
    r = jnp.where(valid, r, 0)
    log_ratio = jnp.clip(s - r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return s, r, valid, log_ratio, nan_count


def _clip_exp(x: Array) -> Array:
    return jnp.exp(jnp.clip(x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


ESTIMATORS = ("k1", "k2", "k3", "abs_log_ratio_mean")


def estimator_terms(r, name: str):
    """Per-token terms of a KL(mu‖pi) estimator on log-ratios r = log(pi/mu) (already clipped), any shape.

    k1: -r;   k2: r²/2;   k3: exp(r) - r - 1 (as expm1(r) - r, floored at 0 against rounding);   abs_log_ratio_mean: |r|.
    The one definition: jnp arrays in, jnp out (metrics, rejection); NumPy in, NumPy out (the probe's bootstrap in
    float64). The estimate is the masked mean of these terms.
    """
    xp = np if isinstance(r, (np.ndarray, np.generic)) else jnp
    if name == "k1":
        return -r
    if name == "k2":
        return 0.5 * r * r
    if name == "k3":
        return xp.maximum(xp.expm1(r) - r, 0)
    if name == "abs_log_ratio_mean":
        return xp.abs(r)
    raise ValueError(f"estimator {name!r} is not supported; choose one of {list(ESTIMATORS)}")


# ----------------------------------------------------------------------------------------------------------------
# Sampled-token metrics
# ----------------------------------------------------------------------------------------------------------------


def log_ratio(student_logp_BT: Array, rollout_logp_BT: Array) -> Array:
    """r = clip(student_logp - rollout_logp, ±20) = log(pi/mu), elementwise, any shape."""
    return jnp.clip(student_logp_BT - rollout_logp_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def metrics(
    student_logp_BT: Array, rollout_logp_BT: Array, mask_BT: Array, *, ratio_threshold: float = 2.0
) -> Metrics:
    """All sampled-token mismatch metrics between the learner (pi) and the rollout engine (mu).

    Args:
      student_logp_BT: [B, T] learner log-prob of each sampled token.
      rollout_logp_BT: [B, T] engine log-prob of the same tokens (after temperature / truncation).
      mask_BT: [B, T] bool or 0/1; 1 on response tokens.
      ratio_threshold: C > 1 for ``frac_ratio_out`` (tokens with rho outside [1/C, C]).

    Returns the dict documented in the module docstring (:data:`METRIC_KEYS`), every value a scalar. Finite for
    finite inputs, including all-masked rows and empty batches (B = 0 or T = 0). Under ``jit`` non-finite
    unmasked tokens are excluded and counted in ``nan_count``; outside ``jit`` they raise ``ValueError``.
    """
    if isinstance(ratio_threshold, (int, float)) and not ratio_threshold > 1:
        raise ValueError(f"ratio_threshold must be > 1, got {ratio_threshold}")
    check_inputs(student_logp_BT, rollout_logp_BT, mask_BT)
    return _metrics_core(student_logp_BT, rollout_logp_BT, mask_BT, ratio_threshold)


@jax.jit
def _metrics_core(student_logp_BT, rollout_logp_BT, mask_BT, ratio_threshold) -> Metrics:
    s, ro, valid, r, nan_count = prepare_log_ratios(student_logp_BT, rollout_logp_BT, mask_BT)
    dt = r.dtype
    vf = valid.astype(dt)
    n_tok = jnp.sum(valid.astype(jnp.int32))
    rho = jnp.exp(r)
    abs_r = jnp.abs(r)

    # per sequence
    n_B = jnp.sum(vf, axis=1)
    seq_ok_B = n_B > 0
    n_seq = jnp.sum(seq_ok_B.astype(jnp.int32))
    sum_r_B = jnp.sum(jnp.where(valid, r, 0), axis=1)
    gap_B = jnp.sum(ro - s, axis=1) / jnp.maximum(n_B, 1)  # s, ro are already 0 off `valid`
    gap_mean = masked_mean(gap_B, seq_ok_B)

    is_mean = masked_mean(rho, valid)
    log_c = jnp.log(jnp.asarray(ratio_threshold, dt))
    out = {
        "k1": masked_mean(-r, valid),
        "k2": masked_mean(0.5 * r * r, valid),
        "k3": masked_mean(estimator_terms(r, "k3"), valid),
        "abs_log_ratio_mean": masked_mean(abs_r, valid),
        "abs_log_ratio_p95": masked_quantile(abs_r, valid, 0.95),
        "abs_log_ratio_max": masked_max(abs_r, valid),
        "chi2_token": masked_mean(rho * rho - 1, valid),
        "chi2_seq": masked_mean(_clip_exp(2 * sum_r_B) - 1, seq_ok_B),
        "log_ppl_gap_mean": gap_mean,
        "log_ppl_gap_abs_mean": masked_mean(jnp.abs(gap_B), seq_ok_B),
        "log_ppl_gap_max": masked_max(gap_B, seq_ok_B),
        "log_ppl_gap_min": masked_min(gap_B, seq_ok_B),
        "ppl_ratio": _clip_exp(gap_mean),
        "is_ratio_mean": is_mean,
        "is_ratio_std": jnp.sqrt(masked_mean((rho - is_mean) ** 2, valid)),
        "is_ratio_min": masked_min(rho, valid),
        "is_ratio_max": masked_max(rho, valid),
        "ess": effective_sample_size(rho, valid),
        "frac_ratio_out": masked_mean(((r < -log_c) | (r > log_c)).astype(dt), valid),
        "abs_prob_diff_mean": masked_mean(
            jnp.abs(jnp.exp(jnp.minimum(s, LOG_RATIO_CLAMP)) - jnp.exp(jnp.minimum(ro, LOG_RATIO_CLAMP))), valid
        ),
        "num_tokens": n_tok,
        "num_seqs": n_seq,
        "nan_count": nan_count,
    }
    return out


# ----------------------------------------------------------------------------------------------------------------
# Full-distribution metrics
# ----------------------------------------------------------------------------------------------------------------


def _check_logits(student_logits_BTV, rollout_logits_BTV, mask_BT=None) -> None:
    s, r = np.shape(student_logits_BTV), np.shape(rollout_logits_BTV)
    if s != r:
        raise ValueError(f"shape mismatch: student_logits_BTV has shape {s} but rollout_logits_BTV has shape {r}")
    if len(s) != 3:
        raise ValueError(f"expected [B, T, V] logits, got shape {s}")
    if mask_BT is not None:
        m = np.shape(mask_BT)
        if m != s[:2]:
            raise ValueError(f"shape mismatch: mask_BT has shape {m} but the logits have shape {s} (expected {s[:2]})")
        _check_mask_values(mask_BT)
    for name, x in (("student_logits_BTV", student_logits_BTV), ("rollout_logits_BTV", rollout_logits_BTV)):
        if is_concrete(x) and np.isnan(np.asarray(x, dtype=np.float64)).any():
            raise ValueError(f"{name} contains NaN; expected finite logits (-inf allowed for truncated entries)")


def _check_temperature(temperature) -> None:
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_top_k(top_k, V: int) -> None:
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or not 1 <= top_k <= V:
        raise ValueError(f"top_k must be an int in [1, V={V}], got {top_k!r}")


def _log_softmax(logits_BTV: Array, temperature) -> Array:
    dt = float_dtype(logits_BTV)
    return jax.nn.log_softmax(jnp.asarray(logits_BTV, dt) / temperature, axis=-1)


def _kl_tv_from_logp(logmu: Array, logpi: Array) -> tuple[Array, Array]:
    """KL(mu‖pi) = Σ_v mu (log mu - log pi) and TV = ½ Σ_v |mu - pi| over the last axis.

    Entries with mu = 0 contribute 0 to KL (so -inf rollout logits from top-k/top-p truncation are fine); an entry
    with mu > 0 and pi = 0 makes KL +inf, as it should.
    """
    mu, pi = jnp.exp(logmu), jnp.exp(logpi)
    kl = jnp.sum(jnp.where(mu > 0, mu * (logmu - jnp.where(mu > 0, logpi, 0)), 0), axis=-1)
    tv = 0.5 * jnp.sum(jnp.abs(mu - pi), axis=-1)
    return kl, tv


def kl_per_position(student_logits_BTV: Array, rollout_logits_BTV: Array, *, temperature: float = 1.0) -> Array:
    """[B, T] exact KL(mu‖pi) = Σ_v mu(v)(log mu(v) - log pi(v)), with mu = softmax(rollout_logits / temperature)
    and pi = softmax(student_logits / temperature). ≥ 0 (up to rounding); 0 where the distributions agree."""
    _check_logits(student_logits_BTV, rollout_logits_BTV)
    _check_temperature(temperature)
    return _kl_tv_core(student_logits_BTV, rollout_logits_BTV, temperature)[0]


def tv_per_position(student_logits_BTV: Array, rollout_logits_BTV: Array, *, temperature: float = 1.0) -> Array:
    """[B, T] total variation ½ Σ_v |mu(v) - pi(v)| ∈ [0, 1] (same mu, pi as :func:`kl_per_position`)."""
    _check_logits(student_logits_BTV, rollout_logits_BTV)
    _check_temperature(temperature)
    return _kl_tv_core(student_logits_BTV, rollout_logits_BTV, temperature)[1]


@jax.jit
def _kl_tv_core(student_logits_BTV, rollout_logits_BTV, temperature):
    logmu = _log_softmax(rollout_logits_BTV, temperature)
    return _kl_tv_from_logp(logmu, _log_softmax(student_logits_BTV, temperature))


def topk_per_position(
    student_logits_BTV: Array, rollout_logits_BTV: Array, *, top_k: int, temperature: float = 1.0
) -> dict[str, Array]:
    """Per-position [B, T] metrics on the top-k support K of mu (the rollout distribution).

    mass_rollout = Σ_{v∈K} mu(v), mass_student = Σ_{v∈K} pi(v); mu_K, pi_K are mu, pi renormalised on K;
    kl = KL(mu_K‖pi_K), tv = ½ Σ_{v∈K} |mu_K - pi_K|. Keys: ``kl``, ``tv``, ``mass_rollout``, ``mass_student``.
    """
    _check_logits(student_logits_BTV, rollout_logits_BTV)
    _check_top_k(top_k, np.shape(rollout_logits_BTV)[-1])
    _check_temperature(temperature)
    return _topk_core(student_logits_BTV, rollout_logits_BTV, temperature, top_k=int(top_k))


@functools.partial(jax.jit, static_argnames=("top_k",))
def _topk_core(student_logits_BTV, rollout_logits_BTV, temperature, *, top_k: int) -> dict[str, Array]:
    logmu = _log_softmax(rollout_logits_BTV, temperature)
    logpi = _log_softmax(student_logits_BTV, temperature)
    logmu_K, idx_K = jax.lax.top_k(logmu, int(top_k))
    logpi_K = jnp.take_along_axis(logpi, idx_K, axis=-1)
    lse_mu = jax.nn.logsumexp(logmu_K, axis=-1, keepdims=True)
    lse_pi = jax.nn.logsumexp(logpi_K, axis=-1, keepdims=True)
    kl, tv = _kl_tv_from_logp(logmu_K - lse_mu, logpi_K - lse_pi)
    return {"kl": kl, "tv": tv, "mass_rollout": jnp.exp(lse_mu[..., 0]), "mass_student": jnp.exp(lse_pi[..., 0])}


def full_distribution_metrics(
    student_logits_BTV: Array,
    rollout_logits_BTV: Array,
    mask_BT: Array,
    *,
    top_k: int | None = None,
    temperature: float = 1.0,
) -> Metrics:
    """Exact mismatch between full next-token distributions, masked-averaged over positions.

    mu = softmax(rollout_logits / temperature), pi = softmax(student_logits / temperature), per position.
    Keys: ``kl_full`` = mean KL(mu‖pi), ``kl_full_max`` = max KL, ``tv_full`` = mean ½Σ|mu - pi|; with ``top_k``
    also ``kl_topk``, ``tv_topk``, ``topk_mass_rollout``, ``topk_mass_student`` (see :func:`topk_per_position`).
    Masked means divide by max(Σ mask, 1): all 0 for an all-masked or empty batch.
    """
    _check_logits(student_logits_BTV, rollout_logits_BTV, mask_BT)
    _check_temperature(temperature)
    if top_k is not None:
        _check_top_k(top_k, np.shape(rollout_logits_BTV)[-1])
        top_k = int(top_k)
    return _full_core(student_logits_BTV, rollout_logits_BTV, mask_BT, temperature, top_k=top_k)


@functools.partial(jax.jit, static_argnames=("top_k",))
def _full_core(student_logits_BTV, rollout_logits_BTV, mask_BT, temperature, *, top_k) -> Metrics:
    mask = jnp.asarray(mask_BT)
    m = mask if mask.dtype == jnp.bool_ else mask != 0
    logmu = _log_softmax(rollout_logits_BTV, temperature)
    logpi = _log_softmax(student_logits_BTV, temperature)
    kl, tv = _kl_tv_from_logp(logmu, logpi)
    out = {"kl_full": masked_mean(kl, m), "kl_full_max": masked_max(kl, m), "tv_full": masked_mean(tv, m)}
    if top_k is not None:
        tk = _topk_core(student_logits_BTV, rollout_logits_BTV, temperature, top_k=top_k)
        out |= {
            "kl_topk": masked_mean(tk["kl"], m),
            "tv_topk": masked_mean(tk["tv"], m),
            "topk_mass_rollout": masked_mean(tk["mass_rollout"], m),
            "topk_mass_student": masked_mean(tk["mass_student"], m),
        }
    return out

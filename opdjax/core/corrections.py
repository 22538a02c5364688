"""Mismatch corrections: importance weights and rejection masks that multiply the per-token loss.

All are ``stop_gradient`` and 0 on masked positions: :func:`is_weights` (truncated IS, token or sequence level),
:func:`rejection_mask` (masked IS / IcePop, geometric-mean and k-estimate rejection), and the name registry
:data:`CORRECTIONS` used through :class:`Correction` and :func:`apply_correction` (metric keys prefixed ``corr/``).
Notation as in :mod:`opdjax.core.mismatch`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from opdjax.core.mismatch import (
    LOG_RATIO_CLAMP,
    Metrics,
    check_inputs,
    effective_sample_size,
    estimator_terms,
    float_dtype,
    masked_max,
    masked_mean,
    prepare_log_ratios,
)
from opdjax.core.registry import register

Array = jax.Array

REJECTION_MODES = ("token", "sequence", "geometric", "k1", "k2", "k3")


# ----------------------------------------------------------------------------------------------------------------
# Corrections
# ----------------------------------------------------------------------------------------------------------------


def _normalize_weights(w_BT: Array, valid_BT: Array) -> Array:
    """w / masked_mean(w); unchanged when that mean is 0."""
    mean = masked_mean(w_BT, valid_BT)
    return jnp.where(mean > 0, w_BT / jnp.where(mean > 0, mean, 1), w_BT)


def is_weights(
    student_logp_BT: Array,
    rollout_logp_BT: Array,
    mask_BT: Array,
    *,
    level: str = "token",
    cap: float = 2.0,
    normalize: bool = False,
) -> tuple[Array, Metrics]:
    """Truncated importance-sampling weights (TIS), stop-gradient.

    level="token":    w_t = min(rho_t, C) = min(exp(r_t), C).
    level="sequence": w_t = min(exp(clip(S_b, ±20)), C) for every token of sequence b (S_b = Σ_t r_t).
    normalize=True divides by the masked mean of w (so mean w = 1 over unmasked tokens).
    Weights are 0 on masked-out (and non-finite) tokens.

    Returns ``(w_BT, metrics)`` with ``is_frac_capped`` (fraction of unmasked tokens whose untruncated weight
    exceeded C), ``is_ess`` ((Σw)²/(nΣw²) of the returned weights), ``is_weight_mean``, ``is_weight_max``.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if isinstance(cap, (int, float)) and not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    check_inputs(student_logp_BT, rollout_logp_BT, mask_BT)
    return _is_weights_core(student_logp_BT, rollout_logp_BT, mask_BT, cap, level=level, normalize=bool(normalize))


@functools.partial(jax.jit, static_argnames=("level", "normalize"))
def _is_weights_core(student_logp_BT, rollout_logp_BT, mask_BT, cap, *, level: str, normalize: bool):
    _, _, valid, r, _ = prepare_log_ratios(student_logp_BT, rollout_logp_BT, mask_BT)
    log_cap = jnp.log(jnp.asarray(cap, r.dtype))
    if level == "token":
        logw = r
    else:
        logw = jnp.broadcast_to(jnp.clip(jnp.sum(r, axis=1, keepdims=True), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), r.shape)
    capped = logw > log_cap
    w = jnp.where(valid, jnp.exp(jnp.minimum(logw, log_cap)), 0)
    if normalize:
        w = _normalize_weights(w, valid)
    w = jax.lax.stop_gradient(w)
    diag = {
        "is_frac_capped": masked_mean(capped.astype(r.dtype), valid),
        "is_ess": effective_sample_size(w, valid),
        "is_weight_mean": masked_mean(w, valid),
        "is_weight_max": masked_max(w, valid),
    }
    return w, diag


def _validate_rejection_args(mode, low, high, threshold) -> None:
    if mode not in REJECTION_MODES:
        raise ValueError(f"unknown rejection mode {mode!r}; valid modes: {', '.join(REJECTION_MODES)}")
    if mode in ("token", "sequence", "geometric"):
        if low is None or high is None:
            raise ValueError(f"rejection mode {mode!r} needs both low and high (got low={low}, high={high})")
        if threshold is not None:
            raise ValueError(f"rejection mode {mode!r} takes low/high, not threshold (got threshold={threshold})")
        if not (0 <= low < high):
            raise ValueError(f"rejection mode {mode!r} needs 0 <= low < high, got low={low}, high={high}")
    else:
        if threshold is None:
            raise ValueError(f"rejection mode {mode!r} needs threshold")
        if low is not None or high is not None:
            raise ValueError(f"rejection mode {mode!r} takes threshold, not low/high (got low={low}, high={high})")
        if not threshold >= 0:
            raise ValueError(f"rejection mode {mode!r} needs threshold >= 0, got {threshold}")


def rejection_mask(
    student_logp_BT: Array,
    rollout_logp_BT: Array,
    mask_BT: Array,
    *,
    mode: str,
    low: float | None = None,
    high: float | None = None,
    threshold: float | None = None,
) -> tuple[Array, Metrics]:
    """Masked importance sampling / rejection: a float 0/1 keep mask, stop-gradient, 0 on masked positions.

    Modes (r_t = clip(log rho_t, ±20), S_b = Σ_t r_t over the sequence's unmasked tokens, n_b their count):
      token      keep token t      iff low ≤ rho_t ≤ high                (MIS / IcePop, token level)
      sequence   keep sequence b   iff low ≤ Π_t rho_t ≤ high, i.e. log low ≤ S_b ≤ log high (unclamped sum)
      geometric  keep sequence b   iff low ≤ exp(S_b / n_b) ≤ high
      k1         keep sequence b   iff |mean_t(-r_t)| ≤ threshold
      k2         keep sequence b   iff mean_t(r_t²/2) ≤ threshold
      k3         keep sequence b   iff mean_t(exp(r_t) - r_t - 1) ≤ threshold
    ``low``/``high`` are for token/sequence/geometric (0 ≤ low < high), ``threshold`` (≥ 0) for k1/k2/k3;
    anything else raises ``ValueError``.

    Metrics: ``reject_frac_tokens`` (fraction of unmasked tokens dropped), ``reject_frac_seqs`` (fraction of
    sequences with ≥ 1 unmasked token that keep none), ``reject_ess`` ((Σ rho)²/(n Σ rho²) over kept tokens).
    """
    _validate_rejection_args(mode, low, high, threshold)
    check_inputs(student_logp_BT, rollout_logp_BT, mask_BT)
    bounds = (low, high) if mode in ("token", "sequence", "geometric") else (threshold, threshold)
    return _rejection_core(student_logp_BT, rollout_logp_BT, mask_BT, *bounds, mode=mode)


@functools.partial(jax.jit, static_argnames=("mode",))
def _rejection_core(student_logp_BT, rollout_logp_BT, mask_BT, low, high, *, mode: str):
    """``low``/``high`` are the ratio bounds, or both the threshold for the k modes."""
    _, _, valid, r, _ = prepare_log_ratios(student_logp_BT, rollout_logp_BT, mask_BT)
    dt = r.dtype
    vf = valid.astype(dt)
    if mode in ("token", "sequence", "geometric"):
        log_lo = jnp.log(jnp.asarray(low, dt))  # -inf for low = 0: always passes
        log_hi = jnp.log(jnp.asarray(high, dt))
    if mode == "token":
        keep = (r >= log_lo) & (r <= log_hi)
    else:
        n_B = jnp.maximum(jnp.sum(vf, axis=1), 1)
        if mode == "sequence":
            stat_B = jnp.sum(r * vf, axis=1)
            keep_B = (stat_B >= log_lo) & (stat_B <= log_hi)
        elif mode == "geometric":
            stat_B = jnp.sum(r * vf, axis=1) / n_B
            keep_B = (stat_B >= log_lo) & (stat_B <= log_hi)
        else:
            terms = estimator_terms(r, mode)
            stat_B = jnp.sum(terms * vf, axis=1) / n_B
            if mode == "k1":
                stat_B = jnp.abs(stat_B)
            keep_B = stat_B <= high
        keep = jnp.broadcast_to(keep_B[:, None], r.shape)
    keep = keep & valid
    keep_f = jax.lax.stop_gradient(keep.astype(dt))
    seq_ok_B = jnp.any(valid, axis=1)
    diag = {
        "reject_frac_tokens": masked_mean(1 - keep_f, valid),
        "reject_frac_seqs": masked_mean((~jnp.any(keep, axis=1)).astype(dt), seq_ok_B),
        "reject_ess": effective_sample_size(jnp.exp(r), keep),
    }
    return keep_f, diag


# ----------------------------------------------------------------------------------------------------------------
# Correction registry
# ----------------------------------------------------------------------------------------------------------------

CorrectionFn = Callable[["Correction", Array, Array, Array], tuple[Array, Metrics]]
CORRECTIONS: dict[str, CorrectionFn] = {}
"""name -> fn(corr, student_logp_BT, rollout_logp_BT, mask_BT) -> (w_BT, metrics without prefix)."""


def register_correction(name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator adding a correction to :data:`CORRECTIONS` under ``name``. Registering the same definition again
    (same module and qualified name: a re-run notebook cell) replaces it; a different function under a taken name
    raises ValueError (:func:`opdjax.core.registry.register`)."""

    def deco(fn: CorrectionFn) -> CorrectionFn:
        register(CORRECTIONS, "correction", name, fn)
        return fn

    return deco


def _unknown_correction(name) -> ValueError:
    return ValueError(f"unknown correction {name!r}; valid names: {', '.join(sorted(CORRECTIONS))}")


@dataclasses.dataclass(frozen=True)
class Correction:
    """Which correction to apply to the per-token loss, and its parameters (hashable: usable as a jit static).

    ``cap`` is C for token_tis / seq_tis; ``low``/``high`` bound the ratio for token_mis / seq_mis / geo_reject;
    ``threshold`` bounds the per-sequence k-estimate for k1_reject / k2_reject / k3_reject; ``normalize``
    divides the weights by their masked mean (any correction).
    """

    name: str = "none"
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0
    threshold: float = 0.1
    normalize: bool = False

    def __post_init__(self):
        if self.name not in CORRECTIONS:
            raise _unknown_correction(self.name)
        if not self.cap > 0:
            raise ValueError(f"Correction.cap must be > 0, got {self.cap}")
        if not 0 <= self.low < self.high:
            raise ValueError(f"Correction needs 0 <= low < high, got low={self.low}, high={self.high}")
        if not self.threshold >= 0:
            raise ValueError(f"Correction.threshold must be >= 0, got {self.threshold}")


@register_correction("none")
def _corr_none(corr, student_logp_BT, rollout_logp_BT, mask_BT):
    check_inputs(student_logp_BT, rollout_logp_BT, mask_BT)
    dt = float_dtype(student_logp_BT, rollout_logp_BT)
    return jnp.asarray(mask_BT).astype(dt), {}


@register_correction("token_tis")
def _corr_token_tis(corr, s, r, m):
    return is_weights(s, r, m, level="token", cap=corr.cap)


@register_correction("seq_tis")
def _corr_seq_tis(corr, s, r, m):
    return is_weights(s, r, m, level="sequence", cap=corr.cap)


def _rejection_correction(mode: str, uses_bounds: bool) -> CorrectionFn:
    def fn(corr, s, r, m):
        if uses_bounds:
            return rejection_mask(s, r, m, mode=mode, low=corr.low, high=corr.high)
        return rejection_mask(s, r, m, mode=mode, threshold=corr.threshold)

    fn.__name__ = f"_corr_{mode}_rejection"
    return fn


for _name, _mode, _bounds in (
    ("token_mis", "token", True),
    ("seq_mis", "sequence", True),
    ("geo_reject", "geometric", True),
    ("k1_reject", "k1", False),
    ("k2_reject", "k2", False),
    ("k3_reject", "k3", False),
):
    register_correction(_name)(_rejection_correction(_mode, _bounds))
del _name, _mode, _bounds


def apply_correction(
    corr: Correction | None, student_logp_BT: Array, rollout_logp_BT: Array, mask_BT: Array
) -> tuple[Array, Metrics]:
    """Weights ``w_BT`` (stop-gradient, 0 on masked positions) that multiply the per-token loss, plus metrics
    with keys prefixed ``corr/``. ``None`` means ``Correction("none")``: w = mask (no metrics).

    With ``corr.normalize`` the weights are divided by their masked mean after the correction ran; the
    correction's own diagnostics describe the weights before that normalisation.
    """
    corr = Correction() if corr is None else corr
    fn = CORRECTIONS.get(corr.name)
    if fn is None:
        raise _unknown_correction(corr.name)
    w, diag = fn(corr, student_logp_BT, rollout_logp_BT, mask_BT)
    if corr.normalize:
        w = _normalize_weights(w, jnp.asarray(mask_BT).astype(bool))
    return jax.lax.stop_gradient(w), {f"corr/{k}": v for k, v in diag.items()}

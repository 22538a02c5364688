"""On-policy distillation losses, in a registry that declares which teacher data each loss needs.

Every loss has one signature::

    loss_fn(student_logp_BT, student_logprobs_BTV, batch, *, correction=None, **options) -> (loss, metrics)

- ``student_logp_BT`` [B, T]: the learner's log-prob of ``tokens_BT[b, t]``, already aligned (position t holds
  log pi(token_t | prefix)). Gradients flow through it (and through ``student_logprobs_BTV``).
- ``student_logprobs_BTV`` [B, T, V]: the learner's full log-softmax at the same positions, or None for losses
  whose ``needs`` lack ``"student_logprobs"``. (Raw logits are accepted too: the losses renormalise, which is a
  no-op on log-probs.)
- ``batch``: a :class:`opdjax.core.types.Batch` or a plain dict with its field names.
- ``correction``: a :class:`opdjax.core.corrections.Correction` (or its name); per-token weights ``w_t`` from
  :func:`opdjax.core.corrections.apply_correction` (stop-gradient, ``w = mask`` for None / "none") multiply each
  token's loss. Its metrics (``corr/...``) join the loss metrics.
- ``loss`` is a scalar: Σ_t w_t·ℓ_t / max(Σ mask, 1), weighted per-token terms over the *unweighted* token
  count, so a rejection correction that drops tokens shrinks the loss instead of re-scaling the survivors.

Needs (what the pipeline must ask the teacher/engine for), from :data:`NEEDS`:

================  ===================================================  ==============================
need              batch fields                                         used by
================  ===================================================  ==============================
teacher_logp      ``teacher_logp_BT``                                  reverse_kl_sampled
teacher_topk      ``teacher_topk_ids_BTK``, ``teacher_topk_logp_BTK``  forward_kl_topk
teacher_logits    ``teacher_logits_BTV``                               jsd
student_logprobs  the ``student_logprobs_BTV`` argument                forward_kl_topk, jsd
reward            ``reward_B``                                         reinforce
================  ===================================================  ==============================

``mask_BT`` is always required; ``rollout_logp_BT`` is required whenever a correction other than "none" is used.
Missing fields and shape mismatches raise ``ValueError`` naming the field, the loss and the shapes.

This is a pure module: it imports only other :mod:`opdjax.core` modules.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.core.corrections import Correction, apply_correction
from opdjax.core.mismatch import float_dtype, is_concrete, masked_mean
from opdjax.core.registry import lookup, register
from opdjax.core.types import BATCH_FIELDS, Batch

Array = jax.Array
Metrics = dict[str, Array]
LossFn = Callable[..., tuple[Array, Metrics]]

NEEDS = frozenset({"teacher_logp", "teacher_topk", "teacher_logits", "student_logprobs", "reward"})
"""Every need a loss may declare."""

NEED_FIELDS: dict[str, tuple[str, ...]] = {
    "teacher_logp": ("teacher_logp_BT",),
    "teacher_topk": ("teacher_topk_ids_BTK", "teacher_topk_logp_BTK"),
    "teacher_logits": ("teacher_logits_BTV",),
    "reward": ("reward_B",),
    "student_logprobs": (),  # an argument, not a batch field
}
"""need -> the batch fields that satisfy it."""

_TAIL_EPS = 1e-6
"""Tail masses below this count as 0 (float32 sums of k=V probabilities miss 1 by ~1e-7)."""


def _get(batch: Batch | Mapping[str, Any], key: str):
    if isinstance(batch, Mapping):
        return batch.get(key)
    return getattr(batch, key, None)


# ----------------------------------------------------------------------------------------------------- registry

LOSSES: dict[str, LossFn] = {}

DEFAULT_LOSS = "forward_kl_topk"
"""The loss `Learner` and `opdjax train` (`LossConfig.name`) use when none is named: the forward KL to the teacher's
top-k at every sampled prefix. It trained every seed of the built-in task tried, where the sampled-token reverse KL
(`reverse_kl_sampled`) stalls on a plateau for some (docs/results/budget-cpu.md)."""
"""name -> loss function (validated wrapper); each carries ``.needs`` (frozenset) and ``.loss_name``."""


def register_loss(name: str, needs: frozenset[str] = frozenset()) -> Callable[[LossFn], LossFn]:
    """Register ``fn`` under ``name`` with the data it ``needs`` (a subset of :data:`NEEDS`).

    The registered function validates its inputs first (required fields present, shapes consistent,
    ``correction`` resolved) and then calls ``fn``. Registering the same definition again (same module and
    qualified name: a re-run notebook cell) replaces it; a different function under a taken name is a ValueError.
    """
    needs = frozenset(needs)
    unknown = needs - NEEDS
    if unknown:
        raise ValueError(f"loss {name!r} declares unknown needs {sorted(unknown)}; valid needs: {sorted(NEEDS)}")

    def deco(fn: LossFn) -> LossFn:
        @functools.wraps(fn)
        def wrapped(student_logp_BT, student_logprobs_BTV, batch, *, correction=None, **options):
            correction = _resolve_correction(correction)
            _validate(name, needs, student_logp_BT, student_logprobs_BTV, batch, correction)
            return fn(student_logp_BT, student_logprobs_BTV, batch, correction=correction, **options)

        wrapped.needs = needs
        wrapped.loss_name = name
        register(LOSSES, "loss", name, wrapped, key=fn)
        return wrapped

    return deco


def get_loss(name: str) -> LossFn:
    """The registered loss ``name``; unknown names raise ValueError listing the registered ones."""
    return lookup(LOSSES, name, "loss", "losses")


def loss_needs(name: str) -> frozenset[str]:
    """What loss ``name`` needs, drawn from :data:`NEEDS` (e.g. ``frozenset({"teacher_logp"})``)."""
    return get_loss(name).needs


# ----------------------------------------------------------------------------------------------------- validation


def _resolve_correction(correction) -> Correction | None:
    if correction is None or isinstance(correction, Correction):
        return correction
    if isinstance(correction, str):
        return Correction(name=correction)
    raise ValueError(f"correction must be a Correction, a correction name or None, got {correction!r}")


def _active(correction: Correction | None) -> bool:
    return correction is not None and (correction.name != "none" or correction.normalize)


def _validate(name, needs, student_logp_BT, student_logprobs_BTV, batch, correction) -> None:
    """Raise ValueError naming the loss and the bad field: missing data or inconsistent shapes.

    With [B, T] = student_logp_BT's shape: every ``*_BT`` field is [B, T], ``student_logprobs_BTV`` and
    ``teacher_logits_BTV`` are [B, T, V] with one V, the teacher top-k fields are [B, T, K] with K ≤ V and (when
    concrete) ids in [0, V), ``reward_B`` is [B].
    """
    _check_fields(name, needs, student_logprobs_BTV, batch, correction)
    s = tuple(np.shape(student_logp_BT))
    if len(s) != 2:
        raise ValueError(f"loss {name!r}: student_logp_BT must be [B, T], got shape {s}")
    for field in ("mask_BT", "tokens_BT", "rollout_logp_BT", "teacher_logp_BT"):
        if _get(batch, field) is not None:
            _expect_shape(name, batch, field, s, s)
    V = _student_vocab(name, student_logprobs_BTV, s)
    _check_teacher_logits(name, batch, s, V)
    _check_teacher_topk(name, batch, s, V)
    if _get(batch, "reward_B") is not None:
        _expect_shape(name, batch, "reward_B", s[:1], s)


def _check_fields(name, needs, student_logprobs_BTV, batch, correction) -> None:
    """The batch is a Batch or a dict of its fields, holding every field the loss's needs (and an active
    correction's ``rollout_logp_BT``) ask for; the full student log-probs are given when needed."""
    if not isinstance(batch, (Mapping, Batch)):
        raise ValueError(f"loss {name!r}: batch must be a Batch or a dict, got {type(batch).__name__}")
    if isinstance(batch, Mapping):
        extra = sorted(set(batch) - set(BATCH_FIELDS))
        if extra:
            raise ValueError(f"loss {name!r}: unknown batch field(s) {extra}; valid fields: {list(BATCH_FIELDS)}")
    required = ["mask_BT"] + [f for need in sorted(needs) for f in NEED_FIELDS[need]]
    if _active(correction):
        required.append("rollout_logp_BT")
    for field in required:
        if _get(batch, field) is None:
            why = f"correction {correction.name!r}" if field == "rollout_logp_BT" else f"loss {name!r}"
            raise ValueError(f"loss {name!r} needs batch field {field!r} (required by {why}); it is missing")
    if "student_logprobs" in needs and student_logprobs_BTV is None:
        raise ValueError(f"loss {name!r} needs the full student log-probs student_logprobs_BTV [B, T, V]; got None")


def _expect_shape(name, batch, field: str, shape: tuple[int, ...], s: tuple[int, int]) -> None:
    """ValueError unless batch field ``field`` has ``shape`` (``s``: student_logp_BT's shape, for the message)."""
    got = tuple(np.shape(_get(batch, field)))
    if got != tuple(shape):
        raise ValueError(f"loss {name!r}: shape mismatch: {field} has shape {got}, expected {tuple(shape)} "
                         f"(student_logp_BT has shape {s})")


def _check_btx(name, field: str, x, s: tuple[int, int], last: str) -> tuple[int, ...]:
    """The shape of ``x``, which must be [B, T, ``last``] with [B, T] = ``s``."""
    shape = tuple(np.shape(x))
    if len(shape) != 3 or shape[:2] != s:
        raise ValueError(f"loss {name!r}: shape mismatch: {field} has shape {shape}, expected ({s[0]}, {s[1]}, "
                         f"{last})")
    return shape


def _student_vocab(name, student_logprobs_BTV, s: tuple[int, int]) -> int | None:
    """V of the full student log-probs [B, T, V]; None when they are not given."""
    if student_logprobs_BTV is None:
        return None
    return _check_btx(name, "student_logprobs_BTV", student_logprobs_BTV, s, "V")[2]


def _check_teacher_logits(name, batch, s: tuple[int, int], V: int | None) -> None:
    """teacher_logits_BTV (when present) is [B, T, V'] with V' = the student's V (when known)."""
    logits = _get(batch, "teacher_logits_BTV")
    if logits is None:
        return
    tl = _check_btx(name, "teacher_logits_BTV", logits, s, "V")
    if V is not None and tl[2] != V:
        raise ValueError(f"loss {name!r}: vocabulary mismatch: teacher_logits_BTV has V={tl[2]} (shape {tl}) but "
                         f"student_logprobs_BTV has V={V}")


def _check_teacher_topk(name, batch, s: tuple[int, int], V: int | None) -> None:
    """teacher_topk_ids_BTK (when present) is [B, T, K], teacher_topk_logp_BTK the same shape; with the student's
    V known, K ≤ V and (concrete ids only) every id lies in [0, V)."""
    ids = _get(batch, "teacher_topk_ids_BTK")
    if ids is None:
        return
    ik = _check_btx(name, "teacher_topk_ids_BTK", ids, s, "K")
    if _get(batch, "teacher_topk_logp_BTK") is not None:
        _expect_shape(name, batch, "teacher_topk_logp_BTK", ik, s)
    if V is None:
        return
    if ik[2] > V:
        raise ValueError(f"loss {name!r}: teacher top-k has K={ik[2]} > student vocabulary V={V}")
    if is_concrete(ids):
        idv = np.asarray(ids)
        if idv.size and (idv.min() < 0 or idv.max() >= V):
            raise ValueError(f"loss {name!r}: teacher_topk_ids_BTK holds ids in [{idv.min()}, {idv.max()}], "
                             f"outside the student vocabulary [0, {V})")


# ----------------------------------------------------------------------------------------------------- helpers


def _mask(batch) -> Array:
    m = jnp.asarray(_get(batch, "mask_BT"))
    return m if m.dtype == jnp.bool_ else m != 0


def _weights(correction, student_logp_BT, batch, mask_BT, dt) -> tuple[Array, Metrics]:
    """w_t from :func:`apply_correction` (stop-gradient); ``mask`` when there is no rollout_logp and no correction."""
    rollout = _get(batch, "rollout_logp_BT")
    if rollout is None:  # _validate guarantees no active correction here
        return mask_BT.astype(dt), {}
    s = jnp.where(mask_BT, jax.lax.stop_gradient(student_logp_BT), 0)
    r = jnp.where(mask_BT, jnp.asarray(rollout), 0)
    w, metrics = apply_correction(correction, s.astype(dt), r.astype(dt), mask_BT)
    return jnp.where(mask_BT, w.astype(dt), 0), metrics


def _reduce(w_BT: Array, ell_BT: Array, mask_BT: Array) -> Array:
    """Σ w·ℓ / max(Σ mask, 1), with ℓ zeroed off the mask (padding may hold anything)."""
    n = jnp.maximum(jnp.sum(mask_BT.astype(ell_BT.dtype)), 1)
    return jnp.sum(w_BT * jnp.where(mask_BT, ell_BT, 0)) / n


def _masked_std(x: Array, mask: Array) -> Array:
    mean = masked_mean(x, mask)
    return jnp.sqrt(masked_mean((x - mean) ** 2, mask))


def _kl_last(logp: Array, logq: Array) -> Array:
    """Σ_v p (log p - log q) over the last axis; entries with p = 0 contribute 0 (no 0·inf NaN)."""
    p = jnp.exp(logp)
    pos = p > 0
    return jnp.sum(jnp.where(pos, p * (jnp.where(pos, logp, 0) - jnp.where(pos, logq, 0)), 0), axis=-1)


def discounted_returns(x_BT: Array, discount: float) -> Array:
    """A_t = Σ_{s≥t} discount^{s-t} x_s within each row (a reverse discounted cumulative sum over time).

    Computed by the recursion A_t = x_t + discount·A_{t+1}, A_T = 0. Zero entries (masked tokens) add nothing but
    still count as elapsed positions. ``discount = 1`` is the plain reverse cumsum, ``0`` returns ``x``.
    """
    x_TB = jnp.swapaxes(x_BT, 0, 1)

    def step(carry_B, xt_B):
        carry_B = xt_B + discount * carry_B
        return carry_B, carry_B

    _, out_TB = jax.lax.scan(step, jnp.zeros(x_TB.shape[1:], x_TB.dtype), x_TB, reverse=True)
    return jnp.swapaxes(out_TB, 0, 1)


def group_advantages(reward_B: Array, group_size: int = 1, eps: float = 1e-6) -> Array:
    """Per-row advantage from task rewards.

    group_size > 1 (GRPO): rows are grouped consecutively in blocks of ``group_size`` (B must be divisible) and
    adv_b = (r_b - mean_g r) / (std_g r + eps), population std (ddof=0).
    group_size = 1: batch-mean baseline, adv_b = r_b - mean_b r (not std-normalised).
    """
    r = jnp.asarray(reward_B)
    r = r.astype(float_dtype(r))
    if group_size == 1:
        return r - jnp.mean(r)
    r_GN = r.reshape(-1, group_size)
    mean = jnp.mean(r_GN, axis=1, keepdims=True)
    std = jnp.std(r_GN, axis=1, keepdims=True)
    return ((r_GN - mean) / (std + eps)).reshape(r.shape)


# ----------------------------------------------------------------------------------------------------- losses


@register_loss("reverse_kl_sampled", needs=frozenset({"teacher_logp"}))
def reverse_kl_sampled(
    student_logp_BT, student_logprobs_BTV, batch, *, correction: Correction | None = None, discount: float = 0.0,
    baseline: str = "batch",
) -> tuple[Array, Metrics]:
    """Sampled-token reverse KL as a per-token advantage (the common OPD recipe).

    Default ``baseline="batch"`` (the library's and the CLI's one default): without it the sampled estimator's
    variance stalls OPD on a plateau; ``baseline="none"`` is the textbook estimator below.

    d_t = teacher_logp_t - student_logp_t (0 off the mask);  A_t = sg(d_t), or with ``discount`` γ ∈ (0, 1]
    A_t = sg(Σ_{s≥t} γ^{s-t} d_s) within each row (see :func:`discounted_returns`).
    ``baseline="batch"`` subtracts the masked batch mean of A (a constant, so the gradient stays unbiased:
    E_S[b ∇log S] = 0) — it removes the large common negative offset of A and with it most of the variance.
    loss = -Σ_t w_t (A_t - b) student_logp_t / max(Σ mask, 1).

    On the student's own samples E[∇loss] = ∇KL(S‖T) per position (γ = 0, no correction), since
    E_S[(log T - log S) ∇log S] = -∇ Σ_v S(v)(log S(v) - log T(v)).

    Metrics: ``loss``; ``teacher_kl`` = masked mean of (student_logp - teacher_logp), the sampled estimate of
    KL(S‖T); ``adv_mean``, ``adv_std`` (masked, of A); plus ``corr/...``.
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"loss 'reverse_kl_sampled': discount must be in [0, 1], got {discount}")
    if baseline not in ("none", "batch"):
        raise ValueError(f"loss 'reverse_kl_sampled': baseline must be 'none' or 'batch', got {baseline!r}")
    m = _mask(batch)
    dt = float_dtype(student_logp_BT, _get(batch, "teacher_logp_BT"))
    s = jnp.where(m, jnp.asarray(student_logp_BT, dt), 0)
    t = jnp.where(m, jnp.asarray(_get(batch, "teacher_logp_BT"), dt), 0)
    d = jax.lax.stop_gradient(t - s)
    adv = discounted_returns(d, discount) if discount > 0 else d
    if baseline == "batch":
        adv = jnp.where(m, adv - masked_mean(adv, m), 0)
    w, corr_metrics = _weights(correction, student_logp_BT, batch, m, dt)
    loss = -_reduce(w, adv * s, m)
    metrics = {
        "loss": loss,
        "teacher_kl": masked_mean(-d, m),
        "adv_mean": masked_mean(adv, m),
        "adv_std": _masked_std(adv, m),
    }
    return loss, metrics | corr_metrics


@register_loss("forward_kl_topk", needs=frozenset({"teacher_topk", "student_logprobs"}))
def forward_kl_topk(
    student_logp_BT, student_logprobs_BTV, batch, *, correction: Correction | None = None, tail: bool = False
) -> tuple[Array, Metrics]:
    """Forward KL(T‖S) restricted to the teacher's top-k support K_t at each position.

    ℓ_t = Σ_{v∈K_t} T(v) (log T(v) - log S(v)), with T(v) = exp(teacher_topk_logp) (full-vocabulary normalised).
    tail=True adds the bucket of everything outside K_t:
        + T_tail (log T_tail - log S_tail),  T_tail = 1 - Σ_K T,  S_tail = 1 - Σ_K S,
    with T_tail < 1e-6 counting as 0 and S_tail clamped to ≥ 1e-6 (log1p for precision). With k = V the plain
    term is the exact forward KL and the tail term vanishes.
    loss = Σ_t w_t ℓ_t / max(Σ mask, 1).

    Metrics: ``loss``, ``forward_kl`` (masked mean of ℓ, unweighted), ``teacher_topk_mass`` = mean Σ_K T,
    ``student_topk_mass`` = mean Σ_K S; plus ``corr/...``.
    """
    m = _mask(batch)
    dt = float_dtype(student_logprobs_BTV, _get(batch, "teacher_topk_logp_BTK"))
    ls_BTV = jax.nn.log_softmax(jnp.asarray(student_logprobs_BTV, dt), axis=-1)
    ids_BTK = jnp.asarray(_get(batch, "teacher_topk_ids_BTK")).astype(jnp.int32)
    lt_BTK = jnp.asarray(_get(batch, "teacher_topk_logp_BTK"), dt)
    ls_BTK = jnp.take_along_axis(ls_BTV, ids_BTK, axis=-1)
    ell = _kl_last(lt_BTK, ls_BTK)
    t_mass = jnp.sum(jnp.exp(lt_BTK), axis=-1)
    s_mass = jnp.sum(jnp.exp(ls_BTK), axis=-1)
    if tail:
        t_tail = jnp.clip(1 - t_mass, 0, 1)
        has_tail = t_tail >= _TAIL_EPS
        log_t_tail = jnp.log(jnp.maximum(t_tail, _TAIL_EPS))
        log_s_tail = jnp.log1p(-jnp.minimum(s_mass, 1 - _TAIL_EPS))
        ell = ell + jnp.where(has_tail, t_tail * (log_t_tail - log_s_tail), 0)
    w, corr_metrics = _weights(correction, student_logp_BT, batch, m, dt)
    loss = _reduce(w, ell, m)
    metrics = {
        "loss": loss,
        "forward_kl": masked_mean(ell, m),
        "teacher_topk_mass": masked_mean(t_mass, m),
        "student_topk_mass": masked_mean(s_mass, m),
    }
    return loss, metrics | corr_metrics


@register_loss("jsd", needs=frozenset({"teacher_logits", "student_logprobs"}))
def jsd(
    student_logp_BT,
    student_logprobs_BTV,
    batch,
    *,
    correction: Correction | None = None,
    beta: float = 0.5,
    normalize: bool = False,
) -> tuple[Array, Metrics]:
    """Generalised Jensen–Shannon divergence over the full vocabulary (TRL GKD convention).

    With S = softmax(student), T = softmax(teacher_logits) and M = β T + (1-β) S at each position:
        β = 0:      ℓ = KL(T‖S)                      (forward KL)
        β = 1:      ℓ = KL(S‖T)                      (reverse KL)
        0 < β < 1:  ℓ = β KL(T‖M) + (1-β) KL(S‖M)    (β = ½ is the ordinary JSD)
    This is TRL's ``generalized_jsd_loss``. The interior formula tends to 0 at both ends, so the endpoints are
    defined explicitly (as in TRL) and ℓ jumps there. ``normalize=True`` divides the interior by β(1-β), which
    makes ℓ continuous in β: ℓ → KL(T‖S) as β → 0 and → KL(S‖T) as β → 1 (to first order).
    loss = Σ_t w_t ℓ_t / max(Σ mask, 1).

    Metrics: ``loss``, ``jsd`` (masked mean of ℓ, unweighted), ``teacher_kl`` (masked mean of the exact
    KL(S‖T)); plus ``corr/...``.
    """
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"loss 'jsd': beta must be in [0, 1], got {beta}")
    m = _mask(batch)
    dt = float_dtype(student_logprobs_BTV, _get(batch, "teacher_logits_BTV"))
    ls = jax.nn.log_softmax(jnp.asarray(student_logprobs_BTV, dt), axis=-1)
    lt = jax.nn.log_softmax(jnp.asarray(_get(batch, "teacher_logits_BTV"), dt), axis=-1)
    reverse = _kl_last(ls, lt)
    if beta == 0.0:
        ell = _kl_last(lt, ls)
    elif beta == 1.0:
        ell = reverse
    else:
        lm = jnp.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))
        ell = beta * _kl_last(lt, lm) + (1 - beta) * _kl_last(ls, lm)
        if normalize:
            ell = ell / (beta * (1 - beta))
    w, corr_metrics = _weights(correction, student_logp_BT, batch, m, dt)
    loss = _reduce(w, ell, m)
    metrics = {"loss": loss, "jsd": masked_mean(ell, m), "teacher_kl": masked_mean(reverse, m)}
    return loss, metrics | corr_metrics


@register_loss("reinforce", needs=frozenset({"reward"}))
def reinforce(
    student_logp_BT,
    student_logprobs_BTV,
    batch,
    *,
    correction: Correction | None = None,
    group_size: int = 1,
    eps: float = 1e-6,
) -> tuple[Array, Metrics]:
    """REINFORCE / GRPO-style policy gradient on the task reward (the RL baseline for stability comparisons).

    adv_b from :func:`group_advantages` (group-normalised when ``group_size`` > 1, else batch-mean baseline),
    stop-gradient;  loss = -Σ_{b,t} w_t adv_b student_logp_t / max(Σ mask, 1).

    Metrics: ``loss``, ``reward_mean``, ``adv_std`` (std of adv over rows); plus ``corr/...``.
    """
    B = np.shape(student_logp_BT)[0]
    if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"loss 'reinforce': group_size must be a positive int, got {group_size!r}")
    if B % group_size:
        raise ValueError(f"loss 'reinforce': batch size {B} is not divisible by group_size {group_size}")
    m = _mask(batch)
    dt = float_dtype(student_logp_BT, _get(batch, "reward_B"))
    s = jnp.where(m, jnp.asarray(student_logp_BT, dt), 0)
    r = jnp.asarray(_get(batch, "reward_B"), dt)
    adv_B = jax.lax.stop_gradient(group_advantages(r, group_size, eps))
    w, corr_metrics = _weights(correction, student_logp_BT, batch, m, dt)
    loss = -_reduce(w, adv_B[:, None] * s, m)
    metrics = {"loss": loss, "reward_mean": jnp.mean(r), "adv_std": jnp.std(adv_B)}
    return loss, metrics | corr_metrics


@register_loss("sft", needs=frozenset())
def sft(student_logp_BT, student_logprobs_BTV, batch, *, correction: Correction | None = None) -> tuple[Array, Metrics]:
    """Supervised cross-entropy on the masked tokens (used to prepare the built-in teacher and student).

    loss = -Σ_t w_t student_logp_t / max(Σ mask, 1). Metrics: ``loss``, ``target_prob`` = masked mean of
    exp(student_logp) (the mean probability of the target token).
    """
    m = _mask(batch)
    dt = float_dtype(student_logp_BT)
    s = jnp.where(m, jnp.asarray(student_logp_BT, dt), 0)
    w, corr_metrics = _weights(correction, student_logp_BT, batch, m, dt)
    loss = -_reduce(w, s, m)
    return loss, {"loss": loss, "target_prob": masked_mean(jnp.exp(s), m)} | corr_metrics

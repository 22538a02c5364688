"""The learner: TrainState, a jitted sharded train step on one `core.types.Batch`, the student's token log-probs.

Batch layout (arrays [B, T] on one padded time axis): position t of every `*_logp_BT` is the log-prob of
`tokens_BT[:, t]` given the tokens before it; the learner computes its own from logits at t-1. The step works on
`(graphdef, params)`; the state is donated and its shardings are explicit. The optimizer is any optax transform
(`make_optimizer` builds the default AdamW with warm-up, schedule and clipping).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from opdjax.core import corrections, losses, mismatch
from opdjax.core.logprobs import chunked_token_logprobs, token_logprobs
from opdjax.core.types import Batch
from opdjax.learner.adapters import CausalLMAdapter, DecoderAdapter
from opdjax.models.sharding import batch_sharding, shard_state

Array = jax.Array

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: Array          # int32 scalar: optimizer steps taken (= weight version)
    params: Any          # nnx.State of the student
    opt_state: Any       # optax state


def make_schedule(lr: float, total_steps: int, warmup_steps: int = 0, kind: str = "constant") -> optax.Schedule:
    """Linear warm-up from 0 to lr over warmup_steps, then constant / cosine / linear decay to 0.1 * lr."""
    decay_steps = max(total_steps - warmup_steps, 1)
    if kind == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps, alpha=0.1)
    elif kind == "linear":
        after = optax.linear_schedule(lr, 0.1 * lr, decay_steps)
    elif kind == "constant":
        after = optax.constant_schedule(lr)
    else:
        raise ValueError(f"unknown schedule {kind!r}; choose constant, cosine or linear")
    if warmup_steps <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps])


def make_optimizer(*, lr: float, total_steps: int, schedule: str = "constant", warmup_steps: int = 0,
                   grad_clip: float = 0.0, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(AdamW with a warm-up + `schedule` learning rate and global-norm gradient clipping, the lr schedule).

    The pipeline passes `config.OptimConfig`'s fields (the one source of the training defaults).
    """
    sched = make_schedule(lr, total_steps, warmup_steps, schedule)
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay))
    return optax.chain(*parts), sched


def to_global(batch: Batch, mesh: Mesh) -> Batch:
    """Host arrays -> global arrays on the mesh; None stays None.

    Several processes: each passes its own rows; the global batch is their concatenation in process order. The
    rows are gathered to every host first (a few small integer/float arrays), so any sharding is correct, including
    a batch whose rows do not divide over the mesh (it is then replicated, and every replica must hold the same rows).
    """
    if jax.process_count() == 1:
        return jax.tree.map(lambda v: jax.make_array_from_process_local_data(batch_sharding(mesh, np.shape(v)),
                                                                             np.asarray(v)), batch)

    def one(v):
        full = np.asarray(multihost_utils.process_allgather(np.asarray(v), tiled=True))
        return jax.make_array_from_callback(full.shape, batch_sharding(mesh, full.shape), lambda idx: full[idx])
    return jax.tree.map(one, batch)


class Learner:
    """Owns the jitted train step for one student, loss and optimizer on one mesh.

    graphdef       the student's NNX graph (`nnx.split(model)`); any causal LM the `adapter` reads
    loss           a registered loss name (`core.losses.LOSSES`); `needs` says what teacher data it wants
    temperature    the sampling temperature of the rollouts it trains on (log-probs use logits / T); a step may
                   override it (`train_step(..., temperature=)`, traced: no recompile)
    micro_batches  k > 1 accumulates gradients over k micro-batches of B / k rows (rows b ≡ m mod k form micro-batch
                   m): one optimizer step, the same result as one batch of B rows (see `_grads_accumulated`)
    adapter        how to read the model (`learner.adapters`; default: opdjax's `Decoder`)
    track_movement log `policy/step_k3`, the student's movement per step (`step_movement_k3`; one more forward)
    trim_padding   step on the batch cut after its last real position, rounded up to a `length_bucket`
                   (`trim_padding`; one process only): trailing all-padding columns cost compute and change
                   nothing but float rounding. Off by default: it pays only when every row stops well short of
                   the batch width (docs/results/long-responses.md); each new bucket compiles a step
    """

    def __init__(self, graphdef: nnx.GraphDef, *, loss: str = losses.DEFAULT_LOSS,
                 loss_options: Mapping[str, Any] | None = None, correction: corrections.Correction | None = None,
                 tx: optax.GradientTransformation | None = None, schedule: optax.Schedule | None = None,
                 temperature: float = 1.0, mesh: Mesh | None = None, logprob_chunk: int = 0,
                 micro_batches: int = 1, adapter: CausalLMAdapter | None = None, track_movement: bool = False,
                 trim_padding: bool = False):
        self.graphdef = graphdef
        self.loss_name = loss
        self.loss_fn = losses.get_loss(loss)
        self.needs = losses.loss_needs(loss)
        self.loss_options = dict(loss_options or {})
        self.correction = correction
        self.temperature = _check_temperature(temperature)
        self.micro_batches = _check_micro_batches(micro_batches, self.needs, correction)
        self.adapter = adapter if adapter is not None else DecoderAdapter()
        self.track_movement = bool(track_movement)
        self.trim_padding = bool(trim_padding)
        self.logprob_chunk = int(logprob_chunk) or None  # 0: `logprob_chunk_len` picks
        self.mesh = mesh if mesh is not None else Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1),
                                                        ("data", "fsdp", "tensor"))
        self.tx = tx  # None: the learner only scores (`logp`); `train_step` needs an optimizer
        self.schedule = schedule if schedule is not None else (lambda step: jnp.float32(jnp.nan))
        self._steps: dict[bool, Any] = {}
        self._logp = None
        self.state_shardings = None

    # -- state ---------------------------------------------------------------------------------------------------
    def init(self, params: nnx.State) -> TrainState:
        """A sharded TrainState (step 0) from params; optimizer moments get the params' shardings."""
        # A private copy: the step donates its state, and the caller's params must stay valid.
        params = jax.jit(lambda t: jax.tree.map(jnp.copy, t))(shard_state(params, self.mesh))
        rep = NamedSharding(self.mesh, P())
        opt_state = jax.tree.map(  # moments follow the params; counters and scalars are replicated on the mesh
            lambda x: x if x.sharding.device_set == rep.device_set else jax.device_put(x, rep),
            jax.jit(self.tx.init)(params) if self.tx is not None else ())
        state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), rep),
                           params=params, opt_state=opt_state)
        self.state_shardings = jax.tree.map(lambda x: x.sharding, state)
        return state

    # -- step ------------------------------------------------------------------------------------------------------
    def _student_logp(self, params, tokens_BT, valid_BT, temperature, full: bool):
        """(logp_BT, full shifted log-softmax [B, T, V] or None). Without `full`, and when the adapter splits off
        the output projection, the log-probs come from hidden states in chunks (`chunked_token_logprobs`): the
        [B, T, V] logits are never materialised."""
        model = nnx.merge(self.graphdef, params)
        split = None if full else self.adapter.hidden(model, tokens_BT, valid_BT)
        if split is None:
            return token_logprobs(self.adapter.logits(model, tokens_BT, valid_BT), tokens_BT, temperature, full)
        h_BTE, w_EV = split
        return chunked_token_logprobs(h_BTE, w_EV, tokens_BT, temperature, self.logprob_chunk), None

    def _loss(self, logp_BT, logprobs_BTV, batch: Batch):
        return self.loss_fn(logp_BT, logprobs_BTV, batch, correction=self.correction, **self.loss_options)

    def _grads_whole(self, params, batch: Batch, temperature):
        """(loss, metrics, logp_BT, grads) of the loss on the whole batch in one pass."""
        full = "student_logprobs" in self.needs

        def objective(p):
            logp_BT, logprobs_BTV = self._student_logp(p, batch.tokens_BT, batch.valid_BT, temperature, full)
            loss, m = self._loss(logp_BT, logprobs_BTV, batch)
            return loss, (m, logp_BT)

        (loss, (m, logp_BT)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return loss, m, logp_BT, grads

    def _grads_accumulated(self, params, batch: Batch, temperature):
        """(loss, metrics, logp_BT, grads) over `micro_batches` micro-batches, equal to `_grads_whole`.

        Losses of log-probs only (two passes, exact for any batch-level statistic such as a batch baseline):
        logp_BT by micro-batch without gradients; g_BT = ∂loss/∂logp_BT on the whole batch; then
        grads = Σ_m vjp(logp_m(θ), g_m). Losses of the full log-softmax (token sums): each micro-batch's loss
        weighted by its share of the masked tokens, max(n_m, 1) / max(N, 1), so Σ_m = the whole batch's loss.
        """
        if "student_logprobs" in self.needs:
            return _accumulate_token_sums(self, params, batch, temperature)
        return _accumulate_two_pass(self, params, batch, temperature)

    def _build_step(self, with_rollout: bool):
        grads_fn = self._grads_whole if self.micro_batches == 1 else self._grads_accumulated

        def step(state: TrainState, batch: Batch, temperature):
            loss, m, logp_BT, grads = grads_fn(state.params, batch, temperature)
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {**m, "loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(state.step)}
            if self.track_movement:
                metrics["policy/step_k3"] = step_movement_k3(self, params, batch, logp_BT, temperature)
            if with_rollout:  # mismatch metrics only when the engine's log-probs came with the batch
                mm = mismatch.metrics(jax.lax.stop_gradient(logp_BT), batch.rollout_logp_BT, batch.mask_BT)
                metrics.update({f"mismatch/{k}": v for k, v in mm.items()})
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

        rep = NamedSharding(self.mesh, P())
        return jax.jit(step, in_shardings=(self.state_shardings, None, None),
                       out_shardings=(self.state_shardings, rep), donate_argnums=0)

    def train_step(self, state: TrainState, batch: Batch | Mapping[str, np.ndarray], *,
                   temperature: float | None = None) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step on a host batch (a Batch, or a dict of its fields); returns the new state and scalar
        metrics (host floats). `rollout_logp_BT` is optional: with it the metrics include `mismatch/*` (and a
        correction can use it); `temperature` overrides the learner's for this step."""
        batch = Batch.from_mapping(batch, where="train_step")
        batch.require(("tokens_BT", "valid_BT", "mask_BT"), where="train_step")
        if self.tx is None:
            raise ValueError("train_step: this Learner has no optimizer (tx=None scores only); pass tx=, e.g. "
                             "learner.make_optimizer(lr=..., total_steps=...)")
        _check_divides(np.shape(batch.tokens_BT)[0], self.micro_batches)
        t = self.temperature if temperature is None else _check_temperature(temperature)
        with_rollout = batch.rollout_logp_BT is not None
        if self.trim_padding and jax.process_count() == 1:  # several processes: each sees only its own rows
            batch = trim_padding(batch)
        if with_rollout not in self._steps:
            self._steps[with_rollout] = self._build_step(with_rollout)
        state, metrics = self._steps[with_rollout](state, to_global(batch, self.mesh), jnp.float32(t))
        return state, {k: float(v) for k, v in jax.device_get(metrics).items()}

    def logp(self, params: nnx.State, tokens_BT: np.ndarray, valid_BT: np.ndarray,
             temperature: float | None = None) -> np.ndarray:
        """The student's log-prob of each token (learner numerics: no quantization, no noise)."""
        if self._logp is None:
            def fn(params, tokens, valid, temperature):
                return self._student_logp(params, tokens, valid, temperature, False)[0]

            self._logp = jax.jit(fn)
        g = to_global(Batch(mask_BT=None, tokens_BT=tokens_BT, valid_BT=valid_BT), self.mesh)
        t = self.temperature if temperature is None else temperature
        return np.asarray(jax.device_get(self._logp(params, g.tokens_BT, g.valid_BT, t)))


# -- padding ------------------------------------------------------------------------------------------------------------

def length_bucket(n: int, per_octave: int = 4, minimum: int = 16) -> int:
    """n rounded up to a bucket: a multiple of 2^(floor(log2 n) - log2 per_octave), i.e. `per_octave` buckets per
    doubling (per_octave a power of two; with 4: ..., 512, 640, 768, 896, 1024, 1280, ...), at least `minimum`;
    at most 1 / per_octave of the bucket is padding and a run compiles at most per_octave shapes per doubling."""
    n = max(int(n), int(minimum), 1)
    step = max(1, (1 << (n.bit_length() - 1)) // per_octave)
    return -(-n // step) * step


def trim_padding(batch: Batch, per_octave: int = 4) -> Batch:
    """The batch with every [B, T, ...] field (name with `_BT`) cut to T' = min(T, length_bucket(t_last + 1))
    columns, t_last the last position any row has valid or in its mask: the columns cut are padding in every row,
    which a causal model never attends to from a real position and every loss masks out. A batch with no valid
    position is returned unchanged."""
    used_T = np.any(np.asarray(batch.valid_BT, bool), axis=0) | np.any(np.asarray(batch.mask_BT) != 0, axis=0)
    T = used_T.shape[0]
    if not used_T.any():
        return batch
    keep = min(T, length_bucket(int(np.flatnonzero(used_T)[-1]) + 1, per_octave))
    if keep == T:
        return batch
    cut = {f: v[:, :keep] for f, v in batch.present().items() if "_BT" in f}
    return dataclasses.replace(batch, **cut)


# -- checks and gradient accumulation ----------------------------------------------------------------------------------

def _check_temperature(t: float) -> float:
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"learner temperature must be finite and > 0 (the rollouts' sampling temperature; 1.0 for "
                         f"greedy rollouts, whose log-probs are reported at T = 1), got {t}")
    return float(t)


def _check_micro_batches(k: int, needs: frozenset[str], correction) -> int:
    """k as an int >= 1; refused where accumulation could not equal one batch (a full-log-softmax loss with a
    correction normalised over the batch)."""
    if int(k) != k or k < 1:
        raise ValueError(f"micro_batches must be an integer >= 1, got {k}")
    if k > 1 and "student_logprobs" in needs and correction is not None and correction.normalize:
        raise ValueError("micro_batches > 1 with a full-log-softmax loss and correction.normalize=true: the "
                         "batch-normalised weights cannot be accumulated exactly; use micro_batches=1 or "
                         "normalize=false")
    return int(k)


def _check_divides(B: int, k: int) -> None:
    if B % k:
        raise ValueError(f"train_step: a batch of {B} rows does not split into micro_batches={k} equal "
                         f"micro-batches; use a batch size that is a multiple of {k}")


def micro_split(x, k: int):
    """[B, ...] -> [k, B/k, ...], micro-batch m = rows b with b % k == m (a row-sharded batch stays local)."""
    return None if x is None else jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def micro_join(x_k):
    """Inverse of `micro_split`: [k, B/k, ...] -> [B, ...]."""
    return jnp.swapaxes(x_k, 0, 1).reshape(-1, *x_k.shape[2:])


def logp_by_micro_batch(learner: Learner, params, batch: Batch, temperature):
    """logp_BT of the whole batch, computed one micro-batch at a time (no gradients kept)."""
    k = learner.micro_batches
    if k == 1:
        return learner._student_logp(params, batch.tokens_BT, batch.valid_BT, temperature, False)[0]

    def one(carry, xs):
        return carry, learner._student_logp(params, *xs, temperature, False)[0]

    _, logp_k = jax.lax.scan(one, None, (micro_split(batch.tokens_BT, k), micro_split(batch.valid_BT, k)))
    return micro_join(logp_k)


def step_movement_k3(learner: Learner, new_params, batch: Batch, old_logp_BT, temperature):
    """The student's movement in one step: k3 estimate of KL(π_old ‖ π_new) on the batch's sampled tokens (drawn
    from ≈ π_old), on the same scale as the mismatch k3. r = clip(logp_new − logp_old, ±20);
    k3 = Σ mask·(e^r − r − 1) / max(Σ mask, 1)."""
    new_BT = logp_by_micro_batch(learner, jax.lax.stop_gradient(new_params), batch, temperature)
    r_BT = mismatch.log_ratio(new_BT, jax.lax.stop_gradient(old_logp_BT))
    return mismatch.masked_mean(mismatch.estimator_terms(r_BT, "k3"), jnp.asarray(batch.mask_BT, bool))


def _accumulate_two_pass(learner: Learner, params, batch: Batch, temperature):
    """Exact accumulation for losses of logp_BT only (see `Learner._grads_accumulated`)."""
    k = learner.micro_batches
    tok_k, val_k = micro_split(batch.tokens_BT, k), micro_split(batch.valid_BT, k)

    def logp(p, tok, val):
        return learner._student_logp(p, tok, val, temperature, False)[0]

    logp_BT = logp_by_micro_batch(learner, params, batch, temperature)
    (loss, m), g_BT = jax.value_and_grad(lambda lp: learner._loss(lp, None, batch), has_aux=True)(logp_BT)

    def backward(acc, xs):
        tok, val, g = xs
        _, vjp = jax.vjp(lambda p: logp(p, tok, val), params)
        return jax.tree.map(jnp.add, acc, vjp(g)[0]), None

    grads, _ = jax.lax.scan(backward, jax.tree.map(jnp.zeros_like, params), (tok_k, val_k, micro_split(g_BT, k)))
    return loss, m, logp_BT, grads


def _accumulate_token_sums(learner: Learner, params, batch: Batch, temperature):
    """Accumulation for full-log-softmax losses, which are token sums: Σ_m loss_m · max(n_m, 1) / max(N, 1)."""
    k = learner.micro_batches
    micro = jax.tree.map(lambda x: micro_split(x, k), batch)
    n_total = jnp.maximum(jnp.sum(jnp.asarray(batch.mask_BT, jnp.float32)), 1.0)

    def one(acc, mb: Batch):
        share = jnp.maximum(jnp.sum(jnp.asarray(mb.mask_BT, jnp.float32)), 1.0) / n_total

        def objective(p):
            logp_BT, logprobs_BTV = learner._student_logp(p, mb.tokens_BT, mb.valid_BT, temperature, True)
            loss, m = learner._loss(logp_BT, logprobs_BTV, mb)
            return loss * share, (m, logp_BT)

        (loss, (m, logp_BT)), g = jax.value_and_grad(objective, has_aux=True)(params)
        grads, total = acc
        return (jax.tree.map(jnp.add, grads, g), total + loss), (logp_BT, m, share)

    init = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0))
    (grads, loss), (logp_k, m_k, share_k) = jax.lax.scan(one, init, micro)
    m = jax.tree.map(lambda v: jnp.tensordot(share_k, v, axes=1), m_k)  # token-share weighted means
    return loss, m, micro_join(logp_k), grads

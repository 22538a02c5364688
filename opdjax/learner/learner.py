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
    """Owns the jitted train step for one student, loss and optimizer on one mesh."""

    def __init__(self, graphdef: nnx.GraphDef, *, loss: str = "reverse_kl_sampled",
                 loss_options: Mapping[str, Any] | None = None, correction: corrections.Correction | None = None,
                 tx: optax.GradientTransformation | None = None, schedule: optax.Schedule | None = None,
                 temperature: float = 1.0, mesh: Mesh | None = None, logprob_chunk: int = 0):
        self.graphdef = graphdef
        self.loss_name = loss
        self.loss_fn = losses.get_loss(loss)
        self.needs = losses.loss_needs(loss)
        self.loss_options = dict(loss_options or {})
        self.correction = correction
        self.temperature = float(temperature)
        self.logprob_chunk = int(logprob_chunk) or None  # 0: `logprob_chunk_len` picks
        self.mesh = mesh if mesh is not None else Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1),
                                                        ("data", "fsdp", "tensor"))
        self.tx = tx  # None: the learner only scores (`logp`); `train_step` needs an optimizer
        self.schedule = schedule if schedule is not None else (lambda step: jnp.float32(jnp.nan))
        self._step = None
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
        """(logp_BT, full shifted log-softmax [B, T, V] or None). Without `full` the log-probs come from the hidden
        states in chunks (`chunked_token_logprobs`): the [B, T, V] logits are never materialised."""
        model = nnx.merge(self.graphdef, params)
        if full:
            logits, _ = model(tokens_BT, valid_BT=valid_BT)
            return token_logprobs(logits, tokens_BT, temperature, True)
        h, _ = model(tokens_BT, valid_BT=valid_BT, return_hidden=True)
        return chunked_token_logprobs(h, model.lm_head_kernel(), tokens_BT, temperature, self.logprob_chunk), None

    def _build_step(self):
        full = "student_logprobs" in self.needs

        def step(state: TrainState, batch: Batch):
            def objective(params):
                logp_BT, logprobs_BTV = self._student_logp(params, batch.tokens_BT, batch.valid_BT,
                                                           self.temperature, full)
                loss, m = self.loss_fn(logp_BT, logprobs_BTV, batch, correction=self.correction,
                                       **self.loss_options)
                return loss, (m, logp_BT)

            (loss, (m, logp_BT)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {**m, "loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(state.step)}
            mm = mismatch.metrics(jax.lax.stop_gradient(logp_BT), batch.rollout_logp_BT, batch.mask_BT)
            metrics.update({f"mismatch/{k}": v for k, v in mm.items()})
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

        rep = NamedSharding(self.mesh, P())
        return jax.jit(step, in_shardings=(self.state_shardings, None), out_shardings=(self.state_shardings, rep),
                       donate_argnums=0)

    def train_step(self, state: TrainState, batch: Batch | Mapping[str, np.ndarray]
                   ) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step on a host batch (a Batch, or a dict of its fields); returns the new state and scalar
        metrics (host floats)."""
        batch = Batch.from_mapping(batch, where="train_step")
        batch.require(("tokens_BT", "valid_BT", "mask_BT", "rollout_logp_BT"), where="train_step")
        if self.tx is None:
            raise ValueError("train_step: this Learner has no optimizer (tx=None scores only); pass tx=, e.g. "
                             "learner.make_optimizer(lr=..., total_steps=...)")
        if self._step is None:
            self._step = self._build_step()
        state, metrics = self._step(state, to_global(batch, self.mesh))
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

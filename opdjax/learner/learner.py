"""The learner: TrainState, a jitted sharded train step, the student's token log-probs, orbax checkpoints.

Batch layout (arrays [B, L] on one padded time axis, see `opdjax.rollout.RolloutBatch`): position l of every
`*_logp_BL` is the log-prob of `tokens_BL[:, l]` given the tokens before it; the learner computes its own from
logits at l-1. The step works on `(graphdef, params)`; the state is donated and its shardings are explicit.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from opdjax.core import losses, mismatch
from opdjax.core.logprobs import chunked_token_logprobs, token_logprobs
from opdjax.models.sharding import batch_sharding, shard_state

Array = jax.Array

# Batch fields the step reads; rows are split over (data, fsdp).
BATCH_FIELDS = ("tokens_BL", "valid_BL", "completion_mask_BL", "rollout_logp_BL", "teacher_logp_BL",
                "teacher_topk_ids_BLK", "teacher_topk_logp_BLK", "teacher_logits_BLV", "reward_B")


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


def make_optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with the configured schedule and global-norm gradient clipping (`optim` is an OptimConfig)."""
    schedule = make_schedule(optim.lr, total_steps, optim.warmup_steps, optim.schedule)
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay))
    return optax.chain(*parts), schedule


def to_global(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, Array]:
    """Host arrays -> global arrays on the mesh (each process contributes its local rows)."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.shape(v)), np.asarray(v))
            for k, v in batch.items()}


class Learner:
    """Owns the jitted train step for one student, loss and optimizer on one mesh."""

    def __init__(self, graphdef: nnx.GraphDef, *, loss: str = "reverse_kl_sampled",
                 loss_options: Mapping[str, Any] | None = None, correction: mismatch.Correction | None = None,
                 optim=None, total_steps: int = 100, temperature: float = 1.0, mesh: Mesh | None = None,
                 logprob_chunk: int = 0):
        from opdjax.config import OptimConfig

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
        self.tx, self.schedule = make_optimizer(optim or OptimConfig(), total_steps)
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
            jax.jit(self.tx.init)(params))
        state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), rep),
                           params=params, opt_state=opt_state)
        self.state_shardings = jax.tree.map(lambda x: x.sharding, state)
        return state

    # -- step ------------------------------------------------------------------------------------------------------
    def _loss_inputs(self, batch: Mapping[str, Array]) -> losses.LossInputs:
        kw = dict(tokens_BT=batch["tokens_BL"], mask_BT=batch["completion_mask_BL"],
                  rollout_logp_BT=batch.get("rollout_logp_BL"), teacher_logp_BT=batch.get("teacher_logp_BL"),
                  teacher_topk_ids_BTK=batch.get("teacher_topk_ids_BLK"),
                  teacher_topk_logp_BTK=batch.get("teacher_topk_logp_BLK"),
                  teacher_logits_BTV=batch.get("teacher_logits_BLV"), reward_B=batch.get("reward_B"))
        return losses.LossInputs(**{k: v for k, v in kw.items() if v is not None})

    def _student_logp(self, params, tokens_BL, valid_BL, temperature, full: bool):
        """(logp_BL, full shifted log-softmax [B, L, V] or None). Without `full` the log-probs come from the hidden
        states in chunks (`chunked_token_logprobs`): the [B, L, V] logits are never materialised."""
        model = nnx.merge(self.graphdef, params)
        if full:
            logits, _ = model(tokens_BL, valid_BT=valid_BL)
            return token_logprobs(logits, tokens_BL, temperature, True)
        h, _ = model(tokens_BL, valid_BT=valid_BL, return_hidden=True)
        return chunked_token_logprobs(h, model.lm_head_kernel(), tokens_BL, temperature, self.logprob_chunk), None

    def _build_step(self):
        full = "student_logprobs" in self.needs

        def step(state: TrainState, batch: dict[str, Array]):
            inputs = self._loss_inputs(batch)

            def objective(params):
                logp_BL, logprobs_BLV = self._student_logp(params, batch["tokens_BL"], batch["valid_BL"],
                                                           self.temperature, full)
                loss, m = self.loss_fn(logp_BL, logprobs_BLV, inputs, correction=self.correction,
                                       **self.loss_options)
                return loss, (m, logp_BL)

            (loss, (m, logp_BL)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {**m, "loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(state.step)}
            mm = mismatch.metrics(jax.lax.stop_gradient(logp_BL), batch["rollout_logp_BL"],
                                  batch["completion_mask_BL"])
            metrics.update({f"mismatch/{k}": v for k, v in mm.items()})
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

        rep = NamedSharding(self.mesh, P())
        return jax.jit(step, in_shardings=(self.state_shardings, None), out_shardings=(self.state_shardings, rep),
                       donate_argnums=0)

    def train_step(self, state: TrainState, batch: Mapping[str, np.ndarray]) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step on a host batch; returns the new state and scalar metrics (host floats)."""
        missing = [k for k in ("tokens_BL", "valid_BL", "completion_mask_BL", "rollout_logp_BL") if k not in batch]
        if missing:
            raise ValueError(f"train_step: batch is missing {missing}")
        if self._step is None:
            self._step = self._build_step()
        unknown = [k for k in batch if k not in BATCH_FIELDS]
        if unknown:
            raise ValueError(f"train_step: unknown batch fields {unknown}; expected a subset of {BATCH_FIELDS}")
        state, metrics = self._step(state, to_global(batch, self.mesh))
        return state, {k: float(v) for k, v in jax.device_get(metrics).items()}

    def logp(self, params: nnx.State, tokens_BL: np.ndarray, valid_BL: np.ndarray,
             temperature: float | None = None) -> np.ndarray:
        """The student's log-prob of each token (learner numerics: no quantization, no noise)."""
        if self._logp is None:
            def fn(params, tokens, valid, temperature):
                return self._student_logp(params, tokens, valid, temperature, False)[0]

            self._logp = jax.jit(fn)
        g = to_global({"tokens_BL": tokens_BL, "valid_BL": valid_BL}, self.mesh)
        t = self.temperature if temperature is None else temperature
        return np.asarray(jax.device_get(self._logp(params, g["tokens_BL"], g["valid_BL"], t)))


# -- checkpoints ----------------------------------------------------------------------------------------------------


def save_checkpoint(directory: str | pathlib.Path, state: TrainState, extra: Mapping[str, Any],
                    max_to_keep: int = 2) -> None:
    """Save the full TrainState (orbax, sharded) plus JSON `extra` (pipeline/data position) under step N."""
    import orbax.checkpoint as ocp

    step = int(jax.device_get(state.step))
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    with ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=opts) as mngr:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_as_tree(state)),
                                                extra=ocp.args.JsonSave(dict(extra))), force=True)
        mngr.wait_until_finished()


def latest_step(directory: str | pathlib.Path) -> int | None:
    import orbax.checkpoint as ocp

    p = pathlib.Path(directory).absolute()
    if not p.exists():
        return None
    with ocp.CheckpointManager(p) as mngr:
        return mngr.latest_step()


def restore_checkpoint(directory: str | pathlib.Path, like: TrainState,
                       step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
    """Restore the latest (or given) step into arrays with the shardings of `like`."""
    import orbax.checkpoint as ocp

    p = pathlib.Path(directory).absolute()
    with ocp.CheckpointManager(p) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {p}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _as_tree(like))
        out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                         extra=ocp.args.JsonRestore()))
    restored = out["state"]
    # Orbax hands back plain containers; put the leaves back into the live structure (nnx Variables, optax tuples).
    state = TrainState(**{k: jax.tree.unflatten(jax.tree.structure(getattr(like, k)), jax.tree.leaves(restored[k]))
                          for k in ("step", "params", "opt_state")})
    return state, dict(out["extra"])


def _as_tree(state: TrainState) -> dict[str, Any]:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}

"""Gradient accumulation equals one batch; rollout log-probs are optional; a model that is not opdjax's Decoder
trains through `LogitsAdapter`.

Reference for accumulation: the same Learner with micro_batches=1 on the whole batch (its own numerics are checked
against materialised logits and transformers elsewhere); for the adapter, the loss recomputed by hand with
jax.nn.log_softmax on the model's logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from opdjax.core.corrections import Correction
from opdjax.learner import Learner, LogitsAdapter, make_optimizer
from opdjax.models import decoder
from opdjax.models.config import ModelConfig

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)
B, T, K = 8, 12, 4


def _batch(seed=0, with_rollout=True):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[::3, :2] = False  # left padding
    valid[1::4, -3:] = False  # a completion that stopped
    mask = valid.copy()
    mask[:, :5] = False
    mask[5] = False  # a row with nothing to train on
    lp = lambda: np.where(mask, -rng.random((B, T)) * 3, 0.0).astype(np.float32)  # noqa: E731
    top_ids = np.stack([rng.permutation(CFG.vocab_size)[:K] for _ in range(B * T)]).reshape(B, T, K).astype(np.int32)
    top_lp = np.log(rng.dirichlet(np.ones(K + 1), (B, T))[..., :K]).astype(np.float32)
    batch = {"tokens_BT": tokens, "valid_BT": valid, "mask_BT": mask, "teacher_logp_BT": lp(),
             "teacher_topk_ids_BTK": top_ids, "teacher_topk_logp_BTK": top_lp, "reward_B": rng.random(B).astype(np.float32)}
    if with_rollout:
        batch["rollout_logp_BT"] = lp()
    return batch


def _step(k, loss, correction=None, with_rollout=True, **options):
    graphdef, params = nnx.split(decoder.create(CFG, seed=3))
    learner = Learner(graphdef, loss=loss, loss_options=options, correction=correction, tx=optax.sgd(1.0),
                      micro_batches=k, temperature=0.9)  # SGD: the updated params are params - grads
    state = learner.init(params)
    state, m = learner.train_step(state, _batch(with_rollout=with_rollout))
    return m, state.params


@pytest.mark.parametrize("loss,correction,options", [
    ("reverse_kl_sampled", None, {}),                                   # the default: a batch-mean baseline
    ("reverse_kl_sampled", Correction("token_tis", cap=2.0, normalize=True), {}),  # batch-normalised weights
    ("reinforce", None, {"group_size": 2}),
    ("forward_kl_topk", Correction("token_tis", cap=2.0), {}),                 # full log-softmax: token sums
])
def test_k_micro_batches_equal_one_batch(loss, correction, options):
    m1, p1 = _step(1, loss, correction, **options)
    m4, p4 = _step(4, loss, correction, **options)
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=2e-5, atol=1e-6)  # the baselined loss is ~0
    np.testing.assert_allclose(m4["grad_norm"], m1["grad_norm"], rtol=2e-5)
    np.testing.assert_allclose(m4["mismatch/k3"], m1["mismatch/k3"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert m1["grad_norm"] > 0


def test_accumulation_refuses_what_it_cannot_make_exact():
    graphdef, _ = nnx.split(decoder.create(CFG, seed=3))
    with pytest.raises(ValueError, match="normalize"):
        Learner(graphdef, loss="forward_kl_topk", correction=Correction("token_tis", normalize=True), micro_batches=2)
    with pytest.raises(ValueError, match="integer >= 1"):
        Learner(graphdef, micro_batches=0)
    tx, _ = make_optimizer(lr=1e-2, total_steps=1)
    learner = Learner(graphdef, loss="reverse_kl_sampled", tx=tx, micro_batches=3)
    state = learner.init(nnx.split(decoder.create(CFG, seed=3))[1])
    with pytest.raises(ValueError, match="multiple of 3"):
        learner.train_step(state, _batch())
    with pytest.raises(ValueError, match="temperature"):
        Learner(graphdef, temperature=0.0)


def test_without_rollout_logprobs_there_are_no_mismatch_metrics():
    m, _ = _step(1, "sft", with_rollout=False)
    assert np.isfinite(m["loss"]) and not any(k.startswith("mismatch/") for k in m)
    with pytest.raises(ValueError, match="rollout_logp_BT"):  # a correction needs the engine's log-probs
        _step(1, "reverse_kl_sampled", Correction("token_tis", cap=2.0), with_rollout=False)


class Bigram(nnx.Module):
    """A causal LM that is not opdjax's Decoder: logits[t] = W[token t] (attends to nothing before t)."""

    def __init__(self, vocab: int, *, rngs: nnx.Rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (vocab, vocab)) * 0.1)

    def __call__(self, tokens_BT, valid_BT):
        return self.table[tokens_BT]


def test_a_model_of_your_own_trains_through_the_logits_adapter():
    graphdef, params = nnx.split(Bigram(CFG.vocab_size, rngs=nnx.Rngs(0)))
    batch = _batch()
    table = np.asarray(params["table"][...])
    lp = jax.nn.log_softmax(table[batch["tokens_BT"][:, :-1]] / 0.9, -1)
    logp_BT = np.pad(np.take_along_axis(np.asarray(lp), batch["tokens_BT"][:, 1:, None], -1)[..., 0], ((0, 0), (1, 0)))
    mask = batch["mask_BT"]
    want = -(logp_BT * mask).sum() / mask.sum()  # sft: mean negative log-likelihood of the masked tokens
    tx, sched = make_optimizer(lr=1e-1, total_steps=3)
    learner = Learner(graphdef, loss="sft", tx=tx, schedule=sched, adapter=LogitsAdapter(), temperature=0.9,
                      micro_batches=2)
    state = learner.init(params)
    state, m0 = learner.train_step(state, batch)
    np.testing.assert_allclose(m0["loss"], want, rtol=1e-5)
    for _ in range(2):
        state, m = learner.train_step(state, batch)
    assert m["loss"] < m0["loss"]


def test_step_movement_is_the_k3_between_consecutive_versions():
    """`policy/step_k3` = k3 estimate of KL(old ‖ new) on the batch's tokens, recomputed here from `Learner.logp`
    before and after the step (the same numbers the step saw)."""
    graphdef, params = nnx.split(decoder.create(CFG, seed=3))
    batch = _batch()
    for k in (1, 2):
        learner = Learner(graphdef, loss="reverse_kl_sampled", tx=optax.sgd(1.0), micro_batches=k, temperature=0.9,
                          track_movement=True)
        state = learner.init(params)
        old = learner.logp(state.params, batch["tokens_BT"], batch["valid_BT"])
        state, m = learner.train_step(state, batch)
        new = learner.logp(state.params, batch["tokens_BT"], batch["valid_BT"])
        r, mask = new.astype(np.float64) - old, batch["mask_BT"]
        want = np.sum(mask * (np.exp(r) - r - 1)) / mask.sum()
        assert want > 0
        np.testing.assert_allclose(m["policy/step_k3"], want, rtol=1e-3, atol=1e-9)


def test_a_checkpoint_of_another_model_size_is_a_one_line_error(tmp_path):
    """Issue 29 (also seen): resuming into a run directory that holds another model's checkpoint gave a 70-line orbax
    traceback. It is one `CheckpointMismatchError` (an InputError: the CLI prints one line) naming the directory."""
    from opdjax.learner import CheckpointMismatchError, restore_checkpoint, save_checkpoint

    small = dataclasses.replace(CFG, intermediate_size=32)
    states = []
    for cfg in (CFG, small):
        graphdef, params = nnx.split(decoder.create(cfg, seed=3))
        states.append(Learner(graphdef, tx=optax.sgd(1.0)).init(params))
    save_checkpoint(tmp_path / "ckpt", states[0], {"step": 0})
    with pytest.raises(CheckpointMismatchError, match="checkpoint step 0 does not fit this run's model"):
        restore_checkpoint(tmp_path / "ckpt", states[1])

"""OPD losses against numpy closed forms: gradients, advantages, divergences, corrections, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.core import losses
from opdjax.core.losses import LOSSES, NEEDS, get_loss, loss_needs
from opdjax.core.corrections import Correction
from opdjax.core.types import Batch

# ----------------------------------------------------------------------------------------------------- numpy refs

# The textbook estimator (no baseline): what the closed-form checks below compute.
rkl_textbook = functools.partial(get_loss("reverse_kl_sampled"), baseline="none")


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_kl(logp, logq):
    """Σ p (log p - log q) over the last axis, float64."""
    return (np.exp(logp) * (logp - logq)).sum(-1)


def np_discounted(d_BT, mask_BT, gamma):
    B, T = d_BT.shape
    out = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            out[b, t] = sum(gamma ** (s - t) * d_BT[b, s] * mask_BT[b, s] for s in range(t, T))
    return out


def completion_mask(B, T, rng):
    """Contiguous completions: a prompt prefix and a padding suffix are masked out; one row is all-masked."""
    m = np.zeros((B, T), bool)
    for b in range(B - 1):
        start = rng.integers(0, T // 2)
        end = rng.integers(start + 1, T + 1)
        m[b, start:end] = True
    return m


def random_case(B=4, T=7, V=11, seed=0):
    rng = np.random.default_rng(seed)
    s_logits = rng.normal(size=(B, T, V)) * 1.5
    t_logits = rng.normal(size=(B, T, V)) * 1.5
    tokens = rng.integers(0, V, size=(B, T))
    mask = completion_mask(B, T, rng)
    return s_logits, t_logits, tokens, mask


def gather(logp_BTV, tokens_BT):
    return np.take_along_axis(logp_BTV, tokens_BT[..., None], -1)[..., 0]


# ----------------------------------------------------------------------------------------------------- registry


def test_registry_declares_needs():
    assert {"reverse_kl_sampled", "forward_kl_topk", "jsd", "reinforce"} <= set(LOSSES)
    assert loss_needs("reverse_kl_sampled") == frozenset({"teacher_logp"})
    assert loss_needs("forward_kl_topk") == frozenset({"teacher_topk", "student_logprobs"})
    assert loss_needs("jsd") == frozenset({"teacher_logits", "student_logprobs"})
    assert loss_needs("reinforce") == frozenset({"reward"})
    for name in LOSSES:
        assert loss_needs(name) <= NEEDS and get_loss(name).loss_name == name
    with pytest.raises(ValueError, match="reverse_kl_sampled"):
        get_loss("reverse_kl")
    with pytest.raises(ValueError, match="unknown needs"):
        losses.register_loss("bad", needs=frozenset({"teacher_vibes"}))
    with pytest.raises(ValueError, match="already registered"):
        losses.register_loss("jsd")(lambda *a, **k: None)


# ----------------------------------------------------------------------------------------------------- reverse KL


def _analytic_grad_reverse_kl(z, t_logits):
    """∂/∂z KL(S‖T) with S = softmax(z): S_j (log S_j - log T_j - KL)."""
    ls, lt = np_log_softmax(z), np_log_softmax(t_logits)
    S = np.exp(ls)
    kl = (S * (ls - lt)).sum()
    return S * (ls - lt - kl)


def _rkl_loss_of_logits(z_V, t_logp_V, tokens_N):
    ls = jax.nn.log_softmax(z_V)
    s_N1 = ls[tokens_N][:, None]
    batch = {"mask_BT": jnp.ones_like(s_N1, bool), "teacher_logp_BT": t_logp_V[tokens_N][:, None]}
    return rkl_textbook(s_N1, None, batch)[0]


def test_reverse_kl_gradient_is_reverse_kl_gradient_exact_enumeration():
    rng = np.random.default_rng(1)
    V = 5
    z, t_logits = rng.normal(size=V), rng.normal(size=V)
    S = np.exp(np_log_softmax(z))
    t_logp = jnp.asarray(np_log_softmax(t_logits), jnp.float32)
    grad_fn = jax.jit(jax.grad(_rkl_loss_of_logits))
    expected = sum(S[v] * np.asarray(grad_fn(jnp.asarray(z, jnp.float32), t_logp, jnp.array([v]))) for v in range(V))
    np.testing.assert_allclose(expected, _analytic_grad_reverse_kl(z, t_logits), atol=1e-5)


def test_reverse_kl_gradient_matches_analytic_on_sampled_tokens():
    rng = np.random.default_rng(2)
    V, N = 5, 200_000
    z, t_logits = rng.normal(size=V), rng.normal(size=V)
    S = np.exp(np_log_softmax(z))
    tokens = rng.choice(V, size=N, p=S)
    t_logp = jnp.asarray(np_log_softmax(t_logits), jnp.float32)
    g = jax.jit(jax.grad(_rkl_loss_of_logits))(jnp.asarray(z, jnp.float32), t_logp, jnp.asarray(tokens))
    analytic = _analytic_grad_reverse_kl(z, t_logits)
    np.testing.assert_allclose(np.asarray(g), analytic, atol=0.02)
    assert np.abs(analytic).max() > 0.1  # the check is not vacuous


def _rkl_case(seed=0):
    s_logits, t_logits, tokens, mask = random_case(seed=seed)
    s_logp = gather(np_log_softmax(s_logits), tokens).astype(np.float32)
    t_logp = gather(np_log_softmax(t_logits), tokens).astype(np.float32)
    return s_logp, t_logp, mask


def test_reverse_kl_loss_and_metrics_match_numpy():
    s, t, mask = _rkl_case()
    loss, m = rkl_textbook(jnp.asarray(s), None, {"mask_BT": mask, "teacher_logp_BT": t})
    n = mask.sum()
    d = (t - s) * mask
    np.testing.assert_allclose(loss, -(d * s).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(m["teacher_kl"], ((s - t) * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(m["adv_mean"], d.sum() / n, rtol=1e-5)
    np.testing.assert_allclose(m["adv_std"], np.std(d[mask]), rtol=1e-4)


def test_default_batch_baseline_loss_gradient_and_metrics_match_numpy():
    """Issue 29 audit: the default (baseline="batch") against a closed form, not only the textbook estimator:
    b = masked mean of d, loss = -Σ mask (d - b) s / n, ∂loss/∂s = -mask (d - b) / n, metrics of d - b."""
    s, t, mask = _rkl_case(seed=7)
    fn = get_loss("reverse_kl_sampled")  # the default options: baseline="batch"
    (loss, m), grad = jax.value_and_grad(lambda x: fn(x, None, {"mask_BT": mask, "teacher_logp_BT": t}),
                                         has_aux=True)(jnp.asarray(s))
    n = mask.sum()
    d = ((t - s) * mask).astype(np.float64)
    b = d.sum() / n
    adv = np.where(mask, d - b, 0.0)
    np.testing.assert_allclose(loss, -(adv * s).sum() / n, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, -adv / n, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["teacher_kl"], -b, rtol=1e-5)
    assert abs(float(m["adv_mean"])) < 1e-6 and abs(b) > 0.1  # centred, and the baseline is not vacuous
    np.testing.assert_allclose(m["adv_std"], np.std(adv[mask]), rtol=1e-4)
    textbook = jax.grad(lambda x: rkl_textbook(x, None, {"mask_BT": mask, "teacher_logp_BT": t})[0])(jnp.asarray(s))
    assert np.abs(np.asarray(textbook) - np.asarray(grad)).max() > 1e-4  # the baseline really changes the gradient


def test_discount_zero_equals_plain_reverse_kl():
    s, t, mask = _rkl_case(seed=3)
    fn = rkl_textbook
    batch = {"mask_BT": mask, "teacher_logp_BT": t}
    l0, g0 = jax.value_and_grad(lambda x: fn(x, None, batch)[0])(jnp.asarray(s))
    l1, g1 = jax.value_and_grad(lambda x: fn(x, None, batch, discount=0.0)[0])(jnp.asarray(s))
    assert float(l0) == float(l1)
    np.testing.assert_array_equal(g0, g1)


@pytest.mark.parametrize("gamma", [0.5, 0.9, 1.0])
def test_discounted_advantage_is_reverse_discounted_cumsum(gamma):
    s, t, mask = _rkl_case(seed=4)
    fn = rkl_textbook
    batch = {"mask_BT": mask, "teacher_logp_BT": t}
    loss, grad = jax.value_and_grad(lambda x: fn(x, None, batch, discount=gamma)[0])(jnp.asarray(s))
    adv = np_discounted((t - s).astype(np.float64), mask, gamma)
    n = mask.sum()
    # A is stop-gradient, so ∂loss/∂student_logp_t = -mask_t A_t / n exposes the advantage itself
    np.testing.assert_allclose(np.asarray(grad), -(mask * adv) / n, atol=1e-5)
    np.testing.assert_allclose(loss, -(mask * adv * s).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(losses.discounted_returns(jnp.asarray((t - s) * mask), gamma), adv, atol=1e-5)


def test_padding_may_hold_anything():
    s, t, mask = _rkl_case(seed=5)
    s_bad, t_bad, r_bad = s.copy(), t.copy(), s.copy() - 0.1
    s_bad[~mask], t_bad[~mask], r_bad[~mask] = np.nan, -np.inf, np.inf
    fn = rkl_textbook
    clean = {"mask_BT": mask, "teacher_logp_BT": t, "rollout_logp_BT": s - 0.1}
    dirty = {"mask_BT": mask, "teacher_logp_BT": t_bad, "rollout_logp_BT": r_bad}
    corr = Correction("token_tis")
    vg = jax.jit(jax.value_and_grad(lambda x, b: fn(x, None, b, correction=corr, discount=0.9)[0]))
    l_clean, g_clean = vg(s, clean)
    l_dirty, g_dirty = vg(s_bad, dirty)
    np.testing.assert_allclose(l_dirty, l_clean, rtol=1e-6)
    np.testing.assert_allclose(g_dirty, g_clean, rtol=1e-6)


def test_all_masked_batch_is_finite():
    B, T, V = 2, 3, 4
    z = jnp.zeros((B, T, V))
    batch = Batch(
        mask_BT=np.zeros((B, T), bool),
        rollout_logp_BT=np.zeros((B, T)),
        teacher_logp_BT=np.zeros((B, T)),
        teacher_topk_ids_BTK=np.zeros((B, T, 2), np.int32) + np.arange(2),
        teacher_topk_logp_BTK=np.full((B, T, 2), -1.0),
        teacher_logits_BTV=np.zeros((B, T, V)),
        reward_B=np.zeros(B),
    )
    for name, fn in LOSSES.items():
        f = jax.jit(functools.partial(fn, correction=Correction("token_tis")))
        loss, metrics = f(z[..., 0] - 1.0, jax.nn.log_softmax(z), batch)
        assert float(loss) == 0.0, name
        assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values()), (name, metrics)


# ----------------------------------------------------------------------------------------------------- top-k fwd KL


def _topk_case(K, seed=0):
    s_logits, t_logits, tokens, mask = random_case(seed=seed)
    ls, lt = np_log_softmax(s_logits), np_log_softmax(t_logits)
    ids = np.argsort(-lt, axis=-1)[..., :K]
    batch = {
        "mask_BT": mask,
        "teacher_topk_ids_BTK": ids.astype(np.int32),
        "teacher_topk_logp_BTK": np.take_along_axis(lt, ids, -1).astype(np.float32),
    }
    s_logp = gather(ls, tokens).astype(np.float32)
    return ls, lt, ids, mask, batch, s_logp


@pytest.mark.parametrize("tail", [False, True])
def test_topk_forward_kl_with_k_equal_v_is_full_forward_kl(tail):
    ls, lt, ids, mask, batch, s_logp = _topk_case(K=11)
    loss, m = get_loss("forward_kl_topk")(s_logp, jnp.asarray(ls, jnp.float32), batch, tail=tail)
    full = np_kl(lt, ls)
    np.testing.assert_allclose(loss, (full * mask).sum() / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(m["teacher_topk_mass"], 1.0, atol=1e-5)
    np.testing.assert_allclose(m["student_topk_mass"], 1.0, atol=1e-5)


def test_topk_forward_kl_tail_bucket_matches_numpy():
    K = 3
    ls, lt, ids, mask, batch, s_logp = _topk_case(K=K, seed=1)
    fn = get_loss("forward_kl_topk")
    lsk, ltk = np.take_along_axis(ls, ids, -1), np.take_along_axis(lt, ids, -1)
    head = np_kl(ltk, lsk)
    t_tail = 1 - np.exp(ltk).sum(-1)
    s_tail = 1 - np.exp(lsk).sum(-1)
    tail = t_tail * (np.log(t_tail) - np.log(s_tail))
    n = mask.sum()
    loss0, m0 = fn(s_logp, jnp.asarray(ls, jnp.float32), batch)
    loss1, m1 = fn(s_logp, jnp.asarray(ls, jnp.float32), batch, tail=True)
    np.testing.assert_allclose(loss0, (head * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(loss1, ((head + tail) * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(m1["teacher_topk_mass"], ((1 - t_tail) * mask).sum() / n, rtol=1e-5)
    np.testing.assert_allclose(m1["student_topk_mass"], ((1 - s_tail) * mask).sum() / n, rtol=1e-5)
    # the tail-bucketed loss is a forward KL between two (k+1)-outcome distributions: never negative per position
    assert ((head + tail)[mask] >= -1e-6).all() and abs(float(loss1) - float(loss0)) > 1e-2


def test_topk_forward_kl_gradient_is_finite_when_student_mass_is_all_on_topk():
    V, K = 6, 2
    s_logits = jnp.array([[[30.0, 30.0, -30, -30, -30, -30]]])  # student tail mass ~1e-26 → clamped
    lt = np_log_softmax(np.array([[[2.0, 1.0, 0, 0, 0, 0]]]))
    batch = {
        "mask_BT": np.ones((1, 1), bool),
        "teacher_topk_ids_BTK": np.array([[[0, 1]]], np.int32),
        "teacher_topk_logp_BTK": lt[..., :K].astype(np.float32),
    }
    fn = get_loss("forward_kl_topk")
    loss, g = jax.jit(jax.value_and_grad(lambda z: fn(z[..., 0], jax.nn.log_softmax(z), batch, tail=True)[0]))(s_logits)
    assert np.isfinite(np.asarray(g)).all() and np.isfinite(float(loss)) and float(loss) > 1.0
    del V


# ----------------------------------------------------------------------------------------------------- JSD


def _jsd_case(seed=0):
    s_logits, t_logits, tokens, mask = random_case(seed=seed)
    ls, lt = np_log_softmax(s_logits), np_log_softmax(t_logits)
    batch = {"mask_BT": mask, "teacher_logits_BTV": t_logits.astype(np.float32)}
    return ls, lt, mask, batch, gather(ls, tokens).astype(np.float32)


def _np_gjsd(ls, lt, beta):
    lm = np.logaddexp(lt + np.log(beta), ls + np.log1p(-beta))
    return beta * np_kl(lt, lm) + (1 - beta) * np_kl(ls, lm)


def _masked(x, mask):
    return (x * mask).sum() / mask.sum()


def test_jsd_beta_zero_is_forward_kl_and_beta_one_is_reverse_kl():
    ls, lt, mask, batch, s = _jsd_case()
    fn = get_loss("jsd")
    fwd, _ = fn(s, jnp.asarray(ls, jnp.float32), batch, beta=0.0)
    rev, m = fn(s, jnp.asarray(ls, jnp.float32), batch, beta=1.0)
    np.testing.assert_allclose(fwd, _masked(np_kl(lt, ls), mask), rtol=1e-5)
    np.testing.assert_allclose(rev, _masked(np_kl(ls, lt), mask), rtol=1e-5)
    np.testing.assert_allclose(m["teacher_kl"], _masked(np_kl(ls, lt), mask), rtol=1e-5)
    assert abs(float(fwd) - float(rev)) > 0.05  # the two directions differ here, so the pin can fail


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_interior_matches_numpy(beta):
    ls, lt, mask, batch, s = _jsd_case(seed=1)
    loss, m = get_loss("jsd")(s, jnp.asarray(ls, jnp.float32), batch, beta=beta)
    np.testing.assert_allclose(loss, _masked(_np_gjsd(ls, lt, beta), mask), rtol=1e-4)
    if beta == 0.5:  # the ordinary JSD: bounded by log 2
        assert 0 < float(m["jsd"]) < np.log(2)


def test_jsd_normalized_is_continuous_at_the_endpoints():
    ls, lt, mask, batch, s = _jsd_case(seed=2)
    fn = functools.partial(get_loss("jsd"), s, jnp.asarray(ls, jnp.float32), batch, normalize=True)
    np.testing.assert_allclose(fn(beta=1e-3)[0], fn(beta=0.0)[0], rtol=2e-2)
    np.testing.assert_allclose(fn(beta=1 - 1e-3)[0], fn(beta=1.0)[0], rtol=2e-2)
    np.testing.assert_allclose(fn(beta=0.4)[0], _masked(_np_gjsd(ls, lt, 0.4), mask) / 0.24, rtol=1e-4)


def test_jsd_gradient_flows_to_student_only_through_logprobs():
    ls, lt, mask, batch, s = _jsd_case(seed=3)
    fn = get_loss("jsd")
    z = jnp.asarray(ls, jnp.float32)
    g = jax.jit(jax.grad(lambda z: fn(s, jax.nn.log_softmax(z), batch, beta=1.0)[0]))(z)
    # reference: ∂/∂z KL(S‖T) per position = S (ls - lt - KL), averaged over unmasked positions
    S = np.exp(ls)
    kl = np_kl(ls, lt)[..., None]
    ref = S * (ls - lt - kl) * mask[..., None] / mask.sum()
    np.testing.assert_allclose(np.asarray(g), ref, atol=1e-6)


# ----------------------------------------------------------------------------------------------------- corrections


def test_token_tis_correction_reweights_the_loss():
    s, t, mask = _rkl_case(seed=6)
    rng = np.random.default_rng(0)
    rollout = (s - rng.normal(scale=1.0, size=s.shape)).astype(np.float32)  # mismatch: some ratios exceed C
    batch = {"mask_BT": mask, "teacher_logp_BT": t, "rollout_logp_BT": rollout}
    fn = rkl_textbook
    plain, _ = fn(s, None, batch)
    none, _ = fn(s, None, batch, correction=Correction("none"))
    tis, m = fn(s, None, batch, correction=Correction("token_tis", cap=2.0))
    w = np.minimum(np.exp(s.astype(np.float64) - rollout), 2.0) * mask
    n = mask.sum()
    np.testing.assert_allclose(plain, none, rtol=1e-6)
    np.testing.assert_allclose(tis, -(w * (t - s) * s).sum() / n, rtol=1e-5)
    assert abs(float(tis) - float(plain)) > 1e-2
    assert any(k.startswith("corr/") for k in m)
    # correction by name works too
    np.testing.assert_allclose(fn(s, None, batch, correction="token_tis")[0], tis)


def test_rejection_correction_drops_tokens_without_rescaling():
    s, t, mask = _rkl_case(seed=7)
    rollout = s.copy()
    rollout[0, mask[0]] -= 5.0  # row 0 is far off-policy; token_mis drops it
    batch = {"mask_BT": mask, "teacher_logp_BT": t, "rollout_logp_BT": rollout}
    loss, _ = rkl_textbook(s, None, batch, correction=Correction("token_mis", low=0.5, high=2.0))
    keep = mask.copy()
    keep[0] = False
    np.testing.assert_allclose(loss, -(keep * (t - s) * s).sum() / mask.sum(), rtol=1e-5)


# ----------------------------------------------------------------------------------------------------- reinforce


@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_reinforce_group_advantage_matches_numpy(group_size):
    s, _, mask = _rkl_case(seed=8)
    B = s.shape[0]
    reward = np.array([1.0, 0.0, 0.0, 1.0])[:B]
    fn = get_loss("reinforce")
    batch = {"mask_BT": mask, "reward_B": reward}
    loss, grad = jax.value_and_grad(lambda x: fn(x, None, batch, group_size=group_size)[0])(jnp.asarray(s))
    if group_size == 1:
        adv = reward - reward.mean()
    else:
        r = reward.reshape(-1, group_size)
        adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)
    n = mask.sum()
    np.testing.assert_allclose(np.asarray(grad), -(mask * adv[:, None]) / n, atol=1e-6)
    np.testing.assert_allclose(loss, -(mask * adv[:, None] * s).sum() / n, rtol=1e-5, atol=1e-6)
    _, m = fn(s, None, batch, group_size=group_size)
    np.testing.assert_allclose(m["reward_mean"], reward.mean())
    np.testing.assert_allclose(m["adv_std"], adv.std(), rtol=1e-5)


# ----------------------------------------------------------------------------------------------------- jit


@pytest.mark.parametrize("as_dict", [False, True])
def test_every_loss_is_jittable_and_matches_eager(as_dict):
    s_logits, t_logits, tokens, mask = random_case(seed=9)
    ls = np_log_softmax(s_logits).astype(np.float32)
    lt = np_log_softmax(t_logits)
    ids = np.argsort(-lt, -1)[..., :3].astype(np.int32)
    s = gather(ls, tokens)
    fields = dict(
        mask_BT=mask,
        tokens_BT=tokens.astype(np.int32),
        rollout_logp_BT=(s - 0.3).astype(np.float32),
        teacher_logp_BT=gather(lt, tokens).astype(np.float32),
        teacher_topk_ids_BTK=ids,
        teacher_topk_logp_BTK=np.take_along_axis(lt, ids, -1).astype(np.float32),
        teacher_logits_BTV=t_logits.astype(np.float32),
        reward_B=np.array([1.0, 0.0, 1.0, 1.0], np.float32),
    )
    batch = fields if as_dict else Batch(**fields)
    corr = Correction("token_tis")
    options = {"reverse_kl_sampled": {"discount": 0.9}, "forward_kl_topk": {"tail": True}, "jsd": {"beta": 0.3},
               "reinforce": {"group_size": 2}}  # fmt: skip
    for name, fn in LOSSES.items():
        f = functools.partial(fn, correction=corr, **options.get(name, {}))
        eager_loss, eager_m = f(s, ls, batch)
        jit_loss, jit_m = jax.jit(f)(s, ls, batch)
        g = jax.jit(jax.grad(lambda x, y, b: f(x, y, b)[0], argnums=(0, 1)))(s, ls, batch)
        np.testing.assert_allclose(jit_loss, eager_loss, rtol=1e-5, err_msg=name)
        assert set(jit_m) == set(eager_m) and "loss" in jit_m, name
        assert all(np.isfinite(np.asarray(x)).all() for x in g), name


# ----------------------------------------------------------------------------------------------------- errors


def test_missing_fields_name_the_field_and_the_loss():
    s = np.zeros((2, 3), np.float32)
    lp = np.zeros((2, 3, 5), np.float32)
    mask = np.ones((2, 3), bool)
    with pytest.raises(ValueError, match=r"reverse_kl_sampled.*teacher_logp_BT"):
        get_loss("reverse_kl_sampled")(s, None, {"mask_BT": mask})
    with pytest.raises(ValueError, match=r"forward_kl_topk.*teacher_topk_ids_BTK"):
        get_loss("forward_kl_topk")(s, lp, {"mask_BT": mask})
    with pytest.raises(ValueError, match=r"jsd.*student_logprobs_BTV"):
        get_loss("jsd")(s, None, {"mask_BT": mask, "teacher_logits_BTV": lp})
    with pytest.raises(ValueError, match=r"reinforce.*reward_B"):
        get_loss("reinforce")(s, None, Batch(mask_BT=mask))
    with pytest.raises(ValueError, match=r"mask_BT"):
        get_loss("reinforce")(s, None, {"reward_B": np.zeros(2)})
    with pytest.raises(ValueError, match=r"rollout_logp_BT.*token_tis"):
        get_loss("reverse_kl_sampled")(s, None, {"mask_BT": mask, "teacher_logp_BT": s}, correction="token_tis")
    with pytest.raises(ValueError, match=r"unknown batch field.*teacher_logps"):
        get_loss("reverse_kl_sampled")(s, None, {"mask_BT": mask, "teacher_logps": s})


def test_shape_mismatches_name_the_shapes():
    s = np.zeros((2, 3), np.float32)
    mask = np.ones((2, 3), bool)
    with pytest.raises(ValueError, match=r"teacher_logp_BT has shape \(2, 4\), expected \(2, 3\)"):
        get_loss("reverse_kl_sampled")(s, None, {"mask_BT": mask, "teacher_logp_BT": np.zeros((2, 4))})
    with pytest.raises(ValueError, match=r"vocabulary mismatch.*V=7.*V=5"):
        get_loss("jsd")(s, np.zeros((2, 3, 5)), {"mask_BT": mask, "teacher_logits_BTV": np.zeros((2, 3, 7))})
    with pytest.raises(ValueError, match=r"teacher_topk_logp_BTK has shape \(2, 3, 2\), expected \(2, 3, 4\)"):
        get_loss("forward_kl_topk")(
            s,
            np.zeros((2, 3, 5)),
            {"mask_BT": mask, "teacher_topk_ids_BTK": np.zeros((2, 3, 4), int),
             "teacher_topk_logp_BTK": np.zeros((2, 3, 2))},
        )
    with pytest.raises(ValueError, match=r"outside the student vocabulary"):
        get_loss("forward_kl_topk")(
            s,
            np.zeros((2, 3, 5)),
            {"mask_BT": mask, "teacher_topk_ids_BTK": np.full((2, 3, 1), 5),
             "teacher_topk_logp_BTK": np.zeros((2, 3, 1))},
        )
    with pytest.raises(ValueError, match=r"reward_B has shape \(3,\), expected \(2,\)"):
        get_loss("reinforce")(s, None, {"mask_BT": mask, "reward_B": np.zeros(3)})
    with pytest.raises(ValueError, match=r"student_logp_BT must be \[B, T\]"):
        get_loss("reinforce")(np.zeros(3), None, {"mask_BT": mask, "reward_B": np.zeros(2)})


def test_option_errors():
    s = np.zeros((2, 3), np.float32)
    lp = np.zeros((2, 3, 5), np.float32)
    mask = np.ones((2, 3), bool)
    for beta in (-0.1, 1.5):
        with pytest.raises(ValueError, match="beta must be in"):
            get_loss("jsd")(s, lp, {"mask_BT": mask, "teacher_logits_BTV": lp}, beta=beta)
    with pytest.raises(ValueError, match="discount"):
        get_loss("reverse_kl_sampled")(s, None, {"mask_BT": mask, "teacher_logp_BT": s}, discount=1.5)
    with pytest.raises(ValueError, match="not divisible by group_size 4"):
        get_loss("reinforce")(s, None, {"mask_BT": mask, "reward_B": np.zeros(2)}, group_size=4)
    with pytest.raises(ValueError, match="unknown correction"):
        get_loss("reinforce")(s, None, {"mask_BT": mask, "reward_B": np.zeros(2)}, correction="tis")


# ----------------------------------------------------------------------------------------------------- registry


def _loss_cell(scale: float):
    """A notebook cell defining `scaled_nll`: each run makes a new function with the same qualified name."""

    def scaled_nll(student_logp_BT, student_logprobs_BTV, batch, *, correction=None):
        m = jnp.asarray(batch.mask_BT if isinstance(batch, Batch) else batch["mask_BT"], jnp.float32)
        return -scale * jnp.sum(student_logp_BT * m) / jnp.maximum(m.sum(), 1), {}

    return scaled_nll


def _other_loss_cell():
    def scaled_nll(student_logp_BT, student_logprobs_BTV, batch, *, correction=None):
        return jnp.zeros(()), {}

    return scaled_nll


def test_reregistering_the_same_loss_definition_replaces_it_and_its_needs():
    s, mask = jnp.array([[-1.0, -3.0]]), jnp.array([[True, True]])
    try:
        losses.register_loss("test_scaled_nll")(_loss_cell(1.0))
        losses.register_loss("test_scaled_nll", needs=frozenset({"reward"}))(_loss_cell(2.0))  # the cell re-run
        assert loss_needs("test_scaled_nll") == frozenset({"reward"})
        loss, _ = get_loss("test_scaled_nll")(s, None, Batch(mask_BT=mask, reward_B=jnp.ones(1)))
        assert float(loss) == pytest.approx(4.0)  # 2 · mean(1, 3): the second definition runs
    finally:
        LOSSES.pop("test_scaled_nll", None)
    assert "test_scaled_nll" not in LOSSES


def test_a_different_loss_under_a_taken_name_is_refused_and_the_entry_kept():
    try:
        first = losses.register_loss("test_scaled_nll")(_loss_cell(1.0))
        with pytest.raises(ValueError, match=r"loss 'test_scaled_nll' is already registered to "
                                             r"tests\.core\.test_losses\._loss_cell\.<locals>\.scaled_nll.*"
                                             r"pick another name"):
            losses.register_loss("test_scaled_nll")(_other_loss_cell())
        assert LOSSES["test_scaled_nll"] is first
    finally:
        LOSSES.pop("test_scaled_nll", None)

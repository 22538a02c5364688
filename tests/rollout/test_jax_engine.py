"""JaxEngine: KV-cache sampling matches a full-forward recompute, sampling follows the processed distribution,
stops and padding behave, weight updates are atomic and staleness / quantization / noise knobs do what they say."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from opdjax import quant
from opdjax.models import decoder, hf
from opdjax.models.safetensors_io import CheckpointError
from opdjax.models.tiny import tiny_config
from opdjax.rollout import EngineMismatch, JaxEngine, RolloutBatch, SamplingParams, jax_engine

V = 64
PROMPTS = [[3, 7, 1], [9, 9, 2, 4, 8, 1, 6], [5], [10, 11, 12, 13, 14], [2, 2], [30, 31, 32, 33, 34, 35],
           [40, 41, 42, 43], [6, 5, 4, 3, 2, 1, 0, 1], [20], [21, 22, 23], [50, 51], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("qwen3", "tiny", vocab_size=V)
    m = decoder.create(cfg, seed=0)
    m.lm_head.kernel[...] = m.lm_head.kernel[...] * 8.0  # sharper logits (std ~1.2) so truncation bites
    g, s = nnx.split(m)
    m1 = decoder.create(cfg, seed=1)
    m1.lm_head.kernel[...] = m1.lm_head.kernel[...] * 8.0
    m2 = decoder.create(cfg, seed=2)
    m2.lm_head.kernel[...] = m2.lm_head.kernel[...] * 8.0
    return cfg, g, s, nnx.state(m1), nnx.state(m2)


@pytest.fixture(scope="module")
def engine(model):
    cfg, g, s, *_ = model
    return JaxEngine(cfg, s, graphdef=g)


@pytest.fixture(scope="module")
def full_logits(model):
    """Reference: a plain full forward (no cache, no hooks) of whole sequences -> logits [B, T, V] (numpy f64)."""
    cfg, g, s, *_ = model
    fwd = jax.jit(lambda p, t, v: decoder.forward(g, p, t, valid_BT=v)[0])
    return lambda tokens, valid: np.asarray(fwd(s, jnp.asarray(tokens), jnp.asarray(valid)), np.float64)


def np_processed_logp(logits_V, T, top_k=0, top_p=1.0):
    """numpy reference of the processed distribution: logits/T, keep the top-k, keep the smallest most-likely
    prefix whose mass reaches top_p, renormalise."""
    x = np.asarray(logits_V, np.float64) / T
    if 0 < top_k < x.size:
        x = np.where(x >= np.sort(x)[-top_k], x, -np.inf)
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        p = np.exp(x[order] - np.max(x))
        cum = np.cumsum(p / p.sum())
        n_keep = int(np.searchsorted(cum, top_p)) + 1  # first prefix with mass >= top_p
        x = np.where(x >= x[order][n_keep - 1], x, -np.inf)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def completion_positions(batch: RolloutBatch):
    return [(b, l) for b, l in zip(*np.nonzero(batch.completion_mask_BT))]


SAMPLINGS = {
    "t1": SamplingParams(max_new_tokens=12, temperature=1.0),
    "t07": SamplingParams(max_new_tokens=12, temperature=0.7),
    "topp": SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.5),
    "topk_topp": SamplingParams(max_new_tokens=12, temperature=0.8, top_k=5, top_p=0.8),
}


@pytest.fixture(scope="module")
def runs(engine, full_logits):
    """One generation per sampling config (compiled once each) with its full-forward reference logits."""
    cache = {}

    def get(name):
        if name not in cache:
            batch = engine.generate(PROMPTS, SAMPLINGS[name], seed=11)
            cache[name] = (batch, full_logits(batch.tokens_BT, batch.valid_BT))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_kv_cache_decode_logp_matches_full_forward_recompute(runs, name):
    sp = SAMPLINGS[name]
    batch, logits = runs(name)
    pos = completion_positions(batch)
    assert len(pos) == len(PROMPTS) * sp.max_new_tokens  # no stop tokens configured: every row runs to the end
    for b, l in pos:
        ref = np_processed_logp(logits[b, l - 1], sp.temperature, sp.top_k, sp.top_p)
        tok = batch.tokens_BT[b, l]
        assert np.isfinite(ref[tok]), f"sampled token {tok} outside the processed support at ({b}, {l})"
        np.testing.assert_allclose(batch.rollout_logp_BT[b, l], ref[tok], atol=1e-5, rtol=0)
    assert np.all(batch.rollout_logp_BT[~batch.completion_mask_BT] == 0)


def test_temperature_scales_logits_before_log_softmax(runs):
    batch, logits = runs("t07")
    for b, l in completion_positions(batch):
        x = logits[b, l - 1] / 0.7
        ref = x - np.log(np.sum(np.exp(x - x.max()))) - x.max()
        np.testing.assert_allclose(batch.rollout_logp_BT[b, l], ref[batch.tokens_BT[b, l]], atol=1e-5, rtol=0)
        x1 = logits[b, l - 1]  # and it is not the T=1 log-prob
        assert abs(batch.rollout_logp_BT[b, l] - (x1 - np.log(np.sum(np.exp(x1))))[batch.tokens_BT[b, l]]) > 1e-4


def test_top_k_samples_only_among_the_k_most_likely(runs):
    batch, logits = runs("topk_topp")
    for b, l in completion_positions(batch):
        rank = int(np.sum(logits[b, l - 1] > logits[b, l - 1, batch.tokens_BT[b, l]]))
        assert rank < 5, f"token at ({b}, {l}) has rank {rank} under the full-forward logits"


def test_top_p_logp_is_renormalised_over_the_nucleus(runs):
    batch, logits = runs("topp")
    sizes = []
    for b, l in completion_positions(batch):
        x = logits[b, l - 1]
        full = x - np.log(np.sum(np.exp(x - x.max()))) - x.max()
        order = np.argsort(-x)
        cum = np.cumsum(np.exp(full[order]))
        nucleus = order[: int(np.searchsorted(cum, 0.5)) + 1]
        tok = batch.tokens_BT[b, l]
        assert tok in nucleus
        mass = np.exp(full[nucleus]).sum()
        np.testing.assert_allclose(batch.rollout_logp_BT[b, l], full[tok] - np.log(mass), atol=1e-5, rtol=0)
        sizes.append(len(nucleus))
    assert 1 < np.mean(sizes) < V / 2  # the nucleus really truncates


def test_one_step_samples_follow_the_processed_distribution(model, full_logits):
    cfg, g, s, *_ = model
    sp = SamplingParams(max_new_tokens=1, temperature=0.6, top_k=24, top_p=0.9)
    n = 4096
    batch = JaxEngine(cfg, s, graphdef=g).generate([[4, 8, 15, 16, 23, 42]] * n, sp, seed=3)
    logits = full_logits(batch.tokens_BT[:1], batch.valid_BT[:1])[0, -2]
    p = np.exp(np_processed_logp(logits, sp.temperature, sp.top_k, sp.top_p))
    counts = np.bincount(batch.tokens_BT[:, -1], minlength=V)
    support = p > 0
    assert counts[~support].sum() == 0
    assert support.sum() > 5
    expected = n * p[support]
    chi2 = np.sum((counts[support] - expected) ** 2 / expected)
    assert chi2 < stats.chi2.ppf(1 - 1e-4, df=support.sum() - 1), (chi2, support.sum())
    # and the chi-square test has power: the unprocessed (T=1, untruncated) distribution is rejected
    q = np.exp(np_processed_logp(logits, 1.0))
    assert np.sum((counts - n * q) ** 2 / (n * q)) > stats.chi2.ppf(1 - 1e-4, df=V - 1)


def test_greedy_takes_the_argmax_with_its_temperature_one_logp(engine, full_logits):
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0), seed=0)
    logits = full_logits(batch.tokens_BT, batch.valid_BT)
    for b, l in completion_positions(batch):
        x = logits[b, l - 1]
        assert batch.tokens_BT[b, l] == np.argmax(x)
        np.testing.assert_allclose(batch.rollout_logp_BT[b, l], np.max(x) - np.log(np.sum(np.exp(x))), atol=1e-5)


def test_stop_tokens_end_the_row_and_mask_the_rest(model):
    cfg, g, s, *_ = model
    eng = JaxEngine(cfg, s, graphdef=g, eos_id=5, pad_id=0)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(1, 2, 3, 4, 6, 7, 8, 9))
    batch = eng.generate(PROMPTS, sp, seed=5)
    P = batch.tokens_BT.shape[1] - sp.max_new_tokens
    assert batch.tokens_BT.shape == (len(PROMPTS), P + sp.max_new_tokens) and P % 8 == 0
    stop = {1, 2, 3, 4, 5, 6, 7, 8, 9}
    stopped = 0
    for b in range(len(PROMPTS)):
        comp_mask = batch.completion_mask_BT[b, P:]
        n = int(comp_mask.sum())
        assert comp_mask[:n].all() and not comp_mask[n:].any()  # a contiguous completion from slot P
        comp = batch.tokens_BT[b, P:P + n].tolist()
        assert not any(t in stop for t in comp[:-1])
        if comp[-1] in stop:
            stopped += 1  # the stop token is kept and counted as a completion token
            assert np.all(batch.tokens_BT[b, P + n:] == 0)
            assert not batch.valid_BT[b, P + n:].any() and np.all(batch.rollout_logp_BT[b, P + n:] == 0)
        else:
            assert n == sp.max_new_tokens
        assert batch.completions()[b] == comp
    assert stopped >= len(PROMPTS) // 2
    # every token a stop token: each row completes with exactly one token and the loop exits after one step
    all_stop = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=tuple(range(V)))
    batch = eng.generate(PROMPTS, all_stop, seed=5)
    assert batch.completion_mask_BT.sum(axis=1).tolist() == [1] * len(PROMPTS)
    assert eng.last_stats["decode_steps"] == 1


def test_variable_length_prompts_match_each_prompt_alone(engine):
    prompts = [[3, 1, 4], list(range(10, 19)), list(range(20, 37))]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    batch = engine.generate(prompts, sp, seed=7)
    P = batch.tokens_BT.shape[1] - 8
    assert P == 24
    # each row re-scored with its prompt starting at slot 0 (no left padding; right padding is inert)
    alone_tok = np.zeros((3, 17 + 8), np.int32)
    alone_valid = np.zeros((3, 17 + 8), bool)
    for b, p in enumerate(prompts):
        row = batch.tokens_BT[b]
        assert row[P - len(p):P].tolist() == p and not batch.valid_BT[b, :P - len(p)].any()
        seq = p + batch.completions()[b]
        alone_tok[b, :len(seq)], alone_valid[b, :len(seq)] = seq, True
    alone = engine.score(alone_tok, alone_valid)["logp_BT"]
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(batch.rollout_logp_BT[b, P:], alone[b, len(p):len(p) + 8], atol=1e-5, rtol=0)


def test_seeds_are_reproducible_and_matter(runs, engine):
    batch, _ = runs("t1")
    again = engine.generate(PROMPTS, SAMPLINGS["t1"], seed=11)
    other = engine.generate(PROMPTS, SAMPLINGS["t1"], seed=12)
    np.testing.assert_array_equal(again.tokens_BT, batch.tokens_BT)
    np.testing.assert_array_equal(again.rollout_logp_BT, batch.rollout_logp_BT)
    assert (other.tokens_BT != batch.tokens_BT).mean() > 0.3


def test_batch_fields_and_meta(runs):
    batch, _ = runs("topk_topp")
    assert batch.version_B.tolist() == [0] * len(PROMPTS)
    assert batch.prompt_index_B.tolist() == list(range(len(PROMPTS)))
    assert batch.meta["engine"] == "jax" and batch.meta["sampling"]["top_k"] == 5
    assert batch.meta["recipe"] == "none" and batch.meta["weight_noise"] == 0 and batch.meta["stale_versions"] == 0
    assert batch.tokens_BT.dtype == np.int32 and batch.rollout_logp_BT.dtype == np.float32


def test_same_buckets_and_new_weights_do_not_recompile(model, engine):
    cfg, g, s, s1, _ = model
    eng = JaxEngine(cfg, s, graphdef=g)
    sp = SAMPLINGS["t1"]
    eng.generate(PROMPTS, sp, seed=0)
    n = jax_engine._generate_jit._cache_size()
    eng.generate([p[:1] for p in PROMPTS[:10]], sp, seed=1)  # other lengths, same (16, 8) buckets
    eng.update_weights(hf.named_params(cfg, s1), 1)
    eng.generate(PROMPTS, sp, seed=2)
    assert jax_engine._generate_jit._cache_size() == n
    # Issue 29: every new temperature compiled a new program (4-5 s, +210 MB, under a server's request lock); the
    # temperature is a traced argument now, and each still samples its own distribution.
    outs = [eng.generate(PROMPTS, dataclasses.replace(sp, temperature=t), seed=3) for t in (0.5, 0.77, 1.3)]
    assert jax_engine._generate_jit._cache_size() == n
    lp = [o.rollout_logp_BT[o.completion_mask_BT].mean() for o in outs]
    assert lp[0] > lp[1] > lp[2]  # sharper distributions at lower temperatures: higher sampled log-probs


def _probe(model):
    cfg, *_ = model
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, size=(4, 16)).astype(np.int32)
    valid = np.ones_like(tokens, bool)
    valid[1, :5] = False
    return tokens, valid


def test_score_is_temperature_scaled_log_softmax_with_top_k(model, engine, full_logits):
    tokens, valid = _probe(model)
    out = engine.score(tokens, valid, temperature=0.5, top_k=4)
    logits = full_logits(tokens, valid) / 0.5
    logp = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))
    scored = valid[:, 1:] & valid[:, :-1]
    ref = np.where(scored, np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0], 0)
    np.testing.assert_allclose(out["logp_BT"][:, 1:], ref, atol=1e-5)
    assert np.all(out["logp_BT"][:, 0] == 0) and np.all(out["logp_BT"][1, :6] == 0)
    top_ids = np.argsort(-logp[:, :-1], axis=-1)[..., :4]
    np.testing.assert_array_equal(out["topk_ids_BTK"][:, 1:][scored], top_ids[scored])
    np.testing.assert_allclose(out["topk_logp_BTK"][:, 1:][scored],
                               np.take_along_axis(logp[:, :-1], top_ids, -1)[scored], atol=1e-5)


def test_bad_update_raises_and_keeps_serving_the_old_weights(model):
    cfg, g, s, s1, _ = model
    eng = JaxEngine(cfg, s, graphdef=g)
    tokens, valid = _probe(model)
    before = eng.score(tokens, valid)["logp_BT"]
    good = hf.named_params(cfg, s1)
    unknown = {**good, "model.layers.0.mlp.extra_proj.weight": np.zeros((4, 4), np.float32)}
    wrong = {**good, "model.layers.1.mlp.up_proj.weight": np.zeros((64, 128), np.float32)}  # HF is [128, 64]
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    for bad, match in ((unknown, "extra_proj"), (wrong, "up_proj"), (missing, "model.norm.weight")):
        with pytest.raises(CheckpointError, match=match):
            eng.update_weights(bad, 1)
        assert eng.version == 0
        np.testing.assert_array_equal(eng.score(tokens, valid)["logp_BT"], before)
    assert set(eng.generate(PROMPTS, SAMPLINGS["t1"], seed=0).version_B.tolist()) == {0}
    eng.update_weights(good, 1)
    assert eng.version == 1
    ref = JaxEngine(cfg, s1, graphdef=g).score(tokens, valid)["logp_BT"]
    np.testing.assert_array_equal(eng.score(tokens, valid)["logp_BT"], ref)
    assert set(eng.generate(PROMPTS, SAMPLINGS["t1"], seed=0).version_B.tolist()) == {1}


def test_staleness_serves_the_version_k_behind(model):
    cfg, g, s, s1, s2 = model
    tokens, valid = _probe(model)
    eng = JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(stale_versions=1))
    eng.update_weights(hf.named_params(cfg, s1), 1)
    assert eng.version == 0
    np.testing.assert_array_equal(eng.score(tokens, valid)["logp_BT"],
                                  JaxEngine(cfg, s, graphdef=g).score(tokens, valid)["logp_BT"])
    eng.update_weights(hf.named_params(cfg, s2), 2)
    assert eng.version == 1 and eng.published_versions == [1, 2]
    np.testing.assert_array_equal(eng.score(tokens, valid)["logp_BT"],
                                  JaxEngine(cfg, s1, graphdef=g).score(tokens, valid)["logp_BT"])
    batch = eng.generate(PROMPTS, SAMPLINGS["t1"], seed=0)
    assert set(batch.version_B.tolist()) == {1} and batch.meta["stale_versions"] == 1


def test_concurrent_updates_give_consistent_versions(model):
    cfg, g, s, s1, s2 = model
    eng = JaxEngine(cfg, s, graphdef=g)
    named = [hf.named_params(cfg, x) for x in (s1, s2)]
    errors = []

    def publish():
        try:
            for v in range(1, 9):
                eng.update_weights(named[v % 2], v)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=publish)
    t.start()
    versions = [int(eng.generate(PROMPTS, SAMPLINGS["t1"], seed=i).version_B[0]) for i in range(6)]
    t.join()
    assert not errors and versions == sorted(versions) and eng.version == 8




def test_fp8_recipe_and_weight_noise_change_the_engine_distribution(model, engine):
    cfg, g, s, *_ = model
    tokens, valid = _probe(model)
    base = engine.score(tokens, valid)["logp_BT"]
    fp8 = JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(recipe="fp8_w8a8")).score(tokens, valid)["logp_BT"]
    d = np.abs(fp8 - base)[:, 1:][valid[:, 1:] & valid[:, :-1]]
    assert 0 < d.max() < 0.5
    zero = JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(weight_noise=0.0))
    assert np.array_equal(zero.score(tokens, valid)["logp_BT"], base)
    noisy = JaxEngine(cfg, s, graphdef=g, seed=1, mismatch=EngineMismatch(weight_noise=0.05)
                      ).score(tokens, valid)["logp_BT"]
    assert np.abs(noisy - base).max() > 1e-3
    again = JaxEngine(cfg, s, graphdef=g, seed=1, mismatch=EngineMismatch(weight_noise=0.05))
    np.testing.assert_array_equal(again.score(tokens, valid)["logp_BT"], noisy)
    other = JaxEngine(cfg, s, graphdef=g, seed=2, mismatch=EngineMismatch(weight_noise=0.05)
                      ).score(tokens, valid)["logp_BT"]
    assert np.abs(other - noisy).max() > 1e-3
    again.update_weights(hf.named_params(cfg, s), 1)  # default "fixed": same weights, new version -> same offset
    np.testing.assert_array_equal(again.score(tokens, valid)["logp_BT"], noisy)
    fresh = JaxEngine(cfg, s, graphdef=g, seed=1, mismatch=EngineMismatch(weight_noise=0.05, noise_mode="per_version"))
    v0 = fresh.score(tokens, valid)["logp_BT"]
    fresh.update_weights(hf.named_params(cfg, s), 1)  # per_version: a fresh (reproducible) draw per version
    assert np.abs(fresh.score(tokens, valid)["logp_BT"] - v0).max() > 1e-3
    with pytest.raises(ValueError, match="noise_mode"):
        JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(weight_noise=0.05, noise_mode="sometimes"))


def test_rounding_noise_is_int_quantization_of_the_matmul_kernels(model, engine):
    """noise_mode "rounding" at sigma = 1/127 serves exactly an int8 per-channel weights-only recipe (the
    quantizer of `quant`, on the same kernels: every decoder Linear, not lm_head/embeddings/norms); coarser grids
    move the distribution further, and a new version re-rounds the weights it is given (no persistent draw)."""
    cfg, g, s, *_ = model
    tokens, valid = _probe(model)
    int8_w = quant.Recipe(name="int8_weights_only", weights=tuple(
        (p, None if spec is None else quant.QSpec("int8", "channel")) for p, spec in quant.FP8_DEFAULT.weights))
    ref = JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(recipe=int8_w)).score(tokens, valid)["logp_BT"]
    grid = JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(weight_noise=1 / 127, noise_mode="rounding"))
    np.testing.assert_array_equal(grid.score(tokens, valid)["logp_BT"], ref)
    base = engine.score(tokens, valid)["logp_BT"]
    m = valid[:, 1:] & valid[:, :-1]
    d8 = np.abs(ref - base)[:, 1:][m].mean()
    d4 = np.abs(JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(weight_noise=1 / 7, noise_mode="rounding"))
                .score(tokens, valid)["logp_BT"] - base)[:, 1:][m].mean()
    assert 0 < d8 < d4
    moved = jax.tree.map(lambda a: a * 1.01, s)
    grid.update_weights(hf.named_params(cfg, moved), 1)
    want = JaxEngine(cfg, moved, graphdef=g, mismatch=EngineMismatch(recipe=int8_w)).score(tokens, valid)["logp_BT"]
    np.testing.assert_array_equal(grid.score(tokens, valid)["logp_BT"], want)


def test_quantized_decode_matches_quantized_score(model):
    cfg, g, s, *_ = model
    recipe = "fp8_w8a8_kv"  # W8A8 + FP8 KV cache: every forward hook is exercised in prefill, decode and score
    eng = JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(recipe=recipe))
    batch = eng.generate(PROMPTS, SAMPLINGS["t1"], seed=4)
    assert batch.meta["recipe"] == recipe
    ref = eng.score(batch.tokens_BT, batch.valid_BT)["logp_BT"]
    m = batch.completion_mask_BT
    d = np.abs(batch.rollout_logp_BT[m] - ref[m])
    # Quantization is discontinuous: a 1-ulp difference between the cached and the full-forward matmuls can flip
    # one rounding. With a fixed-scale FP8 KV cache the attention output of a lone token IS an fp8 value, and its
    # per-token re-quantization lands exactly on rounding ties, so a few tokens differ by one fp8 step.
    assert np.median(d) < 1e-5 and np.mean(d < 1e-4) > 0.8 and d.max() < 0.1, (np.median(d), d.max())


def _matmuls_in_generate(eng: JaxEngine, prompts, sampling: SamplingParams) -> int:
    """dot_general ops in the lowered generate program (prefill + decode step) for these prompts."""
    return eng.lower_generate(len(prompts), max(map(len, prompts)), sampling).as_text().count("stablehlo.dot_general")


def test_merged_projections_serve_the_same_distribution_with_fewer_matmuls(model, engine):
    """merge_projections: q/k/v and gate/up run as one matmul each, with the same log-probs (to f32 rounding) and
    greedy tokens, unquantized and under W8A8; a group whose modules a recipe quantizes differently stays
    separate. The lowered generate has 3 fewer matmuls per layer in the prefill and 3 in the decode step (1 and 1
    when only gate/up merge). Off by default on CPU and on tensor-parallel meshes, on elsewhere."""
    cfg, g, s, *_ = model
    assert engine.merge_projections is False
    assert jax_engine.default_merge_projections("gpu") and jax_engine.default_merge_projections("tpu")
    from opdjax.models.sharding import make_mesh
    assert not jax_engine.default_merge_projections("gpu", make_mesh((1, 1, 2), jax.devices()[:2]))
    assert jax_engine.default_merge_projections("gpu", make_mesh((1, 2, 1), jax.devices()[:2]))
    tokens, valid = _probe(model)
    m = valid[:, 1:] & valid[:, :-1]
    q_only = quant.Recipe(name="q_only", weights=(("*.q_proj", quant.QSpec("e4m3", "tensor")),),
                          activations=quant.QSpec("e4m3", "token"))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    L = cfg.num_layers
    for recipe, fewer in ((None, 6 * L), ("fp8_w8a8", 6 * L), (q_only, 2 * L)):
        sep = JaxEngine(cfg, s, graphdef=g, mismatch=EngineMismatch(recipe=recipe))
        mer = JaxEngine(cfg, s, graphdef=g, merge_projections=True, mismatch=EngineMismatch(recipe=recipe))
        d = np.abs(mer.score(tokens, valid)["logp_BT"] - sep.score(tokens, valid)["logp_BT"])[:, 1:][m]
        assert np.median(d) < 1e-6 and d.max() < (1e-5 if recipe is None else 0.1), (recipe, d.max())
        if recipe is None:
            np.testing.assert_array_equal(mer.generate(PROMPTS, greedy, seed=0).tokens_BT,
                                          sep.generate(PROMPTS, greedy, seed=0).tokens_BT)
        assert _matmuls_in_generate(sep, PROMPTS, greedy) - _matmuls_in_generate(mer, PROMPTS, greedy) == fewer


def test_pallas_decode_attention_serves_the_same_distribution(model, engine, monkeypatch):
    """decode_attention="pallas" (JAX's flash-decoding kernel over the filled cache slots only; interpreted on CPU):
    the rollout log-probs are those of the einsum engine's full-forward score, with left-padded prompts of every
    length and rows that stop early; the cache is rounded up to whole kernel splits. Bad settings raise."""
    cfg, g, s, *_ = model
    caches = []
    real = decoder.pallas_decode_attention
    monkeypatch.setattr(decoder, "pallas_decode_attention", lambda q, k, *a: caches.append(k.shape) or real(q, k, *a))
    eng = JaxEngine(cfg, s, graphdef=g, decode_attention="pallas", eos_id=5)
    batch = eng.generate(PROMPTS, SAMPLINGS["t1"], seed=3)
    assert len(caches) == cfg.num_layers and caches[0][2] == decoder.PALLAS_DECODE_SPLIT  # traced once per layer
    assert batch.completion_mask_BT.sum(1).min() < SAMPLINGS["t1"].max_new_tokens  # some rows stopped at eos 5
    ref = engine.score(batch.tokens_BT, batch.valid_BT)["logp_BT"]
    m = batch.completion_mask_BT
    np.testing.assert_allclose(batch.rollout_logp_BT[m], ref[m], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="decode_attention"):
        JaxEngine(cfg, s, graphdef=g, decode_attention="flash")


def test_decode_segments_double_from_the_block_and_end_at_the_full_cache():
    assert jax_engine.decode_segments(8, 2048, 256) == ((256, 264), (512, 520), (1024, 1032), (2048, 2056))
    assert jax_engine.decode_segments(8, 300, 0) == ((300, 308),)  # 0: one cache of P + N slots
    assert jax_engine.decode_segments(8, 100, 256) == ((100, 108),)  # short responses: the old single loop
    assert jax_engine.decode_segments(8, 100, 16, multiple=64) == ((16, 64), (32, 64), (64, 128), (100, 128))
    with pytest.raises(ValueError, match="cache_block must be >= 0"):
        jax_engine.decode_segments(8, 100, -1)


@pytest.mark.parametrize("attention,sampling", [("einsum", "topk_topp"), ("einsum", "greedy"), ("pallas", "t1")])
def test_grown_cache_samples_the_same_tokens_as_one_full_cache(model, attention, sampling):
    """cache_block=16 (a cache of P + 16 slots, doubling: five while loops for 150 tokens) against cache_block=0
    (one cache of P + 150 slots from the start): the same tokens, masks and decode steps, with rows stopping at
    eos 5 in different segments; log-probs equal up to float32 rounding (the attention sums run over fewer masked
    slots: a change of the size a different max_new_tokens makes to the full-cache engine)."""
    cfg, g, s, *_ = model
    sp = dataclasses.replace(SAMPLINGS.get(sampling, SamplingParams(temperature=0.0)),
                             max_new_tokens=150 if attention == "einsum" else 80)
    out, steps = {}, {}
    for block in (0, 16):
        eng = JaxEngine(cfg, s, graphdef=g, eos_id=5, cache_block=block, decode_attention=attention)
        out[block] = eng.generate(PROMPTS, sp, seed=7)
        steps[block] = eng.last_stats["decode_steps"]
    assert steps[0] == steps[16] > 32  # the loop ran into a grown segment
    np.testing.assert_array_equal(out[0].tokens_BT, out[16].tokens_BT)
    np.testing.assert_array_equal(out[0].completion_mask_BT, out[16].completion_mask_BT)
    np.testing.assert_allclose(out[0].rollout_logp_BT, out[16].rollout_logp_BT, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="cache_block"):
        JaxEngine(cfg, s, graphdef=g, cache_block=-1)


def test_mesh_sharded_engine_matches_single_device(model, engine, cpu_devices):
    from opdjax.models.sharding import make_mesh
    cfg, g, s, *_ = model
    sharded = JaxEngine(cfg, s, graphdef=g, mesh=make_mesh((2, -1, 1)))
    batch = sharded.generate(PROMPTS[:3], SAMPLINGS["t1"], seed=1)
    assert sharded.last_stats["batch_bucket"] == 8
    ref = engine.score(batch.tokens_BT, batch.valid_BT)["logp_BT"]
    m = batch.completion_mask_BT
    np.testing.assert_allclose(batch.rollout_logp_BT[m], ref[m], atol=1e-5, rtol=0)


def test_from_pretrained_serves_the_checkpoint(model, engine, tmp_path):
    cfg, g, s, *_ = model
    hf.save_model(tmp_path, cfg.__class__(**{**cfg.__dict__, "eos_token_id": 5}), s)
    eng = JaxEngine.from_pretrained(tmp_path)
    assert eng.version == 0 and eng.eos_id == 5
    tokens, valid = _probe(model)
    np.testing.assert_allclose(eng.score(tokens, valid)["logp_BT"], engine.score(tokens, valid)["logp_BT"], atol=1e-6)


def test_bad_inputs_raise_clear_errors(model, engine):
    cfg, *_ = model
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 2, V]], SAMPLINGS["t1"], seed=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1], []], SAMPLINGS["t1"], seed=0)
    with pytest.raises(RuntimeError, match="no weights"):
        JaxEngine(cfg).generate([[1]], SAMPLINGS["t1"], seed=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_sampler_draws_exactly_what_jax_random_categorical_draws():
    """The engine's Gumbel-max with a two-reduction argmax is the same draw as jax.random.categorical (and the same
    index as jnp.argmax for greedy), ties and -inf (truncated) entries included."""
    logits = jax.random.normal(jax.random.key(0), (64, 300)) * 3
    logits = logits.at[:, 7].set(logits[:, 3])  # ties
    logp = jax.nn.log_softmax(jnp.where(jnp.arange(300) % 5 == 0, -jnp.inf, logits), -1)  # truncated support
    keys = jax.random.split(jax.random.key(1), 64)
    for lp in (jax.nn.log_softmax(logits, -1), logp):
        ours = jax.jit(jax.vmap(jax_engine._gumbel_max))(keys, lp)
        ref = jax.jit(jax.vmap(jax.random.categorical))(keys, lp)
        np.testing.assert_array_equal(ours, ref)
    assert jax_engine.fused_gumbel_matches_jax()  # the fused threefry path is the one under test here
    g = jax.jit(jax.vmap(lambda k: jax_engine._gumbel_fused(k, 300)))(keys)
    np.testing.assert_array_equal(g, jax.vmap(lambda k: jax.random.gumbel(k, (300,)))(keys))
    np.testing.assert_array_equal(jax_engine.argmax_first(logits), jnp.argmax(logits, -1))
    np.testing.assert_array_equal(jax_engine.argmax_first(jnp.zeros((2, 5))), [0, 0])


def test_the_engine_never_samples_a_padded_vocabulary_row(padded_pair):
    """A student of 384 rows and a 259-token tokenizer samples (hot, so the random padded rows would often win) only
    ids < 259; the same engine over every row samples padded ids, so the check can fail."""
    from opdjax.models.tiny import load_tokenizer

    sp = SamplingParams(max_new_tokens=8, temperature=5.0)
    prompts = [[5, 6, 7]] * 16
    pad = load_tokenizer(padded_pair[0]).pad_token_id
    fixed = JaxEngine.from_pretrained(padded_pair[0], pad_id=pad).generate(prompts, sp, seed=0)
    assert fixed.tokens_BT[fixed.completion_mask_BT].max() < 259
    every_row = JaxEngine.from_pretrained(padded_pair[0], pad_id=pad, usable_vocab=384).generate(prompts, sp, seed=0)
    assert every_row.tokens_BT[every_row.completion_mask_BT].max() >= 259

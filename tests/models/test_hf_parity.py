"""opdjax logits against the transformers PyTorch implementation, loaded from the same HF directory."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from opdjax.models import ModelConfig, create, hf, init_cache, load_model, save_model

from tests.conftest import require_reference  # noqa: E402

torch = require_reference("torch")
transformers = require_reference("transformers")

LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 16.0))
CONFIGS = {
    "llama_llama3rope_tied": ModelConfig(model_type="llama", vocab_size=200, hidden_size=64, intermediate_size=96,
                                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=False,
                                         rope_type="llama3", rope_extra=LLAMA3_ROPE, tie_word_embeddings=True,
                                         rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama_linear_rope": ModelConfig(model_type="llama", vocab_size=200, hidden_size=64, intermediate_size=96,
                                     num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, qk_norm=False,
                                     rope_type="linear", rope_extra=(("factor", 4.0),)),
    "qwen2_bias": ModelConfig(model_type="qwen2", vocab_size=200, hidden_size=64, intermediate_size=96, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16 * 2, attention_bias=True, qk_norm=False),
    "qwen3_headdim48": ModelConfig(model_type="qwen3", vocab_size=200, hidden_size=64, intermediate_size=96,
                                   num_layers=2, num_heads=4, num_kv_heads=1, head_dim=48, qk_norm=True),
}


def _randomised(cfg, seed):
    """A model whose norms and biases are not at their init values, so every param matters."""
    model = create(cfg, seed=seed)
    state = nnx.state(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    leaves = [a + 0.05 * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    model = _randomised(cfg, seed=len(request.param))
    path = save_model(tmp_path_factory.mktemp(request.param), cfg, model)
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 37))
    return cfg, model, path, tokens


def _torch_logits(path, tokens, attention_mask=None):
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    kw = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
    with torch.no_grad():
        return m(torch.tensor(tokens), **kw).logits.numpy()


def test_logits_match_transformers_f32(saved):
    cfg, model, path, tokens = saved
    ref = _torch_logits(path, tokens)
    ours, _ = model(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


def test_loaded_checkpoint_matches_transformers_and_round_trips_bit_exact(saved, tmp_path):
    cfg, model, path, tokens = saved
    cfg2, loaded = load_model(path)
    assert cfg2 == cfg
    a, b = nnx.state(model), nnx.state(loaded)
    for (pa, va), (pb, vb) in zip(nnx.to_flat_state(a), nnx.to_flat_state(b)):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))
    # And a second save is byte-identical to the first.
    save_model(tmp_path, cfg2, loaded)
    assert (tmp_path / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()


def test_left_padded_batch_matches_transformers(saved):
    """Padding handled as HF does: masked keys and positions counted from the first real token."""
    cfg, model, path, tokens = saved
    mask = np.ones_like(tokens)
    mask[1, :5] = 0
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with torch.no_grad():
        ref = m(torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos)).logits.numpy()
    ours, _ = model(jnp.asarray(tokens), valid_BT=jnp.asarray(mask, bool))
    np.testing.assert_allclose(np.asarray(ours)[mask.astype(bool)], ref[mask.astype(bool)], atol=1e-4, rtol=0)


def test_kv_cache_prefill_and_decode_match_full_forward(saved):
    cfg, model, _, tokens = saved
    full, _ = model(jnp.asarray(tokens))
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c))
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    prefill, cache = step(state, jnp.asarray(tokens[:, :20]), cache)
    outs = [prefill]
    for t in range(20, tokens.shape[1]):
        logit, cache = step(state, jnp.asarray(tokens[:, t:t + 1]), cache)
        outs.append(logit)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), np.asarray(full), atol=1e-5, rtol=0)


def test_checkpoint_written_by_transformers_loads(tmp_path):
    """A directory saved by transformers itself (not by us), in the legacy top-level rope config style."""
    tcfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                    tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(tcfg)
    m.save_pretrained(str(tmp_path))
    conf = json.loads((tmp_path / "config.json").read_text())
    rope = conf.pop("rope_parameters", None) or {"rope_theta": 10000.0}
    conf["rope_theta"] = rope["rope_theta"]
    conf["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg, model = load_model(tmp_path)
    assert cfg.rope_type == "linear" and cfg.rope == {"factor": 2.0}
    tokens = np.random.RandomState(1).randint(0, 128, (1, 30))
    ours, _ = model(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(ours), _torch_logits(tmp_path, tokens), atol=1e-4, rtol=0)


def test_sharded_checkpoint_and_bf16_round_trip(saved, tmp_path):
    cfg, model, _, tokens = saved
    save_model(tmp_path, cfg, model, dtype=jnp.bfloat16, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _, state = hf.load_state(tmp_path, param_dtype=jnp.bfloat16)
    want = jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model))
    for (_, va), (_, vb) in zip(nnx.to_flat_state(want), nnx.to_flat_state(state)):
        assert vb.get_value().dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))
    ref = _torch_logits(tmp_path, tokens)  # transformers reads the sharded bf16 directory too
    assert np.isfinite(ref).all()

"""ModelConfig's stop ids (config.json lists, generation_config.json, the tokenizer's EOS) and its usable vocabulary
(the tokenizer's ids; padding rows beyond them never reach a distribution)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from opdjax.models import ConfigError, ModelConfig, decoder, hf
from opdjax.models.tiny import load_tokenizer, tiny_config


def test_a_listed_eos_keeps_every_id_and_round_trips_through_config_json():
    cfg = ModelConfig.from_hf_dict({**tiny_config().to_hf_dict(), "eos_token_id": [7, 3, 7]})
    assert cfg.eos_token_id == 7 and cfg.eos_token_ids == (7, 3)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    single = tiny_config(eos_token_id=5)
    assert single.eos_token_ids == (5,) and single.to_hf_dict()["eos_token_id"] == 5
    assert ModelConfig.from_hf_dict(single.to_hf_dict()) == single


def test_generation_config_and_the_tokenizer_add_their_stop_ids(pair, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**tiny_config(eos_token_id=9).to_hf_dict()}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11, 12]}))
    cfg = ModelConfig.from_dir(d)
    assert cfg.eos_token_ids == (9, 11, 12)
    tok = load_tokenizer(pair[0])
    with_tok = cfg.with_tokenizer(tok)
    assert with_tok.eos_token_ids == (9, 11, 12, tok.eos_token_id) and with_tok.usable_vocab == len(tok)


def test_usable_vocab_is_checked_against_the_rows(pair):
    with pytest.raises(ConfigError, match=r"usable_vocab=65 must be in \[1, vocab_size=64\]"):
        tiny_config(vocab_size=64, usable_vocab=65)
    with pytest.raises(ConfigError, match="the tokenizer has 259 tokens but the model's vocab_size is 64"):
        tiny_config(vocab_size=64).with_tokenizer(load_tokenizer(pair[0]))


def test_padded_pair_configs_carry_the_tokenizers_length(padded_pair):
    s, t = (hf.load_config(p) for p in padded_pair)
    assert (s.vocab_size, t.vocab_size) == (384, 512) and s.usable_size == t.usable_size == 259


def test_logits_over_the_usable_ids_are_the_full_softmax_renormalised():
    """Slicing the lm_head to U ids = masking the padded logits to -inf: softmax over a subset is the full softmax
    renormalised over it. Checked against the unsliced model's logits."""
    full_cfg = tiny_config(vocab_size=96)
    cfg = dataclasses.replace(full_cfg, usable_vocab=70)
    model = decoder.create(full_cfg, seed=3)
    graphdef, params = nnx.split(model)
    sliced_graphdef, _ = nnx.split(decoder.create(cfg, seed=3))
    tokens = np.random.default_rng(0).integers(0, 70, (2, 6)).astype(np.int32)
    full = np.asarray(decoder.forward(graphdef, params, tokens)[0])
    cut = np.asarray(decoder.forward(sliced_graphdef, params, tokens)[0])
    assert cut.shape == (2, 6, 70)
    np.testing.assert_allclose(cut, full[..., :70], rtol=1e-6, atol=1e-6)
    masked = np.where(np.arange(96) < 70, full, -np.inf)
    np.testing.assert_allclose(np.asarray(jax.nn.log_softmax(cut)), np.asarray(jax.nn.log_softmax(masked))[..., :70],
                               rtol=1e-5, atol=1e-5)

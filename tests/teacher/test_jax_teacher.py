"""JaxTeacher scores through the engine's scoring path; checked against log_softmax of the decoder's own logits
(`decoder.forward`, itself checked against transformers in tests/models/test_hf_parity.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from opdjax.models import decoder
from opdjax.models.config import ModelConfig
from opdjax.teacher import JaxTeacher, VocabMismatchError

CFG = ModelConfig(model_type="qwen3", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def test_teacher_scores_equal_log_softmax_of_the_decoder_logits():
    graphdef, params = nnx.split(decoder.create(CFG, seed=2))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (3, 9)).astype(np.int32)
    valid = np.ones((3, 9), bool)
    T = 0.8
    s = JaxTeacher(CFG, graphdef, params, temperature=T).score(
        tokens, valid, frozenset({"teacher_logp", "teacher_topk", "teacher_logits"}), top_k=5)
    logits = np.asarray(decoder.forward(graphdef, params, tokens, valid_BT=valid)[0], np.float64)[:, :-1] / T
    lp = np.asarray(jax.nn.log_softmax(logits, -1))
    want = np.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(s.teacher_logp_BT[:, 1:], want, rtol=1e-5, atol=1e-5)
    assert np.all(s.teacher_logp_BT[:, 0] == 0)
    np.testing.assert_allclose(s.teacher_topk_logp_BTK[:, 1:], -np.sort(-lp, -1)[..., :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.teacher_logits_BTV[:, 1:], logits, rtol=1e-5, atol=1e-4)
    only_logp = JaxTeacher(CFG, graphdef, params).score(tokens, valid)
    assert only_logp.teacher_topk_ids_BTK is None and only_logp.teacher_logits_BTV is None


def test_a_token_outside_the_teachers_vocabulary_is_refused():
    graphdef, params = nnx.split(decoder.create(CFG, seed=2))
    tokens = np.full((1, 4), CFG.vocab_size, np.int32)
    with pytest.raises(VocabMismatchError, match="outside the teacher's vocabulary"):
        JaxTeacher(CFG, graphdef, params).score(tokens, np.ones((1, 4), bool))
    with pytest.raises(ValueError, match="temperature"):
        JaxTeacher(CFG, graphdef, params, temperature=0.0)

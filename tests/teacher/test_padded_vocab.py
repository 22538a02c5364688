"""Pairs whose vocabularies differ only in padding rows train; the teacher's top-k and log-probs are over the shared
tokenizer's ids; pairs whose tokenizers differ are refused in one line naming the first differing token."""

from __future__ import annotations

import numpy as np
import pytest

from opdjax.models import ModelConfig
from opdjax.models.tiny import load_tokenizer, make_tiny
from opdjax.teacher import JaxTeacher, VocabMismatchError, check_same_vocab


def _rows(tok, n=6, L=10, seed=0):
    return np.random.default_rng(seed).integers(3, len(tok), (n, L)).astype(np.int32), np.ones((n, L), bool)


def test_a_pair_differing_only_in_padding_rows_shares_the_tokenizers_ids(padded_pair):
    s, t = (ModelConfig.from_dir(p) for p in padded_pair)
    tok = load_tokenizer(padded_pair[0])
    assert check_same_vocab(s, t, tok, load_tokenizer(padded_pair[1])) == len(tok) == 259


def test_different_tokenizers_are_refused_naming_the_first_differing_token(pair, tmp_path):
    other = make_tiny(tmp_path / "other", "qwen3", "tiny", corpus=["completely different text " * 50],
                      tokenizer_vocab=400)
    a, b = load_tokenizer(pair[0]), load_tokenizer(other)
    ids = sorted(set(a.get_vocab().values()) | set(b.get_vocab().values()))
    ra, rb = ({i: t for t, i in x.get_vocab().items()} for x in (a, b))
    first = next(i for i in ids if ra.get(i) != rb.get(i))
    with pytest.raises(VocabMismatchError) as e:
        check_same_vocab(ModelConfig.from_dir(pair[0]), ModelConfig.from_dir(other), a, b)
    msg = str(e.value)
    assert "\n" not in msg and f"at id {first}: student {ra.get(first)!r}, teacher {rb.get(first)!r}" in msg


def test_teacher_top_k_never_holds_a_padded_id(padded_pair):
    """With the tokenizer's length as the usable vocabulary no top-k id is >= 259; the same teacher over every row
    of its 512 (what it did before) ranks padded ids in its top-k, so the check can fail."""
    tok = load_tokenizer(padded_pair[1])
    tokens, valid = _rows(tok)
    needs = frozenset({"teacher_logp", "teacher_topk", "teacher_logits"})
    fixed = JaxTeacher.from_pretrained(padded_pair[1]).score(tokens, valid, needs, top_k=32)
    assert fixed.teacher_topk_ids_BTK.max() < len(tok) and fixed.teacher_logits_BTV.shape[-1] == len(tok)
    every_row = JaxTeacher.from_pretrained(padded_pair[1], usable_vocab=512).score(tokens, valid, needs, top_k=32)
    assert every_row.teacher_topk_ids_BTK.max() >= len(tok)
    # Same distribution as the full one renormalised over the usable ids.
    full = every_row.teacher_logits_BTV[:, 1:].astype(np.float64)
    lse = np.log(np.exp(full[..., :len(tok)]).sum(-1))
    want = np.take_along_axis(full, tokens[:, 1:, None], -1)[..., 0] - lse
    np.testing.assert_allclose(fixed.teacher_logp_BT[:, 1:], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # one vLLM engine start
@pytest.mark.vllm
def test_vllm_prompt_logprobs_cover_padded_rows_unless_restricted(vllm_module, padded_pair):
    """What vLLM returns: its prompt log-probs are a log-softmax over all 512 rows (padded ids in the top-k).
    After `restrict_vocab` (the logits processor cut at 259 ids, as `VllmEngine(usable_vocab=)` does) the top-k
    holds no padded id and the log-probs equal the JAX teacher's over the usable ids."""
    from opdjax.rollout.vllm_engine import restrict_vocab
    from opdjax.teacher.vllm_teacher import VllmTeacher

    tok = load_tokenizer(padded_pair[1])
    tokens, valid = _rows(tok, n=3, L=8)
    teacher = VllmTeacher(padded_pair[1], usable_vocab=512, kv_cache_memory_bytes=32 << 20, max_num_seqs=4)
    raw = teacher.engine.score(tokens, valid, top_k=32)
    assert raw["topk_ids_BTK"].max() >= len(tok)
    assert teacher.engine.llm.collective_rpc(restrict_vocab, args=(len(tok),)) == [len(tok)]
    cut = teacher.engine.score(tokens, valid, top_k=32)
    assert cut["topk_ids_BTK"].max() < len(tok)
    want = JaxTeacher.from_pretrained(padded_pair[1]).score(tokens, valid, frozenset({"teacher_logp", "teacher_topk"}),
                                                            top_k=32)
    np.testing.assert_allclose(cut["logp_BT"], want.teacher_logp_BT, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cut["topk_logp_BTK"], want.teacher_topk_logp_BTK, rtol=1e-4, atol=1e-4)

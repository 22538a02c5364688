"""Tiny checkpoints made offline: loadable by transformers' Auto classes, vocab consistent with the model."""

import json

import numpy as np
import pytest

from tests.conftest import require_reference

from opdjax.cli.main import main
from opdjax.models import load_model
from opdjax.models.tiny import SPECIAL_TOKENS, load_tokenizer, make_tiny


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_make_tiny_cli_writes_loadable_checkpoint_and_tokenizer(family, tmp_path):
    assert main(["make-tiny", str(tmp_path), "--family", family, "--size", "tiny"]) == 0
    conf = json.loads((tmp_path / "config.json").read_text())
    tok = load_tokenizer(tmp_path)  # AutoTokenizer, local files only
    assert conf["vocab_size"] >= len(tok) and conf["vocab_size"] % 64 == 0
    assert conf["head_dim"] >= 32
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == SPECIAL_TOKENS
    assert conf["eos_token_id"] == tok.eos_token_id
    text = "123+45=168 sort 3 1 2: 1 2 3"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert all(len(tok.decode([i])) == 1 for i in tok("123456").input_ids)  # digits stay single tokens
    cfg, _ = load_model(tmp_path)
    assert cfg.model_type == family and max(ids) < cfg.vocab_size


def test_make_tiny_reuses_a_shared_tokenizer(tmp_path):
    a = make_tiny(tmp_path / "a", corpus=["12+34=46"])
    tok = load_tokenizer(a)
    b = make_tiny(tmp_path / "b", size="small", tokenizer=tok, seed=1)
    assert load_tokenizer(b).get_vocab() == tok.get_vocab()
    transformers = require_reference("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(b))
    assert m.config.vocab_size == json.loads((a / "config.json").read_text())["vocab_size"]
    assert np.isfinite(m(**tok("1+1=", return_tensors="pt")).logits.detach().numpy()).all()

"""Tiny models made offline: a random-init HF checkpoint plus a byte-level BPE tokenizer trained locally.

Nothing is downloaded. The tokenizer splits digits individually (arithmetic tasks stay learnable), is loadable with
`AutoTokenizer.from_pretrained`, and the model's vocab_size is the tokenizer's length rounded up to a multiple of
`vocab_multiple` (64 by default; the rows past the tokenizer are padding, as in Qwen2.5's checkpoints). head_dim is 32 or more so vLLM's CPU attention accepts the model.
"""

from __future__ import annotations

import pathlib
from typing import Iterable

import jax.numpy as jnp

from opdjax.models import decoder, hf
from opdjax.models.hf import load_tokenizer
from opdjax.models.config import FAMILIES, ModelConfig

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")

# name -> (hidden, intermediate, layers, heads, kv_heads, head_dim)
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 128, 2, 2, 1, 32),
    "small": (128, 384, 4, 4, 2, 32),
    "base": (256, 768, 6, 4, 2, 64),
    "100m": (768, 2048, 12, 12, 4, 64),
}

_DEFAULT_CORPUS = (
    "the quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * = : , . ; ? ! ( ) [ ] sort reverse "
    "copy add answer question model teacher student token sequence number list\n"
)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 256):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `corpus`, with pad/bos/eos special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus) + [_DEFAULT_CORPUS], trainer)
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos,
                                   clean_up_tokenization_spaces=False)


def tiny_config(family: str = "qwen3", size: str = "tiny", vocab_size: int = 320, **overrides) -> ModelConfig:
    """A ModelConfig of a named size; `overrides` replace any field."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    E, F, L, H, K, D = SIZES[size]
    base = dict(model_type=family, vocab_size=vocab_size, hidden_size=E, intermediate_size=F, num_layers=L,
                num_heads=H, num_kv_heads=K, head_dim=D, attention_bias=FAMILIES[family]["attention_bias"],
                qk_norm=FAMILIES[family]["qk_norm"], tie_word_embeddings=False)
    return ModelConfig(**{**base, **overrides})


def make_tiny(out_dir: str | pathlib.Path, family: str = "qwen3", size: str = "tiny", *, seed: int = 0,
              corpus: Iterable[str] = (), tokenizer_vocab: int = 256, dtype: str = "float32",
              tokenizer=None, vocab_multiple: int = 64, **overrides) -> pathlib.Path:
    """Write a random-init HF checkpoint and its tokenizer to out_dir; returns the directory.

    Pass `tokenizer` to reuse one (teacher and student must share a vocabulary). vocab_size = len(tokenizer) rounded
    up to a multiple of `vocab_multiple` (1: no padding rows).
    """
    if vocab_multiple < 1:
        raise ValueError(f"vocab_multiple must be >= 1, got {vocab_multiple}")
    out = pathlib.Path(out_dir)
    tok = tokenizer if tokenizer is not None else train_tokenizer(corpus, tokenizer_vocab)
    vocab = -(-len(tok) // vocab_multiple) * vocab_multiple
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = tiny_config(family, size, vocab_size=vocab, **{**ids, **overrides})
    model = decoder.create(cfg, seed=seed)
    hf.save_model(out, cfg, model, dtype=jnp.dtype(dtype))
    tok.save_pretrained(out)
    return out


__all__ = ["SIZES", "SPECIAL_TOKENS", "load_tokenizer", "make_tiny", "tiny_config", "train_tokenizer"]

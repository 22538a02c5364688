"""Tiny models made offline: a random-init HF checkpoint plus a byte-level BPE tokenizer trained locally.

Nothing is downloaded. The tokenizer splits digits individually (arithmetic tasks stay learnable), is loadable with
`AutoTokenizer.from_pretrained`, and the model's vocab_size is the tokenizer's length rounded up to a multiple of
`vocab_multiple` (64 by default; the rows past the tokenizer are padding, as in Qwen2.5's checkpoints). head_dim is 32 or more so vLLM's CPU attention accepts the model.
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterable

import jax.numpy as jnp

from opdjax.models import decoder, hf
from opdjax.models.chat_formats import CHAT_FORMATS, ChatFormat
from opdjax.models.hf import load_tokenizer
from opdjax.models.config import FAMILIES, ModelConfig

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")
_PLAIN = ChatFormat(template="", special=SPECIAL_TOKENS, pad="<|pad|>", eos="<|eos|>", bos="<|bos|>")  # no template

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


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 256, *, chat: str | None = None):
    """A byte-level BPE `PreTrainedTokenizerFast` trained on `corpus`, with pad/bos/eos special tokens; `chat` (a
    family of `CHAT_FORMATS`: qwen2.5, qwen3, llama3) gives it that family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if chat is not None and chat not in CHAT_FORMATS:
        raise ValueError(f"unknown chat format {chat!r}; choose one of {sorted(CHAT_FORMATS)}")
    fmt = CHAT_FORMATS[chat] if chat else _PLAIN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(fmt.special), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(corpus) + [_DEFAULT_CORPUS], trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=fmt.pad, bos_token=fmt.bos, eos_token=fmt.eos,
                                  clean_up_tokenization_spaces=False)
    if fmt.template:
        out.chat_template = fmt.template
    return out


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
              tokenizer=None, chat: str | None = None, vocab_multiple: int = 64, **overrides) -> pathlib.Path:
    """Write a random-init HF checkpoint and its tokenizer to out_dir; returns the directory.

    Pass `tokenizer` to reuse one (teacher and student must share a vocabulary), or `chat` (a `CHAT_FORMATS` family)
    for a new one with that family's chat template. vocab_size = len(tokenizer) rounded up to a multiple of
    `vocab_multiple` (1: no padding rows).
    """
    if vocab_multiple < 1:
        raise ValueError(f"vocab_multiple must be >= 1, got {vocab_multiple}")
    out = pathlib.Path(out_dir)
    tok = tokenizer if tokenizer is not None else train_tokenizer(corpus, tokenizer_vocab, chat=chat)
    vocab = -(-len(tok) // vocab_multiple) * vocab_multiple
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = tiny_config(family, size, vocab_size=vocab, **{**ids, **overrides})
    model = decoder.create(cfg, seed=seed)
    hf.save_model(out, cfg, model, dtype=jnp.dtype(dtype))
    tok.save_pretrained(out)
    return out


# chat format -> (model family, the tokens generation_config.json lists after the end of turn), as the real instruct
# checkpoints list them (Qwen2.5/Qwen3-Instruct: <|im_end|>, <|endoftext|>; Llama-3.1-Instruct: <|eot_id|>,
# <|end_of_text|>, ...)
INSTRUCT: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen2.5": ("qwen2", ("<|endoftext|>",)),
    "qwen3": ("qwen3", ("<|endoftext|>",)),
    "llama3": ("llama", ("<|end_of_text|>",)),
}


def make_instruct_pair(out_dir: str | pathlib.Path, chat: str, *, student_size: str = "tiny",
                       teacher_size: str = "small", seed: int = 0, corpus: Iterable[str] = ()
                       ) -> tuple[pathlib.Path, pathlib.Path]:
    """(student, teacher) directories under out_dir: random tiny models of `chat`'s family (`INSTRUCT`) with the
    quirks of real instruct pairs — one tokenizer with the family's chat template, vocab_size padded past it
    (student: to a multiple of 128, teacher: 256, as Qwen2.5 3B vs 7B differ), and generation_config.json listing
    several stop ids (the end of turn first)."""
    if chat not in INSTRUCT:
        raise ValueError(f"unknown instruct family {chat!r}; choose one of {sorted(INSTRUCT)}")
    family, extra_stops = INSTRUCT[chat]
    out = pathlib.Path(out_dir)
    student = make_tiny(out / "student", family, student_size, seed=seed, corpus=corpus, chat=chat,
                        vocab_multiple=128)
    tok = load_tokenizer(student)
    teacher = make_tiny(out / "teacher", family, teacher_size, seed=seed + 1, tokenizer=tok, vocab_multiple=256)
    stops = [tok.eos_token_id, *tok.convert_tokens_to_ids(list(extra_stops))]
    for d in (student, teacher):
        gen = {"bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id, "eos_token_id": stops}
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return student, teacher


__all__ = ["CHAT_FORMATS", "INSTRUCT", "SIZES", "SPECIAL_TOKENS", "load_tokenizer", "make_instruct_pair", "make_tiny",
           "tiny_config", "train_tokenizer"]

"""Decoder configuration: one dataclass for the Llama / Qwen2 / Qwen3 family, read from and written to HF config.json.

Both HF config styles are read: top-level `rope_theta` / `rope_scaling` (transformers < 5) and the v5
`rope_parameters` dict. Configs are written in the v5 style, with `rope_theta` kept at top level too.

Two facts a config.json alone does not hold are carried here too:

- the stop ids (`eos_token_ids`): every id config.json's `eos_token_id` lists (an int or a list), with those of
  `generation_config.json` (`from_dir`) and the tokenizer's EOS (`with_tokenizer`); `eos_token_id` stays the first.
- the usable vocabulary (`usable_vocab`, set by `with_tokenizer` to the tokenizer's length): ids at or beyond it
  are padding rows of the embedding and lm_head that no token id reaches (Qwen2.5 pads its 151665 tokens to 151936
  or 152064 rows). The model's logits are over the usable ids only (`decoder.Decoder.logits` slices the lm_head),
  so sampling, log-probs and top-k never see a padded id. Slicing the logits to the first U ids is the same as
  masking the padded ones to -inf before the softmax: softmax over a subset of ids is the full softmax renormalised
  over that subset, exp(z_v) / Σ_{u<U} exp(z_u).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import numpy as np

from opdjax.core import layout
from opdjax.core.errors import ConfigError

# model_type -> (architecture class name, family defaults). Adding a family means adding a row here and a name
# table in `opdjax.models.hf`.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"architecture": "LlamaForCausalLM", "attention_bias": False, "qk_norm": False},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "attention_bias": True, "qk_norm": False},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "attention_bias": False, "qk_norm": True},
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder. Frozen and hashable so it can be a static jit argument."""

    model_type: str = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # Extra rope parameters as a sorted tuple of (key, value) so the config stays hashable.
    rope_extra: tuple[tuple[str, float], ...] = ()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Every stop id, eos_token_id first (normalised in __post_init__: eos_token_id is always in it).
    eos_token_ids: tuple[int, ...] = ()
    # Ids [0, usable_vocab) are the tokenizer's; rows at or beyond are padding (None: every row is usable).
    usable_vocab: int | None = None

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ConfigError(f"unsupported model_type {self.model_type!r}; supported: {sorted(FAMILIES)}")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope type {self.rope_type!r}; supported: {list(ROPE_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.usable_vocab is not None and not 1 <= self.usable_vocab <= self.vocab_size:
            raise ConfigError(f"usable_vocab={self.usable_vocab} must be in [1, vocab_size={self.vocab_size}]")
        stops = _ordered_ids((self.eos_token_id, *self.eos_token_ids))
        object.__setattr__(self, "eos_token_ids", stops)
        object.__setattr__(self, "eos_token_id", stops[0] if stops else None)

    @property
    def usable_size(self) -> int:
        """The number of usable token ids: `usable_vocab`, or vocab_size when every row is usable."""
        return self.vocab_size if self.usable_vocab is None else self.usable_vocab

    def with_tokenizer(self, tokenizer) -> "ModelConfig":
        """This config with the tokenizer's facts: usable_vocab = len(tokenizer) and its EOS among the stop ids.

        ConfigError when the tokenizer has more ids than the model has rows."""
        n = len(tokenizer)
        if n > self.vocab_size:
            raise ConfigError(f"the tokenizer has {n} tokens but the model's vocab_size is {self.vocab_size}; "
                              f"expected vocab_size >= the tokenizer's length")
        eos = getattr(tokenizer, "eos_token_id", None)
        return dataclasses.replace(self, usable_vocab=n,
                                   eos_token_ids=_ordered_ids((*self.eos_token_ids, eos)))

    def with_generation_config(self, gen: dict[str, Any]) -> "ModelConfig":
        """This config with the stop ids of a generation_config.json dict added (its eos_token_id: int or list)."""
        return dataclasses.replace(self, eos_token_ids=_ordered_ids((*self.eos_token_ids,
                                                                     *_as_ids(gen.get("eos_token_id")))))

    @property
    def architecture(self) -> str:
        return FAMILIES[self.model_type]["architecture"]

    @property
    def rope(self) -> dict[str, float]:
        return dict(self.rope_extra)

    def num_params(self) -> int:
        """Parameter count (embeddings included, tied lm_head counted once)."""
        return layout.num_params(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-v5 style config.json dict that transformers and vLLM load."""
        extra = {k: int(v) if k == "original_max_position_embeddings" else v for k, v in self.rope.items()}
        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **extra}
        d = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.model_type in ("qwen2", "qwen3"):
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Read a HF config dict (either rope style). Unsupported architectures are a ConfigError."""
        model_type = d.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(f"{source}: unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
        archs = d.get("architectures") or [FAMILIES[model_type]["architecture"]]
        if archs[0] != FAMILIES[model_type]["architecture"]:
            raise ConfigError(f"{source}: unsupported architectures {archs}; for model_type {model_type!r} "
                              f"expected [{FAMILIES[model_type]['architecture']!r}]")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: unsupported hidden_act {d['hidden_act']!r}; expected 'silu'")
        if d.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"{source}: missing required keys {missing}")
        rope_type, rope_theta, extra = _read_rope(d, source)
        heads = int(d["num_attention_heads"])
        eos = _as_ids(d.get("eos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_extra=extra,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", FAMILIES[model_type]["attention_bias"])),
            qk_norm=FAMILIES[model_type]["qk_norm"],
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "ModelConfig":
        """config.json of a HF directory, with the stop ids of its generation_config.json when there is one."""
        p = pathlib.Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"{p}: no config.json (expected a Hugging Face model directory)")
        cfg = cls.from_hf_dict(_read_json(p), source=str(p))
        gen = pathlib.Path(path) / "generation_config.json"
        return cfg.with_generation_config(_read_json(gen)) if gen.is_file() else cfg

    def save(self, path: str | pathlib.Path) -> None:
        p = pathlib.Path(path)
        p.mkdir(parents=True, exist_ok=True)
        (p / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")


def _read_json(p: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from e


def _as_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` value (None, an int, or a list of ints) as a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _ordered_ids(ids) -> tuple[int, ...]:
    """The distinct ints of `ids` in first-seen order, Nones dropped."""
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _read_rope(d: dict[str, Any], source: str) -> tuple[str, float, tuple[tuple[str, float], ...]]:
    """(rope_type, rope_theta, extra) from either `rope_parameters` (v5) or `rope_theta`/`rope_scaling`."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise ConfigError(f"{source}: unsupported rope type {rope_type!r}; supported: {list(_ROPE_KEYS)}")
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in merged]
    if missing:
        raise ConfigError(f"{source}: rope type {rope_type!r} needs {missing}")
    extra = tuple(sorted((k, float(merged[k])) for k in _ROPE_KEYS[rope_type]))
    return rope_type, float(theta), extra


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] for the config's rope type, in float32 as transformers computes them.

    default: inv_freq_i = theta^(-2i/D).  linear: inv_freq / factor.
    llama3: long wavelengths (> old_ctx/low_freq_factor) divided by factor, short ones (< old_ctx/high_freq_factor)
    kept, and a linear blend in between with s = (old_ctx/wavelen - low) / (high - low).
    """
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D))
    r = cfg.rope
    if cfg.rope_type == "linear":
        return (inv / np.float32(r["factor"])).astype(np.float32)
    if cfg.rope_type == "llama3":
        factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        old = r["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, blended, scaled).astype(np.float32)
    return inv

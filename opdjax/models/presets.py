"""Shapes of public models (from their HF config.json) for memory accounting without a checkpoint.
"""

from __future__ import annotations

import pathlib
from typing import Any

from opdjax.core.errors import ConfigError
from opdjax.models.config import ModelConfig
from opdjax.models.tiny import SIZES, tiny_config

__all__ = ["PRESET_MODELS", "model_config"]


# Public HF config.json shapes (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied, bias, qk_norm).
PRESET_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       attention_bias=False, qk_norm=True),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False,
                       attention_bias=True, qk_norm=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     attention_bias=False, qk_norm=True),
}


def model_config(spec: str):
    """A ModelConfig from a HF directory, a preset in PRESET_MODELS, or a tiny size (tiny/small/base/100m,
    optionally family/size such as llama/small)."""
    p = pathlib.Path(spec)
    if p.is_dir():
        return ModelConfig.from_dir(p)
    if spec in PRESET_MODELS:
        return ModelConfig(**PRESET_MODELS[spec])
    family, _, size = spec.rpartition("/")
    if size in SIZES:
        return tiny_config(family or "qwen3", size)
    raise ConfigError(f"--model {spec!r} is neither a checkpoint directory nor a preset; presets: "
                         f"{sorted(PRESET_MODELS)} or a tiny size {sorted(SIZES)} (optionally family/size)")

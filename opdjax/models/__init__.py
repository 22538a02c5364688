"""The decoder family (Llama / Qwen2 / Qwen3) in Flax NNX, with Hugging Face checkpoint interop."""

from opdjax.models.config import ConfigError, ModelConfig
from opdjax.models.decoder import Decoder, KVCache, abstract, create, forward, init_cache
from opdjax.models.hf import load_config, load_model, load_state, named_params, save_model, state_from_named
from opdjax.models.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "ConfigError", "Decoder", "KVCache", "ModelConfig", "abstract", "create", "forward",
           "init_cache", "load_config", "load_model", "load_state", "named_params", "save_model", "state_from_named"]

"""Fixtures the quant tests share."""

import jax
import pytest
from flax import nnx

from opdjax.models import decoder
from opdjax.models.tiny import tiny_config


@pytest.fixture(scope="module")
def peaked_model():
    """(cfg, graphdef, state) of a tiny qwen3 ("small", vocab 128) whose random init is scaled up (x4 on every
    matrix) so its next-token distributions are peaked, like a trained model's."""
    cfg = tiny_config("qwen3", "small", vocab_size=128)
    m = decoder.create(cfg, seed=0)
    state = jax.tree.map(lambda a: a * 4.0 if a.ndim == 2 else a, nnx.state(m))
    return cfg, nnx.split(m)[0], state

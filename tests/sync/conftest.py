"""Shared fixtures of the bridge tests: a tiny Qwen3 config and four weight sets of it."""

import pytest
from flax import nnx

from opdjax.models import decoder
from opdjax.models.tiny import tiny_config


@pytest.fixture(scope="module")
def cfg():
    return tiny_config("qwen3", "tiny", vocab_size=320)


@pytest.fixture(scope="module")
def params(cfg):
    return [nnx.state(decoder.create(cfg, seed=s)) for s in range(4)]

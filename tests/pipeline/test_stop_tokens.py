"""Every stop id ends a completion: a model whose generation_config.json lists [eos, X] stops at X, the SECOND listed
id, in the JAX engine, an `opdjax serve`-style engine server and vLLM in-process, and the learner's mask ends there.

X is the token greedy decoding first emits at a step k >= 1 that it did not emit before (so the row runs k steps
without stopping, then stops exactly at X)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opdjax.config import TrainConfig, load
from opdjax.models import hf
from opdjax.models.tiny import load_tokenizer, make_tiny
from opdjax.pipeline.components import sampling_params
from opdjax.pipeline.opd import learner_batch
from opdjax.remote.client import CallSettings, RemoteEngine
from opdjax.remote.server import EngineServer
from opdjax.rollout.jax_engine import JaxEngine
from opdjax.sync import Publisher

PROMPT = [5, 9, 14, 20]
N = 8


@pytest.fixture(scope="module")
def stop_model(pair, tmp_path_factory):
    """(model dir whose generation_config.json lists [eos, X], X, k: the completion index where X first comes)."""
    tok = load_tokenizer(pair[0])
    d = make_tiny(tmp_path_factory.mktemp("stops") / "m", "qwen3", "tiny", seed=4, tokenizer=tok)
    engine = JaxEngine.from_pretrained(d, pad_id=tok.pad_token_id)
    sp = sampling_params(_cfg(), hf.load_config(d), temperature=0.0)
    greedy = engine.generate([PROMPT], sp, seed=0).completions()[0]
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i] and greedy[i] != tok.eos_token_id)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, int(greedy[k])]}))
    return str(d), int(greedy[k]), k


def _cfg(*extra):
    return load(TrainConfig, None, [f"rollout.max_new_tokens={N}", "rollout.temperature=0", *extra])


def _check_stops_at_x(batch, x: int, k: int) -> None:
    comp = batch.completions()[0]
    assert len(comp) == k + 1 and comp[-1] == x and x not in comp[:-1]
    mask = learner_batch(batch, needs=frozenset()).mask_BT[0]
    last = int(np.flatnonzero(mask)[-1])
    assert batch.tokens_BT[0, last] == x and not mask[last + 1:].any()


def test_the_stop_set_unions_tokenizer_config_generation_config_and_rollout_keys(stop_model):
    d, x, _ = stop_model
    eos = load_tokenizer(d).eos_token_id
    sp = sampling_params(_cfg("rollout.stop_token_ids=[7]"), hf.load_config(d))
    assert sp.stop_token_ids == (eos, x, 7)


def test_the_jax_engine_stops_at_the_second_listed_eos(stop_model):
    d, x, k = stop_model
    sp = sampling_params(_cfg(), hf.load_config(d))
    engine = JaxEngine.from_pretrained(d, pad_id=load_tokenizer(d).pad_token_id)
    _check_stops_at_x(engine.generate([PROMPT], sp, seed=0), x, k)


def test_a_served_engine_stops_at_the_second_listed_eos(stop_model):
    d, x, k = stop_model
    cfg = hf.load_config(d)
    sp = sampling_params(_cfg(), cfg)
    engine = JaxEngine.from_pretrained(d, pad_id=load_tokenizer(d).pad_token_id, eos_id=None)
    with EngineServer(engine=engine, token="stop-secret") as server:
        with RemoteEngine([f"127.0.0.1:{server.port}"], "stop-secret", cfg, pad_id=0,
                          calls=CallSettings(wait_s=5)) as remote:
            Publisher(cfg, remote.link, dtype="float32").publish(hf.read_tensors(d), 0)  # the run's weights first
            _check_stops_at_x(remote.generate([PROMPT], sp, seed=0), x, k)


@pytest.mark.slow  # one vLLM engine start
@pytest.mark.vllm
def test_vllm_in_process_stops_at_the_second_listed_eos(vllm_module, stop_model):
    from opdjax.rollout.vllm_engine import VllmEngine

    d, x, k = stop_model
    sp = sampling_params(_cfg(), hf.load_config(d))
    engine = VllmEngine(d, dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_seqs=4)
    _check_stops_at_x(engine.generate([PROMPT], sp, seed=0), x, k)

"""Links (`sync.transport`): every transport delivers the same bits to a real JaxEngine and returns only once the
engine has applied the version; a staleness-holding engine is not fed the same snapshot twice; close() cleans up."""

import numpy as np
import pytest

from opdjax.models import hf
from opdjax.rollout import SamplingParams
from opdjax.rollout import EngineMismatch, JaxEngine
from opdjax.sync import TRANSPORTS, BridgeError, Publisher, open_link


def _sample(engine):
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    return engine.generate([[1, 2, 3], [4, 5]], sp, seed=7)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_link_delivers_the_same_weights_and_waits_for_the_engine(kind, cfg, params, tmp_path):
    ref = JaxEngine(cfg, params[0], pad_id=0)
    ref.update_weights(hf.named_params(cfg, params[1]), 1)
    engine = JaxEngine(cfg, params[0], pad_id=0)
    link = open_link(kind, engine.receiver, root=tmp_path / "snap" if kind == "shm" else None, timeout=30)
    try:
        Publisher(cfg, link, dtype="float32").publish(params[1], 1)
        assert engine.version == 1  # applied before publish returned, whatever the transport
        a, b = _sample(engine), _sample(ref)
        np.testing.assert_array_equal(a.tokens_BT, b.tokens_BT)
        np.testing.assert_array_equal(a.rollout_logp_BT, b.rollout_logp_BT)
        with pytest.raises(BridgeError):  # a bf16 publish to an f32 engine is refused; v1 keeps serving
            Publisher(cfg, link, dtype="bfloat16").publish(params[2], 2)
        assert engine.version == 1
    finally:
        link.close()


def test_shm_link_feeds_a_stale_engine_each_snapshot_once(cfg, params):
    engine = JaxEngine(cfg, params[0], pad_id=0, mismatch=EngineMismatch(stale_versions=1))
    link = open_link("shm", engine.receiver)
    root = link.transport.root
    try:
        pub = Publisher(cfg, link, dtype="float32")
        for v in (1, 2, 3):
            pub.publish(params[v], v)
        assert engine.published_versions == [2, 3] and engine.version == 2
        assert engine.receiver.received_version == 3
    finally:
        link.close()
    assert not root.exists()  # the link made the directory, so it removes it


def test_unknown_transport_is_refused_by_name(cfg, params):
    engine = JaxEngine(cfg, params[0], pad_id=0)
    with pytest.raises(ValueError, match="valid transports are inproc, shm, tcp"):
        open_link("carrier-pigeon", engine.receiver)

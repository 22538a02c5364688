"""The forward on a (data, fsdp, tensor) mesh of 8 CPU devices equals the 1-device result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from opdjax.models import ModelConfig, create, forward, load_state, save_model
from opdjax.models.sharding import batch_sharding, logical_spec, make_mesh, param_shardings, shard_state

CFG = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32)


def test_logical_spec_drops_axes_that_do_not_divide(cpu_devices):
    mesh = make_mesh((2, 2, 2))
    assert logical_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert logical_spec(("embed", "mlp"), (63, 128), mesh) == P(None, "tensor")
    assert logical_spec(("batch", None), (8, 3), mesh) == P(("data", "fsdp"), None)
    with pytest.raises(ValueError, match="logical axis 'bogus' has no rule"):
        logical_spec(("bogus",), (4,), mesh)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh((4, 2, 2))


@pytest.mark.mesh
def test_sharded_forward_equals_single_device(cpu_devices, tmp_path):
    model = create(CFG, seed=3)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, (4, 16)))
    graphdef, state = nnx.split(model)
    single = jax.jit(lambda s, t: forward(graphdef, s, t)[0])(state, tokens)

    mesh = make_mesh((2, 2, 2))
    sharded_state = shard_state(state, mesh)
    q = sharded_state["layers"][0]["attn"]["q"]["kernel"]
    assert q.get_value().sharding.spec == P("fsdp", "tensor")
    tok_s = jax.device_put(tokens, batch_sharding(mesh, tokens.shape))
    out = jax.jit(lambda s, t: forward(graphdef, s, t)[0])(sharded_state, tok_s)
    assert len(out.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(out), np.asarray(single), atol=1e-5, rtol=0)

    # Loading straight onto the mesh gives the same shardings and values.
    save_model(tmp_path, CFG, model)
    _, loaded = load_state(tmp_path, mesh=mesh)
    want = param_shardings(state, mesh)
    for (p, v), (_, s) in zip(nnx.to_flat_state(loaded), nnx.to_flat_state(want)):
        assert v.get_value().sharding.spec == s.spec, p
    out2 = jax.jit(lambda s, t: forward(graphdef, s, t)[0])(loaded, tok_s)
    np.testing.assert_allclose(np.asarray(out2), np.asarray(single), atol=1e-5, rtol=0)

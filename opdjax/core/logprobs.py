"""Shifted token log-probs: the one place where "the log-prob of token l" is computed from logits or hidden states.

Position l of a `*_logp_BT` array is the log-prob of tokens[:, l] under the distribution predicted at l - 1, at
temperature T (logits / T), with 0 at l = 0. The learner, the JAX engine's scoring and the JAX teacher all use
these functions; `chunked_token_logprobs` computes the same values from final hidden states without
materialising the [B, T, V] logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _pad1(x: Array) -> Array:
    """Prepend one zero position on axis 1 ([B, T-1, ...] -> [B, T, ...])."""
    return jnp.pad(x, ((0, 0), (1, 0)) + ((0, 0),) * (x.ndim - 2))


def shifted_logprobs(logits_BTV: Array, tokens_BT: Array, temperature: float = 1.0, *, top_k: int = 0,
                     full: bool = False) -> dict[str, Array]:
    """Log-probs of the given tokens from the logits predicting them, plus optional top-k and full rows.

    lp = log_softmax(float32(logits[:, :-1]) / T);  logp_BT[b, l] = lp[b, l-1, tokens[b, l]], 0 at l = 0.
    top_k > 0: topk_logp_BTK / topk_ids_BTK, the k most likely tokens of the distribution predicting l.
    full: logprobs_BTV, the whole shifted lp (zeros at l = 0).
    """
    lp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32) / jnp.float32(temperature), axis=-1)
    out = {"logp_BT": _pad1(jnp.take_along_axis(lp_BTV, tokens_BT[:, 1:, None], axis=-1)[..., 0])}
    if top_k > 0:
        vals, ids = jax.lax.top_k(lp_BTV, top_k)
        out["topk_logp_BTK"], out["topk_ids_BTK"] = _pad1(vals), _pad1(ids.astype(jnp.int32))
    if full:
        out["logprobs_BTV"] = _pad1(lp_BTV)
    return out


def token_logprobs(logits_BTV: Array, tokens_BT: Array, temperature: float = 1.0,
                   full: bool = False) -> tuple[Array, Array | None]:
    """(logp_BT, the full shifted log-softmax [B, T, V] or None): `shifted_logprobs` as a pair."""
    out = shifted_logprobs(logits_BTV, tokens_BT, temperature, full=full)
    return out["logp_BT"], out.get("logprobs_BTV")


LOGPROB_CHUNK_ELEMENTS = 1 << 26  # default chunk: at most 64M logits (256 MB in f32) per chunk


def logprob_chunk_len(batch: int, length: int, vocab: int, max_elements: int = LOGPROB_CHUNK_ELEMENTS) -> int:
    """Positions per chunk so that batch * chunk * vocab <= max_elements (at least 1, at most `length`)."""
    return int(max(1, min(length, max_elements // max(batch * vocab, 1))))


def chunked_token_logprobs(h_BTE: Array, w_EV: Array, tokens_BT: Array, temperature: float = 1.0,
                           chunk: int | None = None) -> Array:
    """Token log-probs from final hidden states without materialising the [B, T, V] logits.

    logp_BT[b, l] = z[tokens[b, l]] - logsumexp(z),  z = (h[b, l-1] @ W) / T  in float32;  logp_BT[:, 0] = 0.

    The L-1 predicting positions are processed `chunk` at a time (default: `logprob_chunk_len`) under
    `jax.checkpoint`, so the forward keeps only [B, chunk, V] logits alive and the backward pass recomputes each
    chunk's logits instead of storing them: peak logits memory B·chunk·V instead of several B·L·V float32 arrays.
    The same values as `token_logprobs(h @ W, tokens, T)` up to float32 rounding. h [B, T, E], W [E, V].
    """
    B, L, E = h_BTE.shape
    V = w_EV.shape[-1]
    n = L - 1
    if n <= 0:
        return jnp.zeros((B, L), jnp.float32)
    c = logprob_chunk_len(B, n, V) if chunk is None else max(1, min(int(chunk), n))
    k = -(-n // c)
    pad = k * c - n
    h = jnp.pad(h_BTE[:, :-1], ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, pad)))
    h_KBCE = h.reshape(B, k, c, E).swapaxes(0, 1)
    t_KBC = t.reshape(B, k, c).swapaxes(0, 1)
    temp = jnp.float32(temperature)

    @jax.checkpoint
    def one(h_BCE, t_BC):
        z_BCV = jnp.dot(h_BCE, w_EV.astype(h_BCE.dtype)).astype(jnp.float32) / temp
        tok = jnp.take_along_axis(z_BCV, t_BC[..., None], axis=-1)[..., 0]
        return tok - jax.nn.logsumexp(z_BCV, axis=-1)

    if k == 1:
        lp_BN = one(h_KBCE[0], t_KBC[0])
    else:
        lp_BN = jax.lax.map(lambda a: one(*a), (h_KBCE, t_KBC)).swapaxes(0, 1).reshape(B, k * c)
    return jnp.pad(lp_BN[:, :n], ((0, 0), (1, 0)))

"""The wire format between the pipeline and engine servers: a subset of the OpenAI completions API as vLLM serves it.

Rollouts: POST /v1/completions with token-id prompts,

    {"prompt": [[ids...], ...], "max_tokens": N, "temperature": t, "top_p": p, "top_k": k, "seed": s,
     "stop_token_ids": [...], "logprobs": 0, "return_token_ids": true}

answered with one choice per prompt, in order,

    {"choices": [{"index": i, "token_ids": [...], "logprobs": {"token_logprobs": [...]}, "finish_reason": ...,
                  "weight_version": v}, ...], "weight_version": v}

`token_logprobs` are the engine's processed log-probs of the sampled tokens (after temperature / top-k / top-p);
`weight_version` is the version that produced the choice (vLLM: `set_weight_version`'s tag). A missing version is
an error: a rollout of unknown version is never trained on.

Teacher scores: the same endpoint with `"max_tokens": 1, "prompt_logprobs": K` on the sequences to score; each
choice's `prompt_logprobs` is vLLM's: null at position 0, then for each position a dict token id (a string) ->
{"logprob": x, "rank": r} holding the top K (ranks 1..K) and the scored token itself.

`rollout_batch` and `teacher_scores` rebuild the in-process arrays from these, in the embedded engine's layout
(prompts left-padded to `bucket_len(max prompt length)`, then max_tokens completion slots), so a run against one
server sees exactly the batch an in-process engine would give.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from opdjax.core.errors import InputError
from opdjax.rollout.base import MIN_TEMPERATURE, RolloutBatch, SamplingParams
from opdjax.rollout.jax_engine import bucket_len
from opdjax.teacher.base import TeacherScores

__all__ = ["ProtocolError", "ServerLimits", "completion_request", "completion_response", "rollout_batch",
           "sampling_from_request", "score_from_request", "score_request", "score_response", "teacher_scores",
           "token_rows"]


class ProtocolError(InputError):
    """A server's answer does not follow the protocol (missing field, wrong count, unknown version)."""


# ----------------------------------------------------------------------------------------------------- rollouts

def completion_request(prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> dict[str, Any]:
    """The request body sampling one completion of each token-id prompt."""
    return {"prompt": [[int(t) for t in p] for p in prompts], "max_tokens": int(sampling.max_new_tokens),
            "temperature": float(sampling.temperature), "top_p": float(sampling.top_p), "top_k": int(sampling.top_k),
            "seed": int(seed), "stop_token_ids": [int(t) for t in sampling.stop_token_ids], "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False}


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one engine server accepts (`opdjax serve` flags of the same names); a request beyond them is a 400.

    max_body_bytes     one request body            max_batch        prompts (or sequences) per request
    max_tokens         max_tokens per request      max_top_k        top_k / prompt_logprobs
    idle_timeout       seconds a connection may be silent (HTTP requests; bridge transfers: transfer_idle_timeout)
    request_timeout    seconds a client may take to send one whole request (a byte-trickling slow-loris is cut)
    transfer_idle_timeout  seconds a weight transfer may stall before it is dropped
    refusal_log_per_min    refusals logged per minute (the rest counted); paths are logged truncated
    A prompt plus max_tokens must fit the model's positions.
    """

    max_body_bytes: int = 64 << 20
    max_batch: int = 1024
    max_tokens: int = 4096
    max_top_k: int = 64
    idle_timeout: float = 20.0
    request_timeout: float = 60.0
    transfer_idle_timeout: float = 30.0
    refusal_log_per_min: int = 20


def _int_field(body: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"'{key}' must be an integer in [{lo}, {hi}], got {repr(v)[:40]}")
    return v


def _float_field(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        v = default
    if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(float(v))
            or not lo <= float(v) <= hi):
        raise ValueError(f"'{key}' must be a finite number in [{lo:g}, {hi:g}], got {repr(v)[:40]}")
    return float(v)


def token_rows(value: Any, what: str, vocab_size: int, max_len: int, max_rows: int) -> list[list[int]]:
    """A non-empty list (at most max_rows) of non-empty token-id lists (at most max_len ids in [0, vocab_size))."""
    if not isinstance(value, list) or not value or not all(isinstance(r, list) and r for r in value):
        raise ValueError(f"'{what}' must be a non-empty list of non-empty token-id lists")
    if len(value) > max_rows:
        raise ValueError(f"'{what}' has {len(value)} rows; this server takes at most {max_rows} per request")
    for i, row in enumerate(value):
        if len(row) > max_len:
            raise ValueError(f"'{what}' row {i} has {len(row)} tokens; the model takes at most {max_len}")
        for t in row:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(f"'{what}' row {i}: token id {repr(t)[:40]} is not an integer in "
                                 f"[0, {vocab_size})")
    return value


def sampling_from_request(body: Mapping[str, Any], *, vocab_size: int, max_positions: int,
                          limits: ServerLimits = ServerLimits()) -> tuple[list[list[int]], SamplingParams, int]:
    """Server side: (prompts, SamplingParams, seed) of a completions request; ValueError names a bad field.

    Every field is checked, never coerced: integer ids in the vocabulary, integer max_tokens / top_k / seed,
    finite temperature (0 or >= MIN_TEMPERATURE) and top_p, and each prompt plus max_tokens within the model's
    positions."""
    max_tokens = _int_field(body, "max_tokens", 16, 1, min(limits.max_tokens, max_positions - 1))
    prompts = token_rows(body.get("prompt"), "prompt", vocab_size, max_positions - max_tokens, limits.max_batch)
    temperature = _float_field(body, "temperature", 1.0, 0.0, 1e4)
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"'temperature' {temperature:g} is below {MIN_TEMPERATURE:g}; use 0 for greedy decoding")
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or len(stop) > 64:
        raise ValueError("'stop_token_ids' must be a list of at most 64 token ids")
    if stop:
        token_rows([stop], "stop_token_ids", vocab_size, 64, 1)
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                        top_k=_int_field(body, "top_k", 0, 0, vocab_size),
                        top_p=_float_field(body, "top_p", 1.0, 1e-9, 1.0), stop_token_ids=tuple(stop))
    return prompts, sp, _int_field(body, "seed", 0, 0, 2**63 - 1)


def score_from_request(body: Mapping[str, Any], *, vocab_size: int, max_positions: int,
                       limits: ServerLimits = ServerLimits()) -> tuple[list[list[int]], int]:
    """Server side: (sequences, k) of a teacher scoring request (prompt_logprobs = k); ValueError names a bad
    field (a non-integer k, an id outside the vocabulary, a sequence longer than the model's positions)."""
    if "prompt_logprobs" not in body or body["prompt_logprobs"] is None:
        raise ValueError("this is a teacher server; ask for prompt_logprobs")
    k = _int_field(body, "prompt_logprobs", 0, 0, limits.max_top_k)
    rows = token_rows(body.get("prompt"), "prompt", vocab_size, max_positions, limits.max_batch)
    return rows, k


def completion_response(batch: RolloutBatch, model: str = "opdjax") -> dict[str, Any]:
    """Server side: the response for a RolloutBatch (rows in request order)."""
    choices = []
    for i in range(batch.batch_size):
        m = batch.completion_mask_BT[i]
        ids = batch.tokens_BT[i][m].tolist()
        lps = [float(x) for x in batch.rollout_logp_BT[i][m]]
        stopped = len(ids) < int(batch.meta.get("sampling", {}).get("max_new_tokens", len(ids) + 1))
        choices.append({"index": i, "text": "", "token_ids": ids, "logprobs": {"token_logprobs": lps},
                        "finish_reason": "stop" if stopped else "length", "weight_version": int(batch.version_B[i])})
    return {"object": "text_completion", "model": model, "choices": choices,
            "weight_version": int(np.min(batch.version_B)) if batch.batch_size else None}


def rollout_batch(prompts: Sequence[Sequence[int]], response: Mapping[str, Any], sampling: SamplingParams,
                  pad_id: int) -> RolloutBatch:
    """Client side: a RolloutBatch in the embedded engine's layout from a completions response."""
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != len(prompts):
        raise ProtocolError(f"the server answered {len(choices) if isinstance(choices, list) else 'no'} choices for "
                            f"{len(prompts)} prompts")
    choices = sorted(choices, key=lambda c: int(c.get("index", 0)))
    n, N = len(prompts), int(sampling.max_new_tokens)
    P = bucket_len(max(len(p) for p in prompts))
    tokens = np.full((n, P + N), pad_id, np.int32)
    valid = np.zeros((n, P + N), bool)
    comp = np.zeros((n, P + N), bool)
    logp = np.zeros((n, P + N), np.float32)
    version = np.zeros((n,), np.int64)
    for j, (p, c) in enumerate(zip(prompts, choices)):
        ids = c.get("token_ids")
        lps = (c.get("logprobs") or {}).get("token_logprobs")
        v = c.get("weight_version", response.get("weight_version"))
        if ids is None or lps is None or len(ids) != len(lps) or len(ids) > N:
            raise ProtocolError(f"choice {j}: expected token_ids and logprobs.token_logprobs of equal length <= {N}")
        if v is None:
            raise ProtocolError(f"choice {j} carries no weight_version; a rollout of unknown version is not used")
        if any(x is None or not math.isfinite(float(x)) for x in lps):
            raise ProtocolError(f"choice {j}: a sampled token has no finite log-prob")
        tokens[j, P - len(p):P] = p
        valid[j, P - len(p):P] = True
        k = len(ids)
        tokens[j, P:P + k] = ids
        valid[j, P:P + k] = comp[j, P:P + k] = True
        logp[j, P:P + k] = lps
        version[j] = int(v)
    return RolloutBatch(tokens_BT=tokens, valid_BT=valid, completion_mask_BT=comp, rollout_logp_BT=logp,
                        version_B=version, prompt_index_B=np.arange(n, dtype=np.int64),
                        meta={"engine": "remote", "prompt_len": P, "version": int(version.min())})


# ----------------------------------------------------------------------------------------------------- teacher

def score_request(tokens_BT: np.ndarray, valid_BT: np.ndarray, top_k: int) -> dict[str, Any]:
    """The request body scoring each row's valid tokens (prompt log-probs with the top `top_k`)."""
    rows = [row[v].tolist() for row, v in zip(np.asarray(tokens_BT), np.asarray(valid_BT, bool))]
    return {"prompt": rows, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": max(int(top_k), 0),
            "logprobs": 0, "return_token_ids": True}


def score_response(scores: TeacherScores, tokens_BT: np.ndarray, valid_BT: np.ndarray, top_k: int,
                   model: str = "opdjax") -> dict[str, Any]:
    """Server side: prompt_logprobs of each row's valid positions from in-process TeacherScores."""
    choices = []
    for i, (row, v) in enumerate(zip(np.asarray(tokens_BT), np.asarray(valid_BT, bool))):
        pos = np.flatnonzero(v)
        plp: list[Any] = [None]
        for t in pos[1:]:
            d = {}
            if top_k and scores.teacher_topk_ids_BTK is not None:
                for r, (tid, lp) in enumerate(zip(scores.teacher_topk_ids_BTK[i, t][:top_k],
                                                  scores.teacher_topk_logp_BTK[i, t][:top_k])):
                    d[str(int(tid))] = {"logprob": float(lp), "rank": r + 1}
            key = str(int(row[t]))
            if key not in d:
                d[key] = {"logprob": float(scores.teacher_logp_BT[i, t]), "rank": None}
            plp.append(d)
        choices.append({"index": i, "text": "", "token_ids": [], "prompt_logprobs": plp})
    return {"object": "text_completion", "model": model, "choices": choices}


def teacher_scores(tokens_BT: np.ndarray, valid_BT: np.ndarray, response: Mapping[str, Any],
                   top_k: int) -> TeacherScores:
    """Client side: TeacherScores on the [B, T] layout from a prompt_logprobs response.

    Positions that are not valid, and each row's first valid position, get 0 (they are never in a loss mask)."""
    tokens_BT, valid_BT = np.asarray(tokens_BT), np.asarray(valid_BT, bool)
    B, T = tokens_BT.shape
    choices = response.get("choices")
    if not isinstance(choices, list) or len(choices) != B:
        raise ProtocolError(f"the teacher answered {len(choices) if isinstance(choices, list) else 'no'} choices for "
                            f"{B} sequences")
    choices = sorted(choices, key=lambda c: int(c.get("index", 0)))
    logp = np.zeros((B, T), np.float32)
    ids = np.zeros((B, T, top_k), np.int32) if top_k else None
    tlp = np.zeros((B, T, top_k), np.float32) if top_k else None
    for i, c in enumerate(choices):
        pos = np.flatnonzero(valid_BT[i])
        plp = c.get("prompt_logprobs")
        if not isinstance(plp, list) or len(plp) != len(pos):
            raise ProtocolError(f"sequence {i}: expected prompt_logprobs for {len(pos)} positions")
        for t, d in zip(pos[1:], plp[1:]):
            entry = d.get(str(int(tokens_BT[i, t]))) if isinstance(d, dict) else None
            if entry is None:
                raise ProtocolError(f"sequence {i}, position {t}: no log-prob for the scored token")
            logp[i, t] = entry["logprob"]
            if top_k:
                ranked = sorted(((e["rank"], int(k), e["logprob"]) for k, e in d.items() if e.get("rank")),
                                key=lambda x: x[0])[:top_k]
                if len(ranked) < top_k:
                    raise ProtocolError(f"sequence {i}, position {t}: {len(ranked)} ranked log-probs, expected {top_k}")
                ids[i, t] = [k for _, k, _ in ranked]
                tlp[i, t] = [lp for _, _, lp in ranked]
    return TeacherScores(teacher_logp_BT=logp, teacher_topk_ids_BTK=ids, teacher_topk_logp_BTK=tlp)

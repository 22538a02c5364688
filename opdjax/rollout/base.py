"""The rollout engine protocol and the batch every engine returns.

A batch holds whole sequences (prompt + completion) on one padded time axis L. Position l of
`rollout_logp_BT` is the engine's log-probability of `tokens_BT[:, l]` (after temperature and top-k/top-p
renormalisation, as vLLM's `processed_logprobs`), set only where `completion_mask_BT` is true.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, Sequence

import numpy as np


def check_token_ids(what: str, ids: np.ndarray, vocab_size: int) -> None:
    """Raise ValueError naming `what` and the first id outside [0, vocab_size)."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise ValueError(f"{what}: token id {int(bad)} is outside the vocabulary [0, {vocab_size})")


MIN_TEMPERATURE = 1e-5  # vLLM's sampling epsilon: a smaller positive temperature overflows logits / T


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How an engine samples. `top_k=0` and `top_p=1.0` mean no truncation.

    temperature=0 means greedy decoding (argmax of the raw logits); the reported log-prob of the chosen token is
    then its log-softmax at temperature 1 over the full vocabulary (top-k/top-p cannot change the argmax and are
    not applied to it).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, inf), got "
                             f"{self.temperature}: below {MIN_TEMPERATURE:g} logits / temperature overflow (vLLM "
                             "treats such a temperature as greedy); use 0 for greedy decoding")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class RolloutBatch:
    """Sequences sampled by an engine, padded to a common length L.

    tokens_BT           int32   prompt + completion token ids (pad id where invalid)
    valid_BT            bool    real tokens (prompt or completion)
    completion_mask_BT  bool    sampled completion tokens (including a sampled stop token)
    rollout_logp_BT     float32 engine log-prob of tokens_BT[b, l] where completion_mask_BT, else 0
    version_B           int64   weight version each row was sampled with
    prompt_index_B      int64   index of each row's prompt in the request (graders use it)
    meta                dict    engine name, sampling params, anything a grader or logger wants
    """

    tokens_BT: np.ndarray
    valid_BT: np.ndarray
    completion_mask_BT: np.ndarray
    rollout_logp_BT: np.ndarray
    version_B: np.ndarray
    prompt_index_B: np.ndarray
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        B, L = np.shape(self.tokens_BT)
        for name in ("valid_BT", "completion_mask_BT", "rollout_logp_BT"):
            if np.shape(getattr(self, name)) != (B, L):
                raise ValueError(f"RolloutBatch.{name} has shape {np.shape(getattr(self, name))}, expected {(B, L)}")
        for name in ("version_B", "prompt_index_B"):
            if np.shape(getattr(self, name)) != (B,):
                raise ValueError(f"RolloutBatch.{name} has shape {np.shape(getattr(self, name))}, expected {(B,)}")

    @property
    def batch_size(self) -> int:
        return int(self.tokens_BT.shape[0])

    def completions(self) -> list[list[int]]:
        """Completion token ids of each row, in order."""
        return [row[m].tolist() for row, m in zip(self.tokens_BT, self.completion_mask_BT)]


def pad_left(batch: RolloutBatch, T: int, pad_id: int) -> RolloutBatch:
    """The batch widened to T positions by padding columns inserted on the left (no-op when already T wide):
    several learner processes' shares must share one length to form one global batch."""
    L = batch.tokens_BT.shape[1]
    if T < L:
        raise ValueError(f"pad_left: the batch is {L} positions wide, more than the requested {T}")
    if T == L:
        return batch
    w = ((0, 0), (T - L, 0))
    return dataclasses.replace(batch, tokens_BT=np.pad(batch.tokens_BT, w, constant_values=pad_id),
                               valid_BT=np.pad(batch.valid_BT, w), completion_mask_BT=np.pad(batch.completion_mask_BT, w),
                               rollout_logp_BT=np.pad(batch.rollout_logp_BT, w),
                               meta={**batch.meta, "prompt_len": batch.meta.get("prompt_len", 0) + T - L})


class RolloutEngine(Protocol):
    """What OPD needs from a sampler (`JaxEngine`, `VllmEngine`, `remote.RemoteEngine` implement it).

    Weights arrive either directly (`update_weights`, HF names and layout) or through the weight bridge: a
    `sync.Publisher` sends a versioned manifest to the engine's `receiver`, which validates it completely and then
    applies it all or nothing. `version` is the version being served (-1 before any weights); every row of a
    `RolloutBatch` carries the version it was sampled with.
    """

    @property
    def version(self) -> int:
        """The weight version being served."""

    @property
    def receiver(self) -> Any:
        """The bridge's engine side (`sync.WeightReceiver`) a publisher's link feeds."""

    @property
    def outages(self) -> list[dict[str, Any]]:
        """Down/up events of the servers behind the engine (empty for an in-process engine)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample one completion per prompt."""

    def update_weights(self, named_arrays: Mapping[str, Any], version: int) -> None:
        """Atomically replace the served weights (HF names -> arrays); on any error keep the old ones."""

    def mark_published(self, version: int) -> None:
        """Another learner process published `version` through the bridge (a no-op for in-process engines)."""

    def score(self, tokens_BT: np.ndarray, valid_BT: np.ndarray, *, temperature: float = 1.0,
              top_k: int = 0) -> dict[str, Any]:
        """Log-probs of the given tokens under the served weights: {"logp_BT", "version"} (+ "topk_ids_BTK",
        "topk_logp_BTK" when top_k > 0); position l scores tokens[:, l] from logits[:, l-1] / temperature."""

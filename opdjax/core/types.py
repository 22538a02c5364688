"""The one training-batch schema: `Batch`, a frozen pytree of [B, T] arrays (B rows, T padded positions).

Position t of every `*_logp_BT` is the log-prob of `tokens_BT[:, t]` given the tokens before it (0 at t = 0). The
pipeline builds a Batch from a rollout (`rollout.RolloutBatch`) plus the teacher's scores and rewards; the learner
steps on it and the losses read it — the same field names from engine to loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

__all__ = ["Batch", "BATCH_FIELDS"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """Per-batch arrays (host NumPy or jax Arrays; None = absent). A pytree: passes through ``jit``.

    tokens_BT               int     token ids (prompt + completion, padded)
    valid_BT                bool    real tokens (not padding): what attention sees
    mask_BT                 bool/0-1  completion tokens to train on                          (always required)
    rollout_logp_BT         float   engine log-prob of tokens_BT[b, t]                       (mismatch, corrections)
    teacher_logp_BT         float   teacher log-prob of tokens_BT[b, t]
    teacher_topk_ids_BTK    int     teacher's top-k token ids at each position (distinct)
    teacher_topk_logp_BTK   float   their teacher log-probs, normalised over the *full* vocabulary
    teacher_logits_BTV      float   teacher logits (or log-probs) over the full vocabulary
    reward_B                float   task reward per row
    """

    mask_BT: Any
    tokens_BT: Any = None
    valid_BT: Any = None
    rollout_logp_BT: Any = None
    teacher_logp_BT: Any = None
    teacher_topk_ids_BTK: Any = None
    teacher_topk_logp_BTK: Any = None
    teacher_logits_BTV: Any = None
    reward_B: Any = None

    @classmethod
    def from_mapping(cls, d: "Batch | Mapping[str, Any]", *, where: str = "batch") -> "Batch":
        """A Batch from a dict with these field names; an unknown or missing mask field is a ValueError."""
        if isinstance(d, Batch):
            return d
        unknown = sorted(set(d) - set(BATCH_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected a subset of {list(BATCH_FIELDS)}")
        if "mask_BT" not in d:
            raise ValueError(f"{where}: missing 'mask_BT' (the completion tokens to train on)")
        return cls(**d)

    def present(self) -> dict[str, Any]:
        """The fields that are not None, by name."""
        return {f: getattr(self, f) for f in BATCH_FIELDS if getattr(self, f) is not None}

    def require(self, fields, *, where: str = "batch") -> None:
        """Raise ValueError naming every field of `fields` that is None."""
        missing = [f for f in fields if getattr(self, f) is None]
        if missing:
            raise ValueError(f"{where}: missing {missing}")


BATCH_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Batch))

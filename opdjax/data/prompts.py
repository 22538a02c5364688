"""Token-level data: prompts and supervised examples from a task, padded into the learner's [B, T] layout."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from opdjax.core.types import Batch
from opdjax.data.chat import render_chat
from opdjax.data.tasks import Example, Task


def encode_prompts(tokenizer, examples: Sequence[Example]) -> list[list[int]]:
    """Token ids of each prompt: a chat prompt (``ex.chat``) rendered by the tokenizer's chat template with the
    generation prompt appended (`data.chat.render_chat`), any other (and a ``chat: auto`` text prompt when the
    tokenizer has no template) its text with no special tokens added."""
    out = [None if ex.chat is None else render_chat(tokenizer, ex.chat) for ex in examples]
    plain = [i for i, ids in enumerate(out) if ids is None]
    if plain:  # one batched call: a file of many plain prompts is tokenized at the tokenizer's batch speed
        for i, ids in zip(plain, tokenizer([examples[i].prompt for i in plain], add_special_tokens=False).input_ids):
            out[i] = ids
    return out


def sft_batch(tokenizer, examples: Sequence[Example], length: int | None = None) -> Batch:
    """[left-padded prompt | answer + EOS | right pad] rows; the completion mask covers answer + EOS.

    Returns tokens_BT, valid_BT and mask_BT (the answer tokens); no rollout_logp_BT: no engine produced them, so the
    learner logs no mismatch metrics.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = encode_prompts(tokenizer, examples)
    answers = [tokenizer(ex.answer or "", add_special_tokens=False).input_ids + [eos] for ex in examples]
    P = max(len(p) for p in prompts)
    A = max(len(a) for a in answers)
    L = length or P + A
    if P + A > L:
        raise ValueError(f"sft_batch: examples need length {P + A}, got length={L}")
    B = len(examples)
    tokens = np.full((B, L), pad, np.int32)
    valid = np.zeros((B, L), bool)
    comp = np.zeros((B, L), bool)
    for b, (p, a) in enumerate(zip(prompts, answers)):
        tokens[b, P - len(p):P] = p
        tokens[b, P:P + len(a)] = a
        valid[b, P - len(p):P + len(a)] = True
        comp[b, P:P + len(a)] = True
    return Batch(tokens_BT=tokens, valid_BT=valid, mask_BT=comp)


@dataclasses.dataclass
class PromptStream:
    """An endless, resumable stream of training prompts: epoch e is a fixed shuffle of the train split.

    A task with a finite train split (a JSONL file: `split_rows`) streams every one of its rows; a generated task
    streams a pool of `pool_size` examples. `position` (examples consumed so far) is all the state a checkpoint
    needs to resume the stream exactly.
    """

    task: Task
    seed: int = 0
    pool_size: int = 4096
    position: int = 0

    def __post_init__(self):
        rows = getattr(self.task, "split_rows", None)
        self._pool = list(rows("train")) if rows is not None else self.task.examples(self.pool_size, self.seed,
                                                                                      "train")
        if not self._pool:
            self.task.examples(1, self.seed, "train")  # the task's own error naming the empty split

    @property
    def size(self) -> int:
        """Distinct training prompts in one epoch."""
        return len(self._pool)

    def _order(self, epoch: int) -> np.ndarray:
        if getattr(self, "_epoch", None) != epoch:
            self._epoch = epoch
            self._perm = np.random.RandomState(self.seed + 1000 * epoch).permutation(len(self._pool))
        return self._perm

    def next(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self._pool))
            out.append(self._pool[self._order(epoch)[i]])
            self.position += 1
        return out

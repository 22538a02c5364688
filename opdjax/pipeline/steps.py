"""The pieces of one OPD step: generate rollouts, grade them, build the learner's `Batch`, publish weights.
"""

from __future__ import annotations

import numpy as np

from opdjax.core.types import Batch
from opdjax.data.prompts import encode_prompts
from opdjax.learner.distributed import barrier, is_multiprocess
from opdjax.pipeline.build import Run, sampling_params
from opdjax.rollout import RolloutBatch

__all__ = ["completion_texts", "generate", "learner_batch", "publish", "rewards"]


def completion_texts(tokenizer, batch: RolloutBatch) -> list[str]:
    """Completion text of each row, cut at EOS (the stop token is not part of the answer)."""
    eos = tokenizer.eos_token_id
    out = []
    for ids in batch.completions():
        if eos in ids:
            ids = ids[: ids.index(eos)]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def rewards(task, tokenizer, examples, batch: RolloutBatch) -> np.ndarray:
    """Task reward of each row (0 for ungraded examples)."""
    texts = completion_texts(tokenizer, batch)
    r = [task.grade(examples[i], t) for i, t in zip(batch.prompt_index_B, texts)]
    return np.asarray([0.0 if x is None else x for x in r], np.float32)


def learner_batch(run: Run, batch: RolloutBatch, examples) -> Batch:
    """The learner's Batch: the rollout + the teacher scores (and rewards) the loss needs."""
    needs = run.learner.needs
    teacher_needs = needs & {"teacher_logp", "teacher_topk", "teacher_logits"}
    scores = {}
    if teacher_needs:
        scores = run.teacher.score(batch.tokens_BT, batch.valid_BT, teacher_needs,
                                   top_k=run.cfg.teacher.top_k).present()
    return Batch(tokens_BT=batch.tokens_BT, valid_BT=batch.valid_BT, mask_BT=batch.completion_mask_BT,
                 rollout_logp_BT=batch.rollout_logp_BT.astype(np.float32), **scores,
                 reward_B=rewards(run.task, run.tokenizer, examples, batch) if "reward" in needs else None)


def generate(run: Run, examples, seed: int, *, engine=None, temperature=None) -> RolloutBatch:
    """Sample `rollout.samples_per_prompt` completions of each example's prompt (row -> example index in
    `prompt_index_B`) with `engine` (default: the run's)."""
    n = run.cfg.rollout.samples_per_prompt
    prompts = encode_prompts(run.tokenizer, examples)
    rep = [p for p in prompts for _ in range(n)]
    batch = (engine or run.engine).generate(rep, sampling_params(run.cfg, run.tokenizer, temperature=temperature),
                                            seed=seed)
    batch.prompt_index_B = np.repeat(np.arange(len(prompts)), n)[batch.prompt_index_B]
    return batch


def publish(run: Run, params, version: int) -> None:
    """Send the learner's weights to the engine as `version` through the run's publisher (HF names and layout,
    the engine's dtype; sharded params gathered; returns once the engine has applied the version)."""
    run.publisher.publish(params, version)
    if is_multiprocess() and not run.publisher.every_process:
        barrier(f"opdjax-publish-v{version}")  # the others sample only once process 0's publish is applied
        run.engine.mark_published(version)

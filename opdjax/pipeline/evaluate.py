"""Held-out evaluation of the learner's current weights (reverse KL to the teacher, greedy accuracy) with the engine
it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from opdjax.data.prompts import encode_prompts
from opdjax.data.tasks import Example, Task
from opdjax.learner.distributed import gathered
from opdjax.models import ModelConfig, hf
from opdjax.pipeline.opd import completion_texts
from opdjax.rollout import RolloutEngine, SamplingParams
from opdjax.teacher import Teacher

__all__ = ["Evaluator"]


class Evaluator:
    """Held-out quality of the learner's weights, sampled by `engine` (give it a clean one: `opdjax train` uses an
    unquantized `JaxEngine`, so the figure measures the student, not the rollout engine's mismatch).

    reverse_kl: mean over held-out prompts of Σ_t (log S - log T) on the student's own samples at T = 1, an unbiased
    estimate of the sequence-level KL(S‖T). accuracy: greedy-decoding exact match (`task.grade`; NaN when the task
    grades nothing). Each call publishes `params` to `engine` as `version` (HF names from `model_cfg`).
    """

    def __init__(self, engine: RolloutEngine, teacher: Teacher, tokenizer, examples: Sequence[Example], *,
                 model_cfg: ModelConfig, max_new_tokens: int, task: Task | None = None, seed: int = 12345,
                 stop_token_ids: Sequence[int] = ()):
        self.engine, self.teacher, self.tokenizer, self.task = engine, teacher, tokenizer, task
        self.examples, self.model_cfg, self.seed = list(examples), model_cfg, seed
        stops = tuple(dict.fromkeys((tokenizer.eos_token_id, *stop_token_ids)))
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=stops)

    def __call__(self, params, version: int) -> dict[str, float]:
        self.engine.update_weights(hf.named_params(self.model_cfg, gathered(params)), version)
        prompts = encode_prompts(self.tokenizer, self.examples)
        sampled = self.engine.generate(prompts, self.sampling, seed=self.seed)
        t = self.teacher.score(sampled.tokens_BT, sampled.valid_BT, frozenset({"teacher_logp"})).teacher_logp_BT
        m = sampled.completion_mask_BT
        per_seq = ((sampled.rollout_logp_BT - t) * m).sum(1)
        return {"eval/reverse_kl": float(per_seq.mean()), "eval/accuracy": self._accuracy(prompts),
                "eval/completion_len": float(m.sum(1).mean())}

    def _accuracy(self, prompts) -> float:
        if self.task is None:
            return float("nan")
        greedy = self.engine.generate(prompts, dataclasses.replace(self.sampling, temperature=0.0), seed=0)
        texts = completion_texts(self.tokenizer, greedy, self.sampling.stop_token_ids)
        grades = [self.task.grade(ex, txt) for ex, txt in zip(self.examples, texts)]
        graded = [g for g in grades if g is not None]
        return float(np.mean(graded)) if graded else float("nan")

    @staticmethod
    def held_out(task: Task, n: int, seed: int) -> list[Example]:
        """The held-out examples `opdjax train` evaluates on: `n` of the task's held-out split, drawn with `seed`."""
        return task.examples(n, seed, "heldout")


"""Held-out evaluation of the learner's current weights (reverse KL to the teacher, greedy accuracy).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from opdjax.data.prompts import encode_prompts
from opdjax.learner.distributed import gathered
from opdjax.models import hf
from opdjax.pipeline.build import Run, sampling_params
from opdjax.pipeline.steps import completion_texts
from opdjax.rollout.jax_engine import JaxEngine

__all__ = ["Evaluator"]


class Evaluator:
    """Held-out quality of the learner's current weights, measured with a clean (unquantized) JAX engine.

    reverse_kl: mean over held-out prompts of Σ_t (log S - log T) on the student's own samples (T = 1), an
    unbiased estimate of the sequence-level KL(S‖T). accuracy: greedy-decoding exact match.
    """

    def __init__(self, run: Run):
        self.run = run
        self.examples = run.task.examples(run.cfg.pipeline.eval_prompts, run.cfg.seed + 7, "heldout")
        self.engine = JaxEngine(run.student_cfg, None, pad_id=run.tokenizer.pad_token_id,
                                eos_id=run.tokenizer.eos_token_id)

    def __call__(self, params, version: int) -> dict[str, float]:
        run = self.run
        self.engine.update_weights(hf.named_params(run.student_cfg, gathered(params)), version)
        prompts = encode_prompts(run.tokenizer, self.examples)
        sp = sampling_params(run.cfg, run.tokenizer, temperature=1.0)
        sp = dataclasses.replace(sp, top_k=0, top_p=1.0)
        sampled = self.engine.generate(prompts, sp, seed=12345)
        t = run.teacher.score(sampled.tokens_BT, sampled.valid_BT, frozenset({"teacher_logp"})).teacher_logp_BT
        m = sampled.completion_mask_BT
        per_seq = ((sampled.rollout_logp_BT - t) * m).sum(1)
        greedy = self.engine.generate(prompts, dataclasses.replace(sp, temperature=0.0), seed=0)
        texts = completion_texts(run.tokenizer, greedy)
        grades = [run.task.grade(ex, txt) for ex, txt in zip(self.examples, texts)]
        graded = [g for g in grades if g is not None]
        return {"eval/reverse_kl": float(per_seq.mean()),
                "eval/accuracy": float(np.mean(graded)) if graded else float("nan"),
                "eval/completion_len": float(m.sum(1).mean())}

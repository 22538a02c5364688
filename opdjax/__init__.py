"""opdjax: on-policy distillation in JAX under training-inference mismatch.

What a user touches, importable from here (loaded on first use, so `import opdjax` stays light):

- the pure functions, for any trainer: `mismatch` (metrics), `corrections` (IS weights, rejection), `losses` (OPD
  losses and the teacher data each needs), `quant` (simulated quantization); `Batch`, the one training-batch schema;
- the OPD components and the public step (`pipeline.opd`): `RolloutEngine` / `JaxEngine` / `VllmEngine`,
  `Teacher` / `JaxTeacher`, `Learner` (with `LogitsAdapter` for a model of your own), `Publisher` /
  `engine_publisher`, `OPDParts`, `opd_step`, `generate`, `train_on`, `publish`, `Evaluator`;
- the configured path: `TrainConfig`, `build`, `train` (what `opdjax train` runs).

See the README's guides and `examples/`.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it (one table; `__getattr__` imports on first use)
EXPORTS: dict[str, str] = {
    "mismatch": "opdjax.core.mismatch", "corrections": "opdjax.core.corrections", "losses": "opdjax.core.losses",
    "quant": "opdjax.quant",
    "Batch": "opdjax.core.types", "Correction": "opdjax.core.corrections",
    "register_loss": "opdjax.core.losses", "register_correction": "opdjax.core.corrections",
    "ModelConfig": "opdjax.models", "load_config": "opdjax.models",
    "RolloutBatch": "opdjax.rollout", "RolloutEngine": "opdjax.rollout", "SamplingParams": "opdjax.rollout",
    "JaxEngine": "opdjax.rollout", "EngineMismatch": "opdjax.rollout", "VllmEngine": "opdjax.rollout.vllm_engine",
    "Teacher": "opdjax.teacher", "TeacherScores": "opdjax.teacher", "JaxTeacher": "opdjax.teacher",
    "Learner": "opdjax.learner", "TrainState": "opdjax.learner", "make_optimizer": "opdjax.learner",
    "CausalLMAdapter": "opdjax.learner", "LogitsAdapter": "opdjax.learner",
    "Publisher": "opdjax.sync", "engine_publisher": "opdjax.sync",
    "Example": "opdjax.data.tasks", "Task": "opdjax.data.tasks", "get_task": "opdjax.data.tasks",
    "register_task": "opdjax.data.tasks", "PromptStream": "opdjax.data.prompts",
    "OPDParts": "opdjax.pipeline.opd", "opd_step": "opdjax.pipeline.opd", "generate": "opdjax.pipeline.opd",
    "train_on": "opdjax.pipeline.opd", "learner_batch": "opdjax.pipeline.opd", "publish": "opdjax.pipeline.opd",
    "Evaluator": "opdjax.pipeline.evaluate",
    "TrainConfig": "opdjax.config",
    "build": "opdjax.pipeline.build", "train": "opdjax.pipeline.loop",
}

__all__ = sorted(EXPORTS)

_MODULES = {"mismatch", "corrections", "losses", "quant"}  # exported as modules, not as a name inside one


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'opdjax' has no attribute {name!r}")
    module = importlib.import_module(EXPORTS[name])
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *EXPORTS])

"""The learner: a jitted, sharded train step on one Batch with optional gradient accumulation (`learner`), model
adapters for any NNX causal LM (`adapters`), and orbax checkpoints (`checkpoint`)."""

from opdjax.learner.adapters import CausalLMAdapter, DecoderAdapter, LogitsAdapter
from opdjax.learner.checkpoint import (CheckpointDamagedError, CheckpointMismatchError, latest_step, restore_checkpoint,
                                      restore_newest_good, save_checkpoint)
from opdjax.learner.learner import Learner, TrainState, make_optimizer, make_schedule

__all__ = ["CausalLMAdapter", "CheckpointDamagedError", "CheckpointMismatchError", "DecoderAdapter", "Learner",
           "LogitsAdapter", "TrainState", "latest_step", "make_optimizer", "make_schedule", "restore_checkpoint",
           "restore_newest_good", "save_checkpoint"]

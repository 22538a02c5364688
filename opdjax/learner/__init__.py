"""The learner: a jitted, sharded train step on one Batch (`learner`), and orbax checkpoints (`checkpoint`)."""

from opdjax.learner.checkpoint import latest_step, restore_checkpoint, save_checkpoint
from opdjax.learner.learner import Learner, TrainState, make_optimizer, make_schedule

__all__ = ["Learner", "TrainState", "make_optimizer", "make_schedule", "latest_step", "restore_checkpoint",
           "save_checkpoint"]

"""A Ctrl-C while a checkpoint is written stops the program once the checkpoint is whole.

Without `sigint_deferred`, a KeyboardInterrupt raised inside orbax's save breaks it half-way: orbax's
`CheckpointManager.wait_until_finished` catches BaseException around its join of the save thread, logs the save as
failed and drops its record of the step. `save_checkpoint` now holds SIGINT until the save has finished.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from opdjax.learner import Learner, latest_step, restore_checkpoint, save_checkpoint
from opdjax.learner.checkpoint import sigint_deferred
from opdjax.models import decoder
from opdjax.models.config import ModelConfig

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)

main_thread_only = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                      reason="Python installs signal handlers from the main thread only")


def _state():
    graphdef, params = nnx.split(decoder.create(CFG, seed=3))
    return Learner(graphdef, tx=optax.sgd(1.0)).init(params)


def _press_once_the_save_holds_sigint(before, sent: list) -> None:
    """Send SIGINT to this process as soon as the save has taken over SIGINT (never, if it does not)."""
    deadline = time.time() + 60
    while signal.getsignal(signal.SIGINT) is before and time.time() < deadline and not sent:
        time.sleep(0.0005)
    if signal.getsignal(signal.SIGINT) is not before:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)


@main_thread_only
def test_ctrl_c_during_a_save_raises_after_the_checkpoint_is_whole(tmp_path):
    # Python's own Ctrl-C handler, as in an interactive process (an earlier test in this worker process may have left
    # another disposition behind: vLLM's engine, for one, sets SIGINT to SIG_DFL when it shuts down in-process).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _press_during_a_save(tmp_path)
    finally:
        signal.signal(signal.SIGINT, outer)


def _press_during_a_save(tmp_path):
    state, before, sent = _state(), signal.getsignal(signal.SIGINT), []
    presser = threading.Thread(target=_press_once_the_save_holds_sigint, args=(before, sent), daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path / "ckpt", state, {"step": 0})
    finally:
        sent.append("stop")
        presser.join(timeout=5)
    assert sent[0] is True, "the save never held SIGINT: a Ctrl-C during it could be dropped by orbax"
    assert signal.getsignal(signal.SIGINT) is before
    assert latest_step(tmp_path / "ckpt") == 0
    restored, extra = restore_checkpoint(tmp_path / "ckpt", state)
    assert extra == {"step": 0}
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@main_thread_only
def test_an_ignored_sigint_stays_ignored_and_no_press_changes_nothing():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job (`cmd &` in a script)
    try:
        with sigint_deferred():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    with sigint_deferred():
        pass
    assert signal.getsignal(signal.SIGINT) is before

"""The multi-process helpers on one process (the two-process job itself: tests/remote/test_multiprocess.py)."""

import numpy as np
import pytest

from opdjax.core.errors import InputError
from opdjax.learner import distributed
from opdjax.rollout.base import RolloutBatch, pad_left


def test_one_process_owns_every_row_and_agrees_with_itself():
    assert distributed.row_share(8) == (0, 8)
    assert distributed.agree(5) == 5 and not distributed.is_multiprocess()
    distributed.barrier("single")  # a no-op, not a hang


def test_initialize_needs_a_count_and_an_id_in_range(monkeypatch):
    for k in ("OPDJAX_COORDINATOR", "OPDJAX_NUM_PROCESSES", "OPDJAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.initialize() is False  # nothing configured: one process
    with pytest.raises(InputError, match="process count"):
        distributed.initialize("127.0.0.1:1234")
    with pytest.raises(InputError, match="outside"):
        distributed.initialize("127.0.0.1:1234", 2, 2)


def test_peer_failures_are_told_from_other_errors():
    assert distributed.is_peer_failure(RuntimeError("Gloo all-reduce failed: Connection closed by peer"))
    assert not distributed.is_peer_failure(ValueError("bad shape"))


def test_pad_left_widens_every_array_and_keeps_rows():
    b = RolloutBatch(tokens_BT=np.array([[5, 6, 7]]), valid_BT=np.ones((1, 3), bool),
                     completion_mask_BT=np.array([[False, True, True]]), rollout_logp_BT=np.array([[0, -1., -2.]]),
                     version_B=np.array([3]), prompt_index_B=np.array([0]), meta={"prompt_len": 1})
    w = pad_left(b, 5, pad_id=0)
    assert w.tokens_BT.tolist() == [[0, 0, 5, 6, 7]] and w.valid_BT.tolist() == [[False, False, True, True, True]]
    assert w.rollout_logp_BT.tolist() == [[0, 0, 0, -1, -2]] and w.meta["prompt_len"] == 3
    assert pad_left(b, 3, 0) is b
    with pytest.raises(ValueError, match="more than"):
        pad_left(b, 2, 0)

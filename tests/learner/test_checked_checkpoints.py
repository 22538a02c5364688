"""Issue 38 rows 2, 3 and 6 at the checkpoint's level: a checkpoint records the sha256 of every file it wrote and is
checked before it is restored; a damaged newest checkpoint gives way to the newest good one (one line, which and
why); rotation never removes the newest checked checkpoint; NaN parameters are never saved; a write the machine
refuses is one MachineFaultError naming the path and the cause, the earlier checkpoints intact.

Before: 64 bytes overwritten in a data file restored silently (NaN weights), a removed `_METADATA` gave "use
pipeline.overwrite=true" (advice that deletes the good checkpoint), a removed `extra/metadata` a FileNotFoundError
traceback, and a full disk hundreds of lines of orbax tracebacks.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import resource
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from opdjax.core.errors import MachineFaultError, NonFiniteError
from opdjax.learner import Learner, latest_step, restore_checkpoint, save_checkpoint
from opdjax.models import decoder
from opdjax.models.config import ModelConfig

CFG = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _state(step: int, scale: float = 1.0):
    """A tiny TrainState at `step` whose parameters are the seed-3 ones times `scale` (tells checkpoints apart)."""
    graphdef, params = nnx.split(decoder.create(CFG, seed=3))
    state = Learner(graphdef, tx=optax.sgd(1.0)).init(params)
    params = jax.tree.map(lambda x: x * scale if jnp.issubdtype(x.dtype, jnp.floating) else x, state.params)
    return dataclasses.replace(state, step=jnp.asarray(step, state.step.dtype), params=params)


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))


def _largest_data_file(step_dir):
    return max((step_dir / "state" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)


def _overwrite_bytes(step_dir):  # the issue's `dd conv=notrunc`: 64 bytes in the middle of the largest data file
    f = _largest_data_file(step_dir)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        fh.write(b"\xff" * 64)


def _truncate(step_dir):
    f = _largest_data_file(step_dir)
    os.truncate(f, f.stat().st_size // 2)


DAMAGE = {
    "bytes_overwritten": _overwrite_bytes,
    "data_file_truncated": _truncate,
    "state_metadata_removed": lambda d: (d / "state" / "_METADATA").unlink(),
    "ocdbt_manifest_removed": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
    "extra_metadata_removed": lambda d: (d / "extra" / "metadata").unlink(),
    "opdjax_manifest_removed": lambda d: (d / "opdjax_manifest.json").unlink(),
}


def test_each_checkpoint_records_the_sha256_of_every_file_it_wrote(tmp_path):
    save_checkpoint(tmp_path / "ck", _state(1), {"step": 1})
    step_dir = tmp_path / "ck" / "1"
    recorded = json.loads((step_dir / "opdjax_manifest.json").read_text())["files"]
    on_disk = {p.relative_to(step_dir).as_posix(): p for p in step_dir.rglob("*")
               if p.is_file() and p.name != "opdjax_manifest.json"}
    assert set(recorded) == set(on_disk) and "state/_METADATA" in recorded and "extra/metadata" in recorded
    for rel, p in on_disk.items():
        assert recorded[rel] == {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_refused_and_resume_takes_the_newest_good_one(tmp_path, how):
    from opdjax.learner import CheckpointDamagedError, restore_newest_good

    ck, good = tmp_path / "ck", _state(1, scale=0.5)
    save_checkpoint(ck, good, {"step": 1})
    save_checkpoint(ck, _state(2, scale=2.0), {"step": 2})
    DAMAGE[how](ck / "2")
    with pytest.raises(CheckpointDamagedError, match=r"checkpoint step 2 is damaged") as info:
        restore_checkpoint(ck, _state(0), step=2)
    assert "overwrite" not in str(info.value)  # no advice that would remove the good step-1 checkpoint
    said = []
    state, extra = restore_newest_good(ck, _state(0), said.append)
    assert extra == {"step": 1} and int(state.step) == 1 and _same(state, good)
    assert len(said) == 1 and "step 2" in said[0] and "resuming from step 1" in said[0], said
    # the damaged step is kept, out of the way: a resumed run saves step 2 again and keeps both checked checkpoints
    assert (ck / "damaged-2").is_dir() and not (ck / "2").exists()
    save_checkpoint(ck, _state(2, scale=3.0), {"step": 2})
    assert latest_step(ck) == 2 and _same(restore_checkpoint(ck, _state(0))[0], _state(2, scale=3.0))
    assert (ck / "1").is_dir()


def test_no_good_checkpoint_is_one_error_that_moves_nothing(tmp_path):
    from opdjax.learner import CheckpointDamagedError, restore_newest_good

    ck = tmp_path / "ck"
    save_checkpoint(ck, _state(1), {"step": 1})
    _overwrite_bytes(ck / "1")
    with pytest.raises(CheckpointDamagedError, match=r"no checkpoint passes its check \(step 1: .*sha256.*\).*another "
                                                     r"pipeline.out_dir"):
        restore_newest_good(ck, _state(0), lambda s: None)
    assert (ck / "1").is_dir()


def test_a_mismatched_model_is_not_told_to_overwrite_its_run(tmp_path):
    from opdjax.learner import CheckpointMismatchError

    save_checkpoint(tmp_path / "ck", _state(1), {"step": 1})
    other = ModelConfig(**{**dataclasses.asdict(CFG), "hidden_size": 16, "head_dim": 4})
    graphdef, params = nnx.split(decoder.create(other, seed=3))
    with pytest.raises(CheckpointMismatchError, match="does not fit") as info:
        restore_checkpoint(tmp_path / "ck", Learner(graphdef, tx=optax.sgd(1.0)).init(params))
    assert "overwrite" not in str(info.value) and "another pipeline.out_dir" in str(info.value)


def test_rotation_never_removes_the_newest_checked_checkpoint(tmp_path):
    """A step whose save did not finish (no manifest) does not count toward the checkpoints kept: orbax's own rotation
    (max_to_keep=2) removed step 1 here, leaving no checkpoint that passes its check but the newest."""
    ck = tmp_path / "ck"
    save_checkpoint(ck, _state(1), {"step": 1}, max_to_keep=2)
    save_checkpoint(ck, _state(2), {"step": 2}, max_to_keep=2)
    (ck / "2" / "opdjax_manifest.json").unlink()  # as if the process died before the save finished
    save_checkpoint(ck, _state(3), {"step": 3}, max_to_keep=2)
    assert sorted(p.name for p in ck.iterdir()) == ["1", "2", "3"]
    save_checkpoint(ck, _state(4), {"step": 4}, max_to_keep=2)
    assert sorted(p.name for p in ck.iterdir()) == ["2", "3", "4"]


def test_non_finite_parameters_are_never_saved(tmp_path):
    ck = tmp_path / "ck"
    save_checkpoint(ck, _state(1), {"step": 1})
    bad = _state(2)
    bad = dataclasses.replace(bad, params=jax.tree.map(lambda x: x.at[..., 0].set(jnp.nan) if x.ndim else x,
                                                        bad.params))
    with pytest.raises(NonFiniteError, match="step 2: the parameters hold NaN"):
        save_checkpoint(ck, bad, {"step": 2})
    assert latest_step(ck) == 1 and not (ck / "2").exists()


def test_a_write_the_machine_refuses_is_one_error_naming_the_path_and_the_earlier_checkpoint_stays(tmp_path,
                                                                                                 monkeypatch):
    from opdjax.learner import manifest

    ck = tmp_path / "ck"
    save_checkpoint(ck, _state(1, scale=0.5), {"step": 1})

    def full(step_dir, step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(step_dir / "opdjax_manifest.json"))
    monkeypatch.setattr(manifest, "write_manifest", full)
    with pytest.raises(MachineFaultError, match=r"checkpoint step 2 not saved: .*/2/opdjax_manifest.json: No space "
                                                r"left on device \(ENOSPC\)") as info:
        save_checkpoint(ck, _state(2), {"step": 2})
    assert info.value.errno == errno.ENOSPC and "\n" not in str(info.value)
    assert not (ck / "2").exists()  # the partial step is gone; step 1 is whole
    assert _same(restore_checkpoint(ck, _state(0))[0], _state(1, scale=0.5))


def test_a_real_refused_write_inside_orbax_is_one_error_without_orbax_logs(tmp_path, caplog):
    """A file-size limit (RLIMIT_FSIZE) makes the kernel refuse orbax's writes (EFBIG), as a full disk does (ENOSPC):
    tensorstore reports it as a ValueError carrying os_error_code, and orbax logs each failure with a traceback."""
    ck = tmp_path / "ck"
    save_checkpoint(ck, _state(1, scale=0.5), {"step": 1})
    old_sig, old_lim = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
    caplog.set_level(logging.ERROR)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, old_lim[1]))
        with pytest.raises(MachineFaultError, match=r"checkpoint step 2 not saved: /.*: File too large \(EFBIG\);"
                                                    r" the checkpoints saved before it .* are intact") as info:
            save_checkpoint(ck, _state(2), {"step": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_lim)
        signal.signal(signal.SIGXFSZ, old_sig)
    assert "\n" not in str(info.value)
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.ERROR]
    assert sorted(p.name for p in ck.iterdir()) == ["1"]
    assert _same(restore_checkpoint(ck, _state(0))[0], _state(1, scale=0.5))

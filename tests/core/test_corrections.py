"""The correction registry: re-running a notebook cell that registers a correction replaces it; a different
function under a taken name is refused. (The corrections' formulas are tested in test_mismatch.py.)"""

import jax.numpy as jnp
import numpy as np
import pytest

from opdjax.core import corrections as corr

S = jnp.array([[-1.0, -2.0, -0.5]])
R = jnp.array([[-1.2, -1.5, -0.5]])
MASK = jnp.array([[True, True, False]])


def _cell(scale: float):
    """A notebook cell defining `halve`: each run makes a new function with the same module and qualified name."""

    def halve(c, student_logp_BT, rollout_logp_BT, mask_BT):
        return jnp.where(mask_BT, scale, 0.0), {"scale": jnp.asarray(scale)}

    return halve


def _other_cell():
    def halve(c, student_logp_BT, rollout_logp_BT, mask_BT):  # same name, different qualified name
        return jnp.where(mask_BT, 1.0, 0.0), {}

    return halve


def test_reregistering_the_same_definition_replaces_it():
    try:
        first = corr.register_correction("test_halve")(_cell(0.5))
        second = corr.register_correction("test_halve")(_cell(0.25))  # the cell, run again with an edit
        assert first is not second and corr.CORRECTIONS["test_halve"] is second
        w, d = corr.apply_correction(corr.Correction("test_halve"), S, R, MASK)
        np.testing.assert_array_equal(np.asarray(w), [[0.25, 0.25, 0.0]])
        assert float(d["corr/scale"]) == 0.25
    finally:
        corr.CORRECTIONS.pop("test_halve", None)
    assert "test_halve" not in corr.CORRECTIONS


def test_a_different_function_under_a_taken_name_is_refused_and_the_entry_kept():
    try:
        first = corr.register_correction("test_halve")(_cell(0.5))
        with pytest.raises(ValueError, match=r"correction 'test_halve' is already registered to "
                                             r"tests\.core\.test_corrections\._cell\.<locals>\.halve.*"
                                             r"pick another name"):
            corr.register_correction("test_halve")(_other_cell())
        assert corr.CORRECTIONS["test_halve"] is first
    finally:
        corr.CORRECTIONS.pop("test_halve", None)
    with pytest.raises(ValueError, match="correction 'token_tis' is already registered to opdjax.core.corrections"):
        corr.register_correction("token_tis")(_cell(0.5))  # a built-in name is never replaced by a user's function

"""Checkpoints written by an older jaxsync restore today (`tests/data/saved_states/`).

They were saved before `jaxsync/_src` was reorganised into packages: a stored class
or module path would break here. The restored state must equal the same run made
with today's code, on the saved DP size and on another one.
"""

import pathlib
import shutil

import jax
import numpy as np
import pytest
import saved_state_run

import jaxsync

SAVED = pathlib.Path(__file__).parent / "data" / "saved_states"


@pytest.mark.parametrize("case", saved_state_run.CASES)
@pytest.mark.parametrize("n", [4, 8])
def test_old_checkpoint_restores(case, n, tmp_path):
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    step, fresh = saved_state_run.run(case, mesh)
    shutil.copytree(SAVED / case, tmp_path / case)  # the repo's copy stays untouched
    with jaxsync.Checkpointer(tmp_path / case) as ckpt:
        restored = ckpt.restore_state(step, step.init(saved_state_run.params0()))
    assert restored.meta["case"] == case
    got, want = restored.state, fresh
    assert int(got.step) == int(want.step) == 3
    assert jax.tree.structure(got) == jax.tree.structure(want)
    # Every field: params, optimizer moments, loss scale, skip counters, metrics.
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # The restored optimizer continues as the uninterrupted run does.
    b = saved_state_run.batches(1)[0]
    got, _ = step(got, b)
    want, _ = step(want, b)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

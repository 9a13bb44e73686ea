"""A mesh of one device (one GPU): what a user tries first must keep working.

On a size-1 data axis XLA hands a ``P("data")`` shard back as ``P()``; the step's
state must still be recognised at the next call, by ``lower`` and by ``init``'s
plan, and the result must still be plain optax's.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxsync
from tests.helpers import run_reference, scanned_batches, scanned_loss, scanned_params


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_steps_on_a_one_device_mesh_match_optax(mode):
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    params = scanned_params(jax.random.PRNGKey(0))
    xs, ys = scanned_batches(jax.random.PRNGKey(1), steps=3, batch=8)
    tx = optax.adamw(1e-2, weight_decay=0.01)
    step = jaxsync.train_step(scanned_loss, tx, mesh, mode=mode, stacked="blocks")
    state = step.init(params)
    for i in range(xs.shape[0]):
        state, _ = step(state, (xs[i], ys[i]))
        step.lower(state, (xs[i], ys[i]))  # the returned state still has its plan
    want, _ = run_reference(tx, params, (xs, ys), loss_fn=scanned_loss)
    got = step.params(state)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6), got, want)
    assert int(state.step) == xs.shape[0]

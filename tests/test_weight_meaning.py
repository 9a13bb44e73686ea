"""One step, one meaning (issue 41): a weighted loss's weights.

Before: ``weighted_loss(sum_fn, lambda b: 96)``, the global token count as a constant
(right on one device), was summed over 8 devices to 768: updates 8x too small. And an
all-padding global batch counted as a step: AdamW's momentum and weight decay moved
the params with zero gradients, and ``state.step`` advanced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_params
from helpers import mlp_forward as forward

import jaxsync

ROWS = 32


def sum_fn(p, b):
    err = jnp.mean((forward(p, b["x"]) - b["y"]) ** 2, axis=-1)
    return jnp.sum(err * b["m"])


def batch(mask):
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=1, batch=ROWS)
    return {"x": xs[0], "y": ys[0], "m": np.asarray(mask, np.float32)}


@pytest.mark.parametrize("weight_fn", [lambda b: 96, lambda b: jnp.float32(96.0)])
def test_a_weight_that_does_not_depend_on_the_batch_is_refused(mesh8, weight_fn):
    loss = jaxsync.weighted_loss(sum_fn, weight_fn)
    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh8, "ddp", microbatches=2)
    with pytest.raises(ValueError, match=r"returns 96.0 whatever the batch holds.*16 pieces"):
        step(step.init(mlp_params(jax.random.PRNGKey(0))), batch(np.ones(ROWS)))


def test_a_weight_of_the_rows_shape_is_kept(mesh8):
    """``b["x"].shape[0]`` depends on the rows given (every row counts): one device's
    plain mean, not refused."""
    params = mlp_params(jax.random.PRNGKey(0))
    loss = jaxsync.weighted_loss(sum_fn, lambda b: b["x"].shape[0])
    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh8, "zero", microbatches=2)
    b = batch(np.ones(ROWS))
    _, got = step(step.init(params), b)
    np.testing.assert_allclose(got, loss(params, b), rtol=1e-5)


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_an_all_padding_global_batch_is_skipped(mesh8, mode):
    params = mlp_params(jax.random.PRNGKey(0))
    loss = jaxsync.weighted_loss(sum_fn, lambda b: jnp.sum(b["m"]))
    step = jaxsync.train_step(loss, optax.adamw(0.05, weight_decay=0.1), mesh8, mode)
    state, _ = step(step.init(params), batch(np.ones(ROWS)))  # momentum is not zero now
    before = jax.tree.map(np.asarray, step.params(state))
    state, got = step(state, batch(np.zeros(ROWS)))
    jax.tree.map(np.testing.assert_array_equal, step.params(state), before)
    assert int(state.step) == 1 and bool(state.metrics.skipped)
    assert np.isnan(float(got))  # no tokens, no loss
    state, _ = step(state, batch(np.ones(ROWS)))  # and the next real batch trains
    assert int(state.step) == 2

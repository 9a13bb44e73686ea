"""`train_step(..., has_aux=True)`: a `(loss, aux)` loss returns its aux from the step,
the way `jax.value_and_grad(has_aux=True)` does, in every mode."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_loss, mlp_params, run_reference

import jaxsync


def loss_with_aux(params, batch):
    loss = mlp_loss(params, batch)
    x, _ = batch
    rows = jnp.asarray(x.shape[0], jnp.int32)  # each device counts its own rows
    return loss, {"loss_again": loss, "rows": rows,
                  "x_sum": jnp.sum(x)}  # fmt: skip


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_aux_is_returned_and_training_is_unchanged(mesh8, mode):
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=2, batch=16)
    step = jaxsync.train_step(loss_with_aux, optax.sgd(0.1), mesh8, mode, has_aux=True)
    state = step.init(params)
    for x, y in zip(xs, ys, strict=True):
        state, (loss, aux) = step(state, (x, y))
    # The aux of the last batch: floats averaged over the 8 devices, integers summed.
    np.testing.assert_allclose(aux["loss_again"], loss, rtol=1e-6)
    before = _before_last(params, xs, ys)
    np.testing.assert_allclose(loss, mlp_loss(before, (xs[-1], ys[-1])), rtol=1e-5)
    assert int(aux["rows"]) == 16  # 2 rows on each of 8 devices, summed
    np.testing.assert_allclose(aux["x_sum"], jnp.sum(xs[-1]) / 8, rtol=1e-5)  # mean of sums
    want, _ = run_reference(optax.sgd(0.1), params, (xs, ys))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip


def _before_last(params, xs, ys):
    """The params the last step started from (single-device SGD)."""
    p, _ = run_reference(optax.sgd(0.1), params, (xs[:-1], ys[:-1]))
    return p


def test_a_tuple_loss_without_has_aux_is_named(mesh8):
    step = jaxsync.train_step(loss_with_aux, optax.sgd(0.1), mesh8)
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=1, batch=16)
    with pytest.raises(ValueError, match=r"has_aux=True"):
        step(step.init(mlp_params(jax.random.PRNGKey(0))), (xs[0], ys[0]))
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, has_aux=True)
    with pytest.raises(ValueError, match=r"must return `\(loss, aux\)`"):
        step(step.init(mlp_params(jax.random.PRNGKey(0))), (xs[0], ys[0]))


def test_aux_on_a_two_d_mesh_with_microbatches():
    """The 2-D body and the microbatch loop carry the aux too, over every microbatch
    (issue 41: it was the last microbatch's only, 8 rows for 16)."""
    from conftest import require_devices
    from helpers import place_by_specs
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P
    from test_limits import batch, stacked_loss, stacked_params

    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = stacked_params()
    specs = jax.tree.map(lambda x: P(), params)
    specs["inp"]["w"] = P(None, "model")

    def with_aux(p, b):
        return stacked_loss(p, b), jnp.asarray(b[0].shape[0], jnp.int32)

    kw = dict(microbatches=2, stacked="blocks")
    plain = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh, "zero", **kw)
    aux_step = jaxsync.train_step(with_aux, optax.sgd(0.1), mesh, "zero", has_aux=True, **kw)
    a = plain.init(place_by_specs(mesh, params, specs))
    b = aux_step.init(place_by_specs(mesh, params, specs))
    a, loss_a = plain(a, batch())
    b, (loss_b, rows) = aux_step(b, batch())
    assert int(rows) == 16  # every row of the global batch, as on one device
    np.testing.assert_array_equal(loss_a, loss_b)
    jax.tree.map(np.testing.assert_array_equal, plain.params(a), aux_step.params(b))

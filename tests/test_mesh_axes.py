"""A mesh axis the step does not use is refused, naming the ``axis_name`` to pass (issue 41).

On a trainer's ``("replica", "data")`` mesh the default ``axis_name="data"`` split the
batch over ``"data"`` only: the two devices along ``"replica"`` ran the same rows, the
right numbers at half the throughput, silently. An axis of size > 1 that is no data
axis, in no param's sharding and in no ``rules`` is now an error at ``init``; a loss
that works over an axis itself (tensor parallelism by hand) declares it in
``loss_axes=``. SGD against one device on the global batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import make_batches, mlp_loss, mlp_params, run_reference

import jaxsync


def batches():
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=2, batch=16)
    return xs, ys


def train(step, params):
    xs, ys = batches()
    state = step.init(params)
    for i in range(xs.shape[0]):
        state, _ = step(state, (xs[i], ys[i]))
    return step.params(state)


def close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, want)


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_an_idle_replica_axis_is_refused_naming_the_axis_name(mode):
    """Before: init and every step ran, each row computed twice."""
    require_devices(8)
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh, mode)
    with pytest.raises(ValueError, match=r"'replica' \(size 2\) is idle") as e:
        step.init(mlp_params(jax.random.PRNGKey(0)))
    assert "axis_name=('replica', 'data')" in str(e.value)
    assert "loss_axes='replica'" in str(e.value)


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_the_named_axis_name_trains_as_one_device(mode):
    require_devices(8)
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    params = mlp_params(jax.random.PRNGKey(0))
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh, mode, axis_name=("replica", "data"))
    want, _ = run_reference(optax.sgd(0.1), params, batches())
    close(train(step, params), want)


def tp_loss(p, batch):
    """Tensor parallelism by hand over "model": each model rank takes half of the
    first layer's columns and of the second's rows; a psum joins them."""
    x, y = batch
    half = p["w1"].shape[1] // 2
    i = jax.lax.axis_index("model")
    w1 = jax.lax.dynamic_slice_in_dim(p["w1"], i * half, half, axis=1)
    w2 = jax.lax.dynamic_slice_in_dim(p["w2"], i * half, half, axis=0)
    out = jax.lax.psum(jnp.tanh(x @ w1) @ w2, "model")
    return jnp.mean((out - y) ** 2)


def plain_loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def test_an_axis_the_loss_uses_is_declared_in_loss_axes():
    """The escape hatch: a loss that works over "model" itself, params replicated."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (12, 8)) / 4, "w2": jax.random.normal(k2, (8, 5)) / 3}
    refused = jaxsync.train_step(tp_loss, optax.sgd(0.1), mesh, "zero")
    with pytest.raises(ValueError, match=r"'model' \(size 2\) is idle"):
        refused.init(params)
    step = jaxsync.train_step(tp_loss, optax.sgd(0.1), mesh, "zero", loss_axes="model")
    want, _ = run_reference(optax.sgd(0.1), params, batches(), loss_fn=plain_loss)
    close(train(step, params), want)
    with pytest.raises(ValueError, match=r"`loss_axes` \('data',\) names data axes"):
        jaxsync.train_step(tp_loss, optax.sgd(0.1), mesh, "zero", loss_axes="data")
    with pytest.raises(ValueError, match=r"`loss_axes` \['seq'\] are not axes of the mesh"):
        jaxsync.train_step(tp_loss, optax.sgd(0.1), mesh, "zero", loss_axes="seq")


def test_size_one_axes_and_used_axes_pass():
    require_devices(8)
    mesh = jax.make_mesh((8, 1), ("data", "replica"))
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh, "zero")
    step.init(mlp_params(jax.random.PRNGKey(0)))


@pytest.mark.parametrize("none", [None, [], ()])
def test_no_loss_axes_spelled_none_or_empty_trains_as_the_default(none):
    """``loss_axes=None`` or ``[]`` was refused with an error about `axis_name`,
    which the user had not passed."""
    require_devices(8)
    mesh = jax.make_mesh((8,), ("data",))
    params = mlp_params(jax.random.PRNGKey(0))
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh, "zero", loss_axes=none)
    want, _ = run_reference(optax.sgd(0.1), params, batches())
    close(train(step, params), want)


@pytest.mark.parametrize("bad", [7, ["data", ""], ("model", "model")])
def test_a_bad_loss_axes_error_names_loss_axes(bad):
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with pytest.raises((TypeError, ValueError), match=r"^`loss_axes`") as e:
        jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh, "zero", loss_axes=bad)
    assert "axis_name" not in str(e.value)

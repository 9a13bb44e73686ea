"""Where jaxsync.tap may sit: read from the traced loss, whatever JAX cached."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices

import jaxsync

L, D = 3, 4
KEYS = jax.random.split(jax.random.key(0), 3)
PARAMS = {
    "blocks": {"w": jax.random.normal(KEYS[0], (L, D, D)) * 0.3},
    "out": jax.random.normal(KEYS[1], (D,)),
}
X = np.asarray(jax.random.normal(KEYS[2], (32, D)))


@pytest.fixture
def mesh():
    require_devices(8)
    return jax.make_mesh((8,), ("data",))


def block(w, x):
    return jnp.tanh(x @ w)


def body_once(x, p):
    p = jaxsync.tap(p)
    return block(p["w"], x), None


def body_twice(x, p):
    q, r = jaxsync.tap(p), jaxsync.tap(p)
    return block(q["w"], block(r["w"], x)), None


def head(p, x):
    return jnp.mean((x @ p["out"]) ** 2)


def twice(p, b):  # one body tapping its layer twice
    return head(p, jax.lax.scan(body_twice, b, p["blocks"])[0])


def two_scans(p, b):  # weight sharing: the stack run twice
    x = jax.lax.scan(body_once, b, p["blocks"])[0]
    return head(p, jax.lax.scan(body_once, x, p["blocks"])[0])


def nested(p, b):  # the layer scan inside another loop
    def outer(x, _):
        return jax.lax.scan(body_once, x, p["blocks"])[0], None

    return head(p, jax.lax.scan(outer, b, None, length=2)[0])


def sgd_reference(loss_fn, lr=1.0):
    g = jax.grad(loss_fn)(PARAMS, X)
    return PARAMS["blocks"]["w"] - lr * g["blocks"]["w"]


def trained_blocks(loss_fn, mesh, mode, microbatches, lr=1.0):
    step = jaxsync.train_step(
        loss_fn, optax.sgd(lr), mesh, mode=mode, stacked="blocks", microbatches=microbatches
    )
    state, _ = step(step.init(PARAMS), X)
    return step.params(state)["blocks"]["w"]


@pytest.mark.parametrize("loss_fn", [twice, two_scans, nested], ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_more_than_one_tap_per_layer_with_microbatches_is_refused(mesh, mode, loss_fn):
    # Before: each tap added the first microbatch's gradients again, and the
    # stacked update was off by 2.6e-3 (twice), 6.6e-3 (two scans).
    with pytest.raises(ValueError, match="'blocks'.*(tapped 2 times|nested inside another)"):
        trained_blocks(loss_fn, mesh, mode, 2)
    # One microbatch: the reduction is linear, any number of taps is exact.
    got = trained_blocks(loss_fn, mesh, mode, 1)
    np.testing.assert_allclose(got, sgd_reference(loss_fn), atol=1e-6)


@pytest.mark.parametrize("loss_fn", [twice, two_scans], ids=lambda f: f.__name__)
def test_fsdp_accumulates_many_taps_exactly(mesh, loss_fn):
    got = trained_blocks(loss_fn, mesh, "fsdp", 2)
    np.testing.assert_allclose(got, sgd_reference(loss_fn), atol=1e-6)


def test_a_second_step_with_the_same_scan_body_is_not_refused(mesh):
    # A learning-rate sweep in one process: JAX reuses the scan body's jaxpr for
    # the second step, so `tap` never runs in Python there. It used to be
    # refused as "never tapped".
    def loss_fn(p, b):
        return head(p, jax.lax.scan(body_once, b, p["blocks"])[0])

    for lr in (1.0, 0.5, 0.25):
        got = trained_blocks(loss_fn, mesh, "zero", 2, lr=lr)
        np.testing.assert_allclose(got, sgd_reference(loss_fn, lr), atol=1e-6)
    got = trained_blocks(nested, mesh, "ddp", 1)  # body_once again, inside another scan
    np.testing.assert_allclose(got, sgd_reference(nested), atol=1e-6)


def test_a_tap_under_a_data_dependent_cond_is_refused_at_trace_time(mesh):
    # It used to deadlock: XLA:CPU aborted the process after 40 s.
    def body(x, p):
        x = jax.lax.cond(jnp.mean(x) > 0, lambda: block(jaxsync.tap(p)["w"], x), lambda: x)
        return x, None

    def loss_fn(p, b):
        return head(p, jax.lax.scan(body, b, p["blocks"])[0])

    step = jaxsync.train_step(loss_fn, optax.sgd(1.0), mesh, mode="ddp", stacked="blocks")
    with pytest.raises(ValueError, match=r"'blocks' sits inside a `lax.cond`.*\['data'\]"):
        step(step.init(PARAMS), X)
    # FSDP: the tap is the layer's all-gather, in the forward too
    step = jaxsync.train_step(loss_fn, optax.sgd(1.0), mesh, mode="fsdp", stacked="blocks")
    with pytest.raises(ValueError, match=r"FSDP gathers a unit inside a `lax.cond`"):
        step(step.init(PARAMS), X)

    def body_ok(x, p):  # tapped outside the branch: fine
        p = jaxsync.tap(p)
        return jax.lax.cond(jnp.mean(x) > 0, lambda: block(p["w"], x), lambda: x), None

    def loss_ok(p, b):
        return head(p, jax.lax.scan(body_ok, b, p["blocks"])[0])

    step = jaxsync.train_step(loss_ok, optax.sgd(1.0), mesh, mode="ddp", stacked="blocks")
    state, loss = step(step.init(PARAMS), X)  # each device takes its own branch
    assert np.isfinite(float(loss)) and int(state.step) == 1


def test_taps_outside_a_scan_with_microbatches_are_named(mesh):
    def unrolled(p, b):
        x = b
        for i in range(L):
            x = block(jaxsync.tap(jax.tree.map(lambda a, i=i: a[i], p["blocks"]))["w"], x)
        return head(p, x)

    with pytest.raises(ValueError, match="tapped 3 times outside any `lax.scan`"):
        trained_blocks(unrolled, mesh, "zero", 2)
    np.testing.assert_allclose(
        trained_blocks(unrolled, mesh, "zero", 1), sgd_reference(unrolled), atol=1e-6
    )


def test_fsdp_stack_read_without_tap_is_named(mesh):
    def direct(p, b):
        return head(p, block(p["blocks"]["w"][0], b))

    step = jaxsync.train_step(direct, optax.sgd(1.0), mesh, mode="fsdp", stacked="blocks")
    with pytest.raises(TypeError, match="view of the stacked-layer group 'blocks'"):
        step(step.init(PARAMS), X)

"""One step, one meaning (issue 41): a step's aux is what the same loss returns on ONE
device on the GLOBAL batch, in every mode, mesh and microbatch count.

Before: per-row aux came back as the elementwise mean of 8 devices' different rows
(shape ``(4, 5)`` for 32 rows), a bool as an int32 count of devices, and with
microbatches only the last microbatch's aux (a row count of 8 for 32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import make_batches, mlp_loss, mlp_params, run_reference
from helpers import mlp_forward as forward

import jaxsync

ROWS = 32


def loss_with_aux(params, batch):
    x, y = batch
    pred = forward(params, x)
    loss = jnp.mean((pred - y) ** 2)
    return loss, {
        "pred": pred,  # per row
        "cls": jnp.argmax(pred, axis=-1),  # per row, int
        "rows": x.shape[0],  # a Python int: the rows this call saw
        "big": jnp.any(x > 2.5),  # bool
        "never": jnp.any(x > 100.0),
        "loss": loss,  # float: a mean
        "max_x": jnp.max(x),  # declared "max"
        "x_sum": jnp.sum(x),  # declared "sum"
        "const": np.full((3,), 0.5, np.float32),  # a numpy constant: a float, a mean
    }


RULES = {"max_x": "max", "x_sum": "sum"}


def one_device(params, batch):
    """The same loss on one device on the global batch: what the step must return."""
    return loss_with_aux(params, batch)


def check_aux(aux, want):
    assert set(aux) == set(want)
    np.testing.assert_allclose(aux["pred"], want["pred"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux["cls"], want["cls"])
    assert aux["cls"].dtype == want["cls"].dtype
    assert int(aux["rows"]) == ROWS
    np.testing.assert_array_equal(aux["const"], want["const"])
    assert aux["big"].dtype == jnp.bool_ and bool(aux["big"]) == bool(want["big"])
    assert not bool(aux["never"])
    np.testing.assert_allclose(aux["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(aux["max_x"], want["max_x"], rtol=1e-6)
    np.testing.assert_allclose(aux["x_sum"], want["x_sum"], rtol=1e-4)


@pytest.mark.parametrize(("mode", "k"), [("zero", 1), ("ddp", 2), ("fsdp", 4), ("zero", 4)])
def test_aux_is_the_one_device_aux(mesh8, mode, k):
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=2, batch=ROWS)
    step = jaxsync.train_step(
        loss_with_aux, optax.sgd(0.1), mesh8, mode, has_aux=True, microbatches=k,
        aux_reduce=RULES,
    )  # fmt: skip
    state = step.init(params)
    p = params
    for x, y in zip(xs, ys, strict=True):
        want = one_device(p, (x, y))[1]
        state, (loss, aux) = step(state, (x, y))
        check_aux(aux, want)
        np.testing.assert_allclose(loss, mlp_loss(p, (x, y)), rtol=1e-5)
        p, _ = run_reference(optax.sgd(0.1), p, (x[None], y[None]))
    # Training is unchanged by the aux (SGD: a wrong scale would show).
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), step.params(state), p
    )


def test_rows_come_back_in_the_global_order_over_two_data_axes():
    """A ``("replica", "data")`` mesh with both axes data axes, 2 microbatches."""
    require_devices(8)
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(2), steps=1, batch=ROWS)
    step = jaxsync.train_step(
        loss_with_aux, optax.sgd(0.1), mesh, "ddp", axis_name=("replica", "data"),
        has_aux=True, microbatches=2, aux_reduce=RULES,
    )  # fmt: skip
    _, (_, aux) = step(step.init(params), (xs[0], ys[0]))
    check_aux(aux, one_device(params, (xs[0], ys[0]))[1])


def test_aux_on_a_two_d_mesh_with_microbatches():
    """The 2-D body (params sharded over "model" by spec) with microbatches."""
    from helpers import place_by_specs
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    sizes = (12, 32, 16, 5)  # "model" splits the hidden 32
    params = mlp_params(jax.random.PRNGKey(0), sizes)
    specs = jax.tree.map(lambda x: P(), params)
    specs["layer0"]["w"] = P(None, "model")
    xs, ys = make_batches(jax.random.PRNGKey(3), steps=1, batch=ROWS, sizes=sizes)
    for mode in ("zero", "fsdp"):
        step = jaxsync.train_step(
            loss_with_aux, optax.sgd(0.1), mesh, mode, has_aux=True, microbatches=2,
            aux_reduce=RULES,
        )  # fmt: skip
        _, (_, aux) = step(step.init(place_by_specs(mesh, params, specs)), (xs[0], ys[0]))
        check_aux(aux, one_device(params, (xs[0], ys[0]))[1])


def test_float_aux_of_a_weighted_loss_is_token_weighted(mesh8):
    """A weighted loss's float aux is the mean over the global batch's tokens: each
    piece weighed by its tokens, as one device computes it on all of them."""
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(4), steps=1, batch=ROWS)
    rng = np.random.default_rng(0)
    mask = (rng.random(ROWS) < 0.5).astype(np.float32)
    mask[:3] = 0.0  # device 0's rows weigh nothing in its first microbatch
    mask[-1] = 1.0

    def sum_fn(p, b):
        err = jnp.mean((forward(p, b["x"]) - b["y"]) ** 2, axis=-1)
        total = jnp.sum(err * b["m"])
        return total, {"token_mean": total / jnp.maximum(jnp.sum(b["m"]), 1.0),
                       "tokens": jnp.sum(b["m"]).astype(jnp.int32)}  # fmt: skip

    loss = jaxsync.weighted_loss(sum_fn, lambda b: jnp.sum(b["m"]))
    batch = {"x": xs[0], "y": ys[0], "m": mask}
    want_loss, want = loss(params, batch)
    for k in (1, 2):
        step = jaxsync.train_step(loss, optax.sgd(0.1), mesh8, "zero", has_aux=True,
                                  microbatches=k)  # fmt: skip
        _, (got_loss, aux) = step(step.init(params), batch)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(aux["token_mean"], want["token_mean"], rtol=1e-5)
        assert int(aux["tokens"]) == int(mask.sum())


def test_what_cannot_be_combined_is_refused_by_name(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=1, batch=16)
    batch = (xs[0], ys[0])

    def aux_with(extra):
        def fn(p, b):
            return mlp_loss(p, b), {"ok": jnp.ones(()), "bad": extra}

        return fn

    for extra, what in (("a str", r"`bad` is a str"), (jax.random.key(0), "a PRNG key")):
        step = jaxsync.train_step(aux_with(extra), optax.sgd(0.1), mesh8, has_aux=True)
        with pytest.raises(TypeError, match=what):
            step(step.init(params), batch)
    step = jaxsync.train_step(aux_with(1.0), optax.sgd(0.1), mesh8, has_aux=True,
                              aux_reduce={"nope": "sum"})  # fmt: skip
    with pytest.raises(ValueError, match=r"`aux_reduce` names \['nope'\]"):
        step(step.init(params), batch)
    with pytest.raises(ValueError, match="one of"):
        jaxsync.train_step(aux_with(1.0), optax.sgd(0.1), mesh8, has_aux=True,
                           aux_reduce={"ok": "median"})  # fmt: skip
    with pytest.raises(ValueError, match="has_aux=True"):
        jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, aux_reduce={"ok": "sum"})


def test_deterministic_units_are_pieces_too(mesh8):
    """Deterministic mode runs each device's rows as units, one after another: their
    aux is combined as microbatches' is."""
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(5), steps=1, batch=ROWS)
    mode = jaxsync.DDP(deterministic=jaxsync.Deterministic(units=16))
    step = jaxsync.train_step(loss_with_aux, optax.sgd(0.1), mesh8, mode, has_aux=True,
                              aux_reduce=RULES)  # fmt: skip
    _, (_, aux) = step(step.init(params), (xs[0], ys[0]))
    check_aux(aux, one_device(params, (xs[0], ys[0]))[1])


def scanned_with_aux(params, batch):
    """helpers.scanned_loss with per-row and count aux: the stacked group's gradient is
    reduced in the backward scan (the in-loop sync paths, ZeRO's held layers too)."""
    from helpers import scanned_block

    x, y = batch
    h = x @ params["inp"]["w"]

    def body(h, p):
        return scanned_block(jaxsync.tap(p), h), None

    h, _ = jax.lax.scan(jax.checkpoint(body), h, params["blocks"])
    out = h @ params["head"]["w"]
    return jnp.mean((out - y) ** 2), {"out": out, "rows": x.shape[0], "top": jnp.max(out)}


@pytest.mark.parametrize(("mode", "k"), [("zero", 1), ("zero", 2), ("ddp", 2), ("fsdp", 2)])
def test_aux_with_stacked_layers(mesh8, mode, k):
    from helpers import scanned_batches, scanned_params

    params = scanned_params(jax.random.PRNGKey(0), layers=3)
    xs, ys = scanned_batches(jax.random.PRNGKey(1), steps=1, batch=ROWS)
    step = jaxsync.train_step(
        scanned_with_aux, optax.sgd(0.1), mesh8, mode, has_aux=True, microbatches=k,
        stacked="blocks", aux_reduce={"top": "max"},
    )  # fmt: skip
    _, (_, aux) = step(step.init(params), (xs[0], ys[0]))
    want = scanned_with_aux(params, (xs[0], ys[0]))[1]
    np.testing.assert_allclose(aux["out"], want["out"], rtol=1e-5, atol=1e-6)
    assert int(aux["rows"]) == ROWS
    np.testing.assert_allclose(aux["top"], want["top"], rtol=1e-6)

"""flax linen's scanned layers under in-loop sync: ``jaxsync.linen_scan`` (issue #30).

A linen model stacking its Block with ``nn.scan`` could not train with ``stacked=``:
the group reaches the loss as jaxsync's view, and the Block's Dense read it untapped
(``TypeError: this is jaxsync's view ...``); ``nn.map_variables`` around the scan
taps the whole stack at once, outside the loop. ``jaxsync.linen_scan`` is ``nn.scan``
of the Block with each layer's params tapped first thing in the scanned body: the
same params and numbers as ``nn.scan`` outside a step, single-device optax inside
one, each layer's gradient reduced inside the backward loop.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import backward_rows_seen

import jaxsync

L, D, ROWS, STEPS = 6, 16, 32, 2
LAYER_BYTES = (D * D + D) * 4  # one layer's params, fp32


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(D, name="w")(h)), None


class Model(nn.Module):
    form: str = "helper"  # "helper", "scan" (plain nn.scan), "outside" (map_variables around)
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        if self.form == "helper":
            blocks = jaxsync.linen_scan(Block, length=L, remat=self.remat)
        else:
            blocks = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L
            )
        if self.form == "outside":  # the whole stack tapped once, outside the loop
            blocks = nn.map_variables(
                blocks, "params", trans_in_fn=tap_all, init=True, mutable=False
            )
        h, _ = blocks(name="blocks")(nn.Dense(D, name="inp")(x), None)
        return nn.Dense(2, name="head")(h)


def tap_all(variables):
    return {**variables, "params": jaxsync.tap(variables["params"])}


def data():
    rng = np.random.default_rng(0)
    return [
        (
            rng.standard_normal((ROWS, 5)).astype(np.float32),
            rng.standard_normal((ROWS, 2)).astype(np.float32),
        )
        for _ in range(STEPS)
    ]


def loss_of(model):
    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    return loss_fn


@functools.cache
def init_params(model=Model()):  # noqa: B008 (linen modules are frozen dataclasses)
    return jax.jit(model.init)(jax.random.PRNGKey(0), jnp.ones((1, 5)))["params"]


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd": lambda: optax.sgd(0.1),
}


@functools.cache
def reference(opt):
    """Single-device optax on the global batch, ``STEPS`` steps."""
    tx, loss_fn, params = OPTIMIZERS[opt](), loss_of(Model()), init_params()

    @jax.jit
    def one(params, state, b):
        updates, state = tx.update(jax.grad(loss_fn)(params, b), state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for b in data():
        params, state = one(params, state, b)
    return params


def test_outside_a_step_it_is_nn_scan():
    helper, plain = init_params(), init_params(Model(form="scan"))
    assert jax.tree.map(jnp.shape, helper)["blocks"] == {"w": {"kernel": (L, D, D), "bias": (L, D)}}
    jax.tree.map(np.testing.assert_array_equal, helper, plain)  # same tree, same init
    x = data()[0][0]

    both = jax.jit(lambda p: (Model().apply(p, x), Model(form="scan").apply(p, x)))
    np.testing.assert_array_equal(*both({"params": helper}))


CASES = [  # (mode, microbatches, optimizer, remat): each mode with both optimizers
    ("zero", 1, "adamw", False),
    ("zero", 2, "sgd", False),
    ("ddp", 1, "sgd", False),
    ("ddp", 2, "adamw", False),
    ("fsdp", 1, "adamw", False),
    ("fsdp", 2, "sgd", True),
]


@pytest.mark.parametrize(("mode", "microbatches", "opt", "remat"), CASES)
def test_trains_like_one_device_and_syncs_in_the_loop(mesh8, mode, microbatches, opt, remat):
    loss_fn, batches = loss_of(Model(remat=remat)), data()
    step = jaxsync.train_step(
        loss_fn, OPTIMIZERS[opt](), mesh8, mode=mode, stacked="blocks", microbatches=microbatches
    )
    state = step.init(init_params())
    with backward_rows_seen() as rows:
        for b in batches:
            state, _ = step(state, b)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        step.params(state),
        reference(opt),
    )
    # each layer's gradient is reduce-scattered inside the backward scan, once per
    # layer but the backward's last (the loop reduces the layer before in each
    # iteration; DDP's too: it gathers the reduced stack after the loop)...
    report = jaxsync.overlap_report(step.lower(state, batches[0]).compile())
    last = any(rows)  # the backward's last layer reduced after the loop
    kind = "reduce-scatter"
    in_loop = report.in_loop(kind=kind, role="backward")
    assert in_loop and all(c.trip_count == L - last for c in in_loop), report
    # ...and no other after it: there only that layer's, the unstacked params' (and
    # scalars') gradients are reduced, less than one layer's bytes more
    assert sum(c.bytes for c in report.in_entry(kind=kind)) < (1 + last) * LAYER_BYTES, report
    if mode == "fsdp":  # and the layers are gathered one by one in the forward loop
        gathers = report.in_loop(kind="all-gather", role="forward")
        assert gathers and all(c.trip_count == L for c in gathers), report


def test_plain_nn_scan_is_told_about_the_helper(mesh8):
    model = Model(form="scan")
    step = jaxsync.train_step(loss_of(model), optax.sgd(0.1), mesh8, mode="zero", stacked="blocks")
    with pytest.raises(TypeError, match=r"view of the stacked-layer group 'blocks'.*linen_scan"):
        step(step.init(init_params(model)), data()[0])


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_a_stack_tapped_once_outside_the_loop_is_named(mesh8, mode):
    model = Model(form="outside")
    step = jaxsync.train_step(
        loss_of(model), optax.sgd(0.1), mesh8, mode=mode, stacked="blocks", microbatches=2
    )
    with pytest.raises(ValueError, match="whole stacked-layer group 'blocks'") as err:
        step(step.init(init_params(model)), data()[0])
    msg = str(err.value)
    assert "tapped once outside the layer loop" in msg and "jaxsync.linen_scan" in msg
    assert "one by one in Python" not in msg


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="linen Module class"):
        jaxsync.linen_scan(Block(), length=L)
    with pytest.raises(ValueError, match="stacked on axis 0"):
        jaxsync.linen_scan(Block, length=L, variable_axes={"params": 1})

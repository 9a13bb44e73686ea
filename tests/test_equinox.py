"""equinox models through train_step: eqx.partition / combine, stacked layers, bf16."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import train_beside_optax

import jaxsync


class Block(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, h):
        return h + jnp.tanh(self.lin(h))


class Model(eqx.Module):
    blocks: Block  # four layers stacked [4, ...] by eqx.filter_vmap
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        make = lambda k: Block(eqx.nn.Linear(16, 16, key=k))  # noqa: E731
        self.blocks = eqx.filter_vmap(make)(jax.random.split(k1, 4))
        self.head = eqx.nn.Linear(16, 4, key=k2)


PARAMS, STATIC = eqx.partition(Model(jax.random.PRNGKey(0)), eqx.is_array)


def loss_fn(params, batch):
    # The stacked blocks are kept apart from eqx.combine: inside a step with
    # stacked="blocks" they are a jaxsync view, scanned with a tap per layer.
    blocks = params.blocks
    model = eqx.combine(eqx.tree_at(lambda m: m.blocks, params, STATIC.blocks), STATIC)

    def layer(h, p):
        return eqx.combine(jaxsync.tap(p), STATIC.blocks)(h), None

    def one(x):
        h, _ = jax.lax.scan(layer, x.astype(model.head.weight.dtype), blocks)
        return model.head(h)

    x, y = batch
    return jnp.mean((jax.vmap(one)(x).astype(jnp.float32) - y) ** 2)


def _batches(steps=3):
    x = jax.random.normal(jax.random.PRNGKey(1), (steps, 32, 16))
    y = jax.random.normal(jax.random.PRNGKey(2), (steps, 32, 4))
    return x, y


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
@pytest.mark.parametrize("stacked", [(), "blocks"], ids=["unrolled", "stacked"])
def test_an_equinox_model_trains_as_optax_on_one_device(mesh8, mode, stacked):
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, mode, stacked=stacked)
    xs, ys = _batches()
    batches = [(xs[i], ys[i]) for i in range(3)]
    state, ref = train_beside_optax(step, step.init(PARAMS), optax.sgd(0.1), PARAMS, loss_fn,
                                    batches)  # fmt: skip
    got = step.params(state)
    assert jax.tree.structure(got) == jax.tree.structure(ref)  # the same eqx.Module tree
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_a_bf16_equinox_model_keeps_its_dtype_and_trains_on_an_fp32_master(mesh8, mode):
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, mode, stacked="blocks")
    state = step.init(params)
    master, tx = jax.tree.map(lambda p: p.astype(jnp.float32), params), optax.sgd(0.1)
    xs, ys = _batches()
    for i in range(3):
        state, _ = step(state, (xs[i], ys[i]))
        # One device: bf16 forward and backward, the update on an fp32 master.
        g = jax.grad(loss_fn)(jax.tree.map(lambda m: m.astype(jnp.bfloat16), master),
                              (xs[i], ys[i]))  # fmt: skip
        master = optax.apply_updates(master, tx.update(g, tx.init(master), master)[0])
    for p in jax.tree.leaves(step.params(state)):
        assert p.dtype == jnp.bfloat16
    # Apart by the bf16 rounding of each device's gradient (1.3e-4 to 2.3e-4 here);
    # a master kept in bf16 would be a bf16 step (~1e-3) away.
    for a, b in zip(jax.tree.leaves(step.master(state)), jax.tree.leaves(master), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=5e-4)

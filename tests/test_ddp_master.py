"""DDP keeps fp32 master weights for bf16 and fp16 params, as ZeRO does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_loss, mlp_params, state_bytes_on_device

import jaxsync

SIZES = (16, 40, 24, 4)


def _train(mesh, mode, params, tx, steps=5, **kw):
    step = jaxsync.train_step(mlp_loss, tx, mesh, mode, **kw)
    state = step.init(params)
    xs, ys = make_batches(jax.random.PRNGKey(1), steps, 32, SIZES)
    for i in range(steps):
        state, _ = step(state, (xs[i], ys[i]))
    return step, state


def _max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("tx", [optax.sgd(0.05), optax.adamw(3e-3, weight_decay=0.1)],
                         ids=["sgd", "adamw"])  # fmt: skip
def test_bf16_ddp_trains_as_zero_does(mesh8, tx):
    # Both: bf16 forward and backward, fp32 reductions, the optimizer on an fp32
    # master. Before, DDP updated the bf16 params in bf16 and drifted from ZeRO.
    params = mlp_params(jax.random.PRNGKey(0), sizes=SIZES, dtype=jnp.bfloat16)
    dstep, dstate = _train(mesh8, jaxsync.DDP(), params, tx)
    zstep, zstate = _train(mesh8, jaxsync.ZeRO(), params, tx)
    assert _max_diff(dstep.master(dstate), zstep.master(zstate)) < 1e-6
    assert _max_diff(dstep.params(dstate), zstep.params(zstate)) == 0.0
    # The master is no cast of the params: small updates live below bf16's rounding.
    master, cast = dstep.master(dstate), jax.tree.map(lambda p: p.astype(jnp.float32),
                                                      dstep.params(dstate))  # fmt: skip
    assert _max_diff(master, cast) > 0
    for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(dstep.params(dstate)), strict=True):
        assert m.dtype == jnp.float32 and p.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(m.astype(jnp.bfloat16)), np.asarray(p))


def test_fp16_params_under_adam_stay_finite(mesh8):
    # Adam's update of fp16 params in fp16 overflowed on the first finite step.
    params = mlp_params(jax.random.PRNGKey(0), sizes=SIZES, dtype=jnp.float16)
    scale = dict(loss_scale=jaxsync.DynamicLossScale(2.0**10))
    dstep, dstate = _train(mesh8, jaxsync.DDP(), params, optax.adam(1e-3), **scale)
    zstep, zstate = _train(mesh8, jaxsync.ZeRO(), params, optax.adam(1e-3), **scale)
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(dstep.params(dstate)))
    assert int(dstate.step) == int(zstate.step) == 5
    assert _max_diff(dstep.master(dstate), zstep.master(zstate)) < 1e-6


def test_the_master_costs_four_bytes_per_param_per_device(mesh8):
    params = mlp_params(jax.random.PRNGKey(0), sizes=SIZES, dtype=jnp.bfloat16)
    n = sum(p.size for p in jax.tree.leaves(params))
    step = jaxsync.train_step(mlp_loss, optax.adam(1e-3), mesh8, jaxsync.DDP())
    state = step.init(params)
    dev = mesh8.devices.flat[0]
    # bf16 params, fp32 master, fp32 mu and nu, and Adam's int32 count, on every device.
    assert state_bytes_on_device(state.params, dev) == 2 * n
    assert state_bytes_on_device(state.opt_state, dev) == (4 + 4 + 4) * n + 4
    fp32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    state32 = jaxsync.train_step(mlp_loss, optax.adam(1e-3), mesh8, jaxsync.DDP()).init(fp32)
    assert state_bytes_on_device(state32.opt_state, dev) == (4 + 4) * n + 4  # no copy

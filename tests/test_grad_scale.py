"""Tests that see a gradient's scale (issue #29, item 7).

Adam, AdamW and active global-norm clipping are blind to a gradient multiplied by
a constant (a missing 1/N or 1/k, a doubled reduction, a loss scale never divided
out): their updates are the same. Each path here trains with plain
``optax.sgd`` (no clipping), whose update is the gradient times the learning
rate, against single-device optax on the same global batches, and compares
``state.metrics.grad_norm`` with the single-device gradient's norm at every step.
A gradient twice too large moves the params twice as far (100% off, where the
tolerances are 2e-5) and doubles the norm.

fp32 throughout: rtol 2e-5 / atol 2e-6 hold for the params (the sums differ from
one device's only in order); the norms to rtol 2e-5.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import (
    make_batches,
    mlp_loss,
    mlp_params,
    nnx_reference,
    place_by_specs,
    scanned_batches,
    scanned_loss,
    scanned_params,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_finalize import (
    AXES,
    MOE_RULES,
    MOE_SPECS,
    moe_batches,
    moe_local_loss,
    moe_params,
    moe_reference_loss,
    put,
)

import jaxsync

LR = 0.05
TX = optax.sgd(LR)  # one value: the jitted reference step is compiled once per model
STEPS = 2
BATCH = 32
SCALE = 2.0**10  # far from 1: a scale never divided out is 1024x
RTOL, ATOL = 2e-5, 2e-6


def close(got, want):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=ATOL), got, want
    )


@partial(jax.jit, static_argnums=0)
def _reference_step(loss_fn, params, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, _ = TX.update(grads, TX.init(params), params)
    return optax.apply_updates(params, updates), optax.tree.norm(grads)


def reference(loss_fn, params, batches):
    """Single-device ``TX`` over ``batches``: ``(params, each step's gradient norm)``."""
    norms = []
    for batch in zip(*batches, strict=True):
        params, norm = _reference_step(loss_fn, params, batch)
        norms.append(float(norm))
    return params, np.asarray(norms)


def train(step, params, batches):
    """``(params after training, state.metrics.grad_norm after each step)``."""
    state = step.init(params)
    norms = []
    for batch in zip(*batches, strict=True):
        state, loss = step(state, batch)
        assert np.isfinite(float(loss)) and not bool(state.metrics.skipped)
        norms.append(float(state.metrics.grad_norm))
    assert int(state.step) == len(norms)
    return step.params(state), np.asarray(norms)


def assert_matches(got, norms, want, want_norms, start):
    """Params and every step's grad norm as on one device, and the steps large
    enough (the largest param change > 1e-2) that a 2x gradient is far outside
    the tolerance."""
    moved = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(start), strict=True)
    )
    assert moved > 1e-2, moved
    close(got, want)
    np.testing.assert_allclose(norms, want_norms, rtol=RTOL)


@functools.cache
def mlp_case():
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    return params, batches, reference(mlp_loss, params, batches)


@functools.cache
def scanned_case():
    params = scanned_params(jax.random.PRNGKey(0))
    batches = scanned_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    return params, batches, reference(scanned_loss, params, batches)


# ------------------------------------------------------------- deterministic
@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_deterministic_mode_is_sgd(mesh8, mode):
    """Exact fixed-point sums over 8 units times 1/units (DDP: all-gathered; ZeRO:
    its shards), with a loss scale of 1024 removed after them."""
    det = jaxsync.Deterministic(units=8)
    value = jaxsync.DDP(deterministic=det) if mode == "ddp" else jaxsync.ZeRO(deterministic=det)
    params, batches, (want, want_norms) = mlp_case()
    step = jaxsync.train_step(
        mlp_loss, TX, mesh8, value, loss_scale=jaxsync.DynamicLossScale(SCALE)
    )
    got, norms = train(step, params, batches)
    assert_matches(got, norms, want, want_norms, params)


# ----------------------------------------------------------------------- DDP
@pytest.mark.parametrize(
    "options",
    [dict(microbatches=2), dict(loss_scale=jaxsync.DynamicLossScale(SCALE))],
    ids=["microbatches", "loss_scale"],
)
def test_ddp_is_sgd(mesh8, options):
    """1-D DDP: the mean over 2 microbatches (the local sum / k, then / N), and a
    dynamic loss scale divided out after the all-reduce."""
    params, batches, (want, want_norms) = mlp_case()
    got, norms = train(jaxsync.train_step(mlp_loss, TX, mesh8, "ddp", **options), params, batches)
    assert_matches(got, norms, want, want_norms, params)


# ------------------------------------------------------------------- stacked
@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_stacked_loss_scale_is_sgd(mesh8, mode):
    """A scanned model whose layers are reduced inside the backward scan, with a
    loss scale of 1024: undone after the in-loop reduction (ZeRO: on its
    ShardedGrads; DDP: on DataParallel's averaged tree)."""
    params, batches, (want, want_norms) = scanned_case()
    step = jaxsync.train_step(
        scanned_loss, TX, mesh8, mode, stacked="blocks", loss_scale=jaxsync.DynamicLossScale(SCALE)
    )
    got, norms = train(step, params, batches)
    assert_matches(got, norms, want, want_norms, params)


# ---------------------------------------------------------------------- 2-D
#: Megatron's column/row split of the scanned model over "model".
TP_SPECS = {
    "inp": {"w": P(None, "model")},
    "blocks": {
        "w1": P(None, None, "model"), "b1": P(None, "model"),
        "w2": P(None, "model", None), "g": P(),
    },
    "head": {"w": P("model", None)},
}  # fmt: skip


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_two_d_microbatches_and_loss_scale_are_sgd(mode):
    """(data=4, model=2), params split over "model", 2 microbatches and a loss scale
    of 1024: the data reduction's factor is 1/(n*k) (ddp/zero: the first
    microbatch's local sum added in the last one's taps and in the free params'
    reduction; fsdp: each microbatch reduced on its own), the loss scale removed
    after it."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params, batches, (want, want_norms) = scanned_case()
    step = jaxsync.train_step(
        scanned_loss, TX, mesh, mode, stacked="blocks", microbatches=2,
        loss_scale=jaxsync.DynamicLossScale(SCALE),
    )  # fmt: skip
    got, norms = train(step, place_by_specs(mesh, params, TP_SPECS), batches)
    assert got["blocks"]["w1"].sharding.spec == P(None, None, "model")  # the 2-D path ran
    assert_matches(got, norms, want, want_norms, params)


# -------------------------------------------------------------------- experts
def test_expert_parallel_is_sgd():
    """ExpertParallel rules on (data=4, expert=2): expert buffers reduced over "data"
    only, yet averaged by all 8 ranks (Megatron's scaling), in the distributed
    optimizer's reduce-scatter and in all_reduce_grads (DDP)."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), AXES)
    params = moe_params(jax.random.PRNGKey(0))
    batches = moe_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    want, want_norms = reference(moe_reference_loss, params, batches)
    zero = jaxsync.distributed_optimizer(
        TX, axis_name=AXES, rules=MOE_RULES, check_elementwise=False
    )
    placed = put(params, mesh, MOE_SPECS)
    specs = zero.state_specs(placed, mesh)
    assert {b.key.axes for b in zero.layout(placed, mesh).buffers} == {("data",), AXES}

    @jax.jit
    @partial(
        jax.shard_map, mesh=mesh, in_specs=(MOE_SPECS, MOE_SPECS, specs, P(AXES)),
        out_specs=(MOE_SPECS, MOE_SPECS, specs),
    )  # fmt: skip
    def step(p_zero, p_ddp, state, batch):
        vg = jaxsync.value_and_grad(moe_local_loss, axis_name=AXES, rules=MOE_RULES)
        updates, state = zero.update(vg(p_zero, batch)[1], state, p_zero)
        grads = jaxsync.all_reduce_grads(vg(p_ddp, batch)[1], axis_name=AXES, rules=MOE_RULES)
        ddp_updates, _ = TX.update(grads, TX.init(p_ddp), p_ddp)
        return (
            optax.apply_updates(p_zero, updates),
            optax.apply_updates(p_ddp, ddp_updates),
            state,
        )

    p_zero, p_ddp, state = placed, placed, zero.sharded_init(placed, mesh)
    norms = []
    for batch in zip(*batches, strict=True):
        batch = jaxsync.shard_batch(batch, mesh, axis_name=AXES)
        p_zero, p_ddp, state = step(p_zero, p_ddp, state, batch)
        norms.append(float(state.metrics.grad_norm))
    assert_matches(p_zero, np.asarray(norms), want, want_norms, params)
    close(p_ddp, want)


# ----------------------------------------------------------------- quick start
def test_readme_quick_start_is_sgd(mesh8):
    """The README's quick start (an nnx model, ZeRO) with SGD: the README's own check
    runs AdamW, which would not see a wrongly scaled gradient."""
    import jax.numpy as jnp
    from flax import nnx

    def build():
        rngs = nnx.Rngs(0)
        return nnx.Sequential(nnx.Linear(8, 32, rngs=rngs), nnx.tanh, nnx.Linear(32, 1, rngs=rngs))

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    data = np.random.default_rng(0).standard_normal((STEPS, 64, 8), np.float32)
    batches = [(x, np.sin(x).sum(1, keepdims=True)) for x in data]
    step = jaxsync.train_step(loss_fn, TX, mesh8, jaxsync.ZeRO())
    state = step.init(build())
    norms = []
    for batch in batches:
        state, _ = step(state, batch)
        norms.append(float(state.metrics.grad_norm))
    want, last_norm = nnx_reference(build(), TX, loss_fn, batches)
    start = nnx.to_pure_dict(nnx.state(build(), nnx.Param))
    got = nnx.to_pure_dict(nnx.state(step.model(state), nnx.Param))
    # nnx_reference keeps the last step's norm only: compare that one.
    assert_matches(got, np.asarray(norms[-1:]), want, np.asarray([float(last_norm)]), start)

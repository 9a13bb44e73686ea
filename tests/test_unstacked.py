"""A stack of layers run by ``lax.scan`` without ``stacked=`` is named in a warning.

Such a step trains correctly but reduces the stack's gradient after the backward loop
and, in ZeRO and FSDP, holds the whole gathered stack; the step reads its traced loss
once per compile (``step.unstacked``) and says which prefix to name.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import mlp_loss, mlp_params, scanned_batches, scanned_loss, scanned_params

import jaxsync
from jaxsync._src.step.unstacked import scanned_inputs, stack_groups


def _warnings(mesh, loss, params, batch, **kw) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = jaxsync.train_step(loss, optax.sgd(0.1), mesh, **kw)
        step(step.init(params), batch)
    return [str(w.message) for w in caught if w.category is jaxsync.UnstackedScanWarning]


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_an_unnamed_scanned_stack_is_named(mesh8, mode):
    params = scanned_params(jax.random.PRNGKey(0), layers=3)
    xs, ys = scanned_batches(jax.random.PRNGKey(1), 1, 16)
    got = _warnings(mesh8, scanned_loss, params, (xs[0], ys[0]), mode=mode, microbatches=2)
    assert len(got) == 1, got
    assert "under 'blocks'" in got[0] and "stack of 3 layers" in got[0], got[0]
    assert "`stacked='blocks'`" in got[0] and "jaxsync.tap(p)" in got[0], got[0]
    named = _warnings(mesh8, scanned_loss, params, (xs[0], ys[0]), mode=mode, stacked="blocks")
    assert named == []


def test_a_deterministic_step_is_quiet(mesh8):
    """Deterministic mode refuses `stacked=`: the warning advised what it refuses
    (found by probing)."""
    params = scanned_params(jax.random.PRNGKey(0), layers=3)
    xs, ys = scanned_batches(jax.random.PRNGKey(1), 1, 16)
    det = jaxsync.ZeRO(deterministic=jaxsync.Deterministic(units=8))
    assert _warnings(mesh8, scanned_loss, params, (xs[0], ys[0]), mode=det) == []


def test_a_model_without_a_scan_is_quiet(mesh8):
    xs = jnp.ones((16, 12)), jnp.ones((16, 5))
    assert _warnings(mesh8, mlp_loss, mlp_params(jax.random.PRNGKey(0)), xs, mode="zero") == []


def test_scanned_inputs_reads_through_calls_not_into_loops():
    """Inputs scanned as they are, cast, inside a jit or a remat count; a slice of one,
    or a scan inside another loop's body, does not."""

    def f(a, b, c, d):
        body = lambda h, w: (h + w.sum(), None)  # noqa: E731
        h = jax.jit(lambda x: jax.lax.scan(body, 0.0, x.astype(jnp.bfloat16))[0])(a)
        h = h + jax.checkpoint(lambda x: jax.lax.scan(body, 0.0, x)[0])(b)
        h = h + jax.lax.scan(body, 0.0, c[1:])[0]  # a slice: not the input itself

        def outer(h, x):  # d is scanned only inside another loop
            return h + jax.lax.scan(body, 0.0, d)[0] + x, None

        return h + jax.lax.scan(outer, 0.0, jnp.arange(2.0))[0]

    shapes = [jnp.zeros((4, 3))] * 3 + [jnp.zeros((5, 3))]
    assert scanned_inputs(jax.make_jaxpr(f)(*shapes)) == {0: 4, 1: 4}


def test_stack_groups_names_the_shortest_wholly_scanned_prefix():
    names = ["embed", "blocks.attn.w", "blocks.mlp.w", "enc.w", "enc.b", "enc.extra"]
    # all of blocks scanned; of enc, not `extra`: each scanned enc leaf is its own group
    assert stack_groups(names, {1, 2, 3, 4}) == ["blocks", "enc.w", "enc.b"]
    assert stack_groups(names, set()) == []


def test_a_linen_scan_and_a_2d_step_are_named_too(mesh8):
    """flax linen's ``nn.scan`` (its params under the scanned module's name) and a step
    on a data x model mesh (the compiler's tensor parallelism) read the same way."""
    import flax.linen as nn
    from helpers import place_by_specs
    from jax.sharding import AxisType
    from tp_gpt import gpt_batches, gpt_loss, gpt_params, tp_specs

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + jnp.tanh(nn.Dense(8)(x)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            axes, rngs = {"params": 0}, {"params": True}
            scan = nn.scan(Block, variable_axes=axes, split_rngs=rngs, length=3)
            return nn.Dense(1)(scan()(nn.Dense(8)(x), None)[0])

    net, x = Net(), jnp.ones((16, 4))
    params = net.init(jax.random.PRNGKey(0), x)["params"]

    def loss(p, batch):
        return jnp.mean((net.apply({"params": p}, batch[0]) - batch[1]) ** 2)

    got = _warnings(mesh8, loss, params, (x, jnp.ones((16, 1))), mode="fsdp")
    assert len(got) == 1 and "under 'ScanBlock_0'" in got[0], got
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    batch = jax.tree.map(lambda b: b[0], gpt_batches(jax.random.key(1), 1, 8))
    placed = place_by_specs(mesh, gpt_params(jax.random.key(0)), tp_specs())
    got = _warnings(mesh, gpt_loss, placed, batch, mode="zero")
    assert len(got) == 1 and "under 'blocks'" in got[0], got

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

"""Stacked layers under finalize rules: a tensor- and sequence-parallel layer stack
reduced in the backward loop, by plain data parallelism (whole or as shards) and by
the distributed optimizer, equals one device's gradient on the global batch.

Each layer's norm and output bias run sequence-parallel (their local gradients are
partial sums over ``tensor``, which jaxsync adds: ``SequenceParallel``), its MLP is
column- then row-parallel (its pieces vary over ``tensor``). Before each buffer's key
carried the axes its gradients vary over, all three failed to trace.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

L, D, F, V, T = 3, 8, 16, 11, 8
SPECS = {
    "embed": P(),
    "blocks": {
        "ln": {"scale": P(), "bias": P()},
        "w1": P(None, None, "tensor"),
        "b1": P(None, "tensor"),
        "w2": P(None, "tensor", None),
        "b2": P(),
    },
}
RULES = jaxsync.SyncRules.of(
    {
        r"^embed$": jaxsync.SequenceParallel("tensor"),
        r"^blocks\.(ln\.|b2)": jaxsync.SequenceParallel("tensor"),
    }
)
BATCH = P("data", "tensor")  # rows over data, each row's sequence over tensor


def _params() -> dict:
    rng = np.random.default_rng(0)
    n = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-2])).astype(np.float32)  # noqa: E731
    return {
        "embed": (0.5 * rng.standard_normal((V, D))).astype(np.float32),
        "blocks": {
            "ln": {"scale": 1 + 0.1 * n(L, 1, D)[:, 0], "bias": 0.1 * n(L, 1, D)[:, 0]},
            "w1": n(L, D, F),
            "b1": 0.1 * n(L, 1, F)[:, 0],
            "w2": n(L, F, D),
            "b2": 0.1 * n(L, 1, D)[:, 0],
        },
    }


def _layernorm(x, scale, bias):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * scale + bias


def _ce(logits, targets):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]


def _loss(params, batch, local=False):
    """Mean next-token cross-entropy; ``local``: this device's rows and sequence chunk,
    the MLP's hidden dim split over ``tensor``."""
    tokens, targets = batch

    def body(x, p):
        p = jaxsync.tap(p)
        h = _layernorm(x, p["ln"]["scale"], p["ln"]["bias"])
        if not local:
            return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], None
        h = jax.lax.all_gather(h, "tensor", axis=1, tiled=True)
        o = jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]
        o = jax.lax.psum_scatter(o, "tensor", scatter_dimension=1, tiled=True)
        return x + o + p["b2"], None

    x, _ = jax.lax.scan(body, params["embed"][tokens], params["blocks"])
    per_token = _ce(x @ params["embed"].T, targets)
    return jnp.sum(per_token) / (tokens.shape[0] * T) if local else jnp.mean(per_token)


def _setup():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    rng = np.random.default_rng(1)
    batch = rng.integers(0, V, (8, T)), rng.integers(0, V, (8, T))
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), _params(), SPECS)
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, BATCH)), batch)
    return mesh, placed, sharded, jax.grad(_loss)(_params(), batch)


close = partial(np.testing.assert_allclose, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shard_grads", [False, True])
def test_data_parallel(mesh8, shard_grads):
    mesh, params, batch, want = _setup()
    sync = jaxsync.DataParallel("data", rules=RULES, stacked="blocks", shard_grads=shard_grads)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(SPECS, BATCH), out_specs=SPECS)
    def run(p, b):
        _, g = jaxsync.value_and_grad(partial(_loss, local=True), axis_name="data", sync=sync)(p, b)
        return sync.gather(g.shards, sync.layout(p)) if shard_grads else g

    jax.tree.map(close, run(params, batch), want)


def test_distributed_optimizer(mesh8):
    """SGD with learning rate 1: the update is minus the reduced gradient."""
    mesh, params, batch, want = _setup()
    tx = jaxsync.distributed_optimizer(
        optax.sgd(1.0), axis_name="data", rules=RULES, stacked="blocks"
    )
    state = tx.sharded_init(params, mesh)

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(SPECS, tx.state_specs(params, mesh), BATCH),
        out_specs=SPECS,
    )
    def run(p, s, b):
        _, g = jaxsync.value_and_grad(partial(_loss, local=True), axis_name="data", sync=tx)(p, b)
        assert isinstance(g, jaxsync.ShardedGrads)
        updates, _ = tx.update(g, s, p)
        return jax.tree.map(jnp.negative, updates)

    jax.tree.map(close, run(params, state, batch), want)

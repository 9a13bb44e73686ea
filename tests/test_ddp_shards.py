"""DDP's stacked gradients as shards: reduce-scattered in the backward loop, gathered after.

``jaxsync.DataParallel(shard_grads=True)`` keeps 1/N of each layer's reduced gradient
per rank while the loop runs (ZeRO-2's gradients), and ``DataParallel.gather`` makes
the reduced tree for the replicated update after it; ``jaxsync.DDP`` steps do this on
more than one device. Checked against one device's ``jax.grad`` on the global batch,
against the all-reduce's tree, and in the compiled step: where each collective sits
and what the backward loop carries.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import scanned_loss, scanned_params
from jax.sharding import PartitionSpec as P

import jaxsync

L, D = 3, 24
#: a layer's elements per stacked param, each buffer padded to a multiple of lcm(8, 128)
MATRIX, VECTOR = 640, 128


def _params() -> dict:
    """``helpers.scanned_params`` with [D, D] matrices and D-vectors per layer."""
    return scanned_params(jax.random.PRNGKey(0), layers=L, din=6, d=D, hidden=D)


def _batch(rows: int = 32):
    rng = np.random.default_rng(1)
    return (
        rng.standard_normal((rows, 6)).astype(np.float32),
        rng.standard_normal((rows, 3)).astype(np.float32),
    )


def _grads(mesh, sync):
    """(the ShardedGrads' shard shapes, or None; the reduced tree) of ``scanned_loss``."""
    shapes = []

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    def run(params, batch):
        _, g = jaxsync.value_and_grad(scanned_loss, axis_name="data", sync=sync)(params, batch)
        if isinstance(g, jaxsync.ShardedGrads):
            shapes.extend(s.shape for s in g.shards)
            return sync.gather(g.shards, sync.layout(params))
        return g

    tree = run(_params(), jaxsync.shard_batch(_batch(), mesh))
    return shapes or None, tree


def test_shard_grads_gathers_the_gradient_of_one_device(mesh8):
    sync = jaxsync.DataParallel("data", stacked="blocks", shard_grads=True)
    shapes, got = _grads(mesh8, sync)
    want = jax.grad(scanned_loss)(_params(), _batch())  # one device, the global batch
    close = partial(np.testing.assert_allclose, rtol=2e-5, atol=2e-6)
    jax.tree.map(close, got, want)
    _, whole = _grads(mesh8, jaxsync.DataParallel("data", stacked="blocks"))
    jax.tree.map(close, got, whole)
    # each stacked param in a buffer of its own, 1/8 of it per rank and layer: a
    # [D, D] matrix (576 elements) padded to 640, a [D] vector to 128
    stacked = sorted(s for s in shapes if len(s) == 2)
    assert stacked == sorted([(L, MATRIX // 8)] * 2 + [(L, VECTOR // 8)] * 2), stacked


#: one layer's elements of the stack in the all-reduce's unpadded buffer
_WHOLE = 2 * D * D + 2 * D


def _backward_carries(compiled_text: str) -> list[str]:
    """The shapes each backward while loop (one holding a reduce-scatter) carries."""
    bodies = {
        m.group(1)
        for m in re.finditer(r"^\s*%?([\w.\-]+) .*\{\s*$", compiled_text, re.M)
        if "reduce-scatter" in _computation(compiled_text, m.group(1))
    }
    carries = []
    for line in compiled_text.splitlines():
        m = re.search(r"= (\(.*\)) while\(.*body=%?([\w.\-]+)", line)
        if m and m.group(2) in bodies:
            carries.append(m.group(1))
    return carries


def _computation(text: str, name: str) -> str:
    start = re.search(rf"^\s*%?{re.escape(name)} .*\{{\s*$", text, re.M)
    if start is None:
        return ""
    end = text.find("\n}", start.end())
    return text[start.end() : end]


def test_a_ddp_step_carries_the_reduced_stack_as_shards(mesh8):
    """The backward loop of a DDP step writes each layer's reduced gradient into
    ``[L, shard]`` rows (one per stacked param), never into the whole ``[L, size]``
    stack; the whole stack is gathered after the loop, outside any loop."""
    step = jaxsync.train_step(scanned_loss, optax.sgd(0.1), mesh8, "ddp", stacked="blocks")
    state = step.init(_params())
    text = step.lower(state, _batch()).compile().as_text()
    carries = _backward_carries(text)
    assert carries, "no backward loop with a reduce-scatter"
    carried = " ".join(carries)
    assert carried.count(f"f32[{L},{MATRIX // 8}]") == 2, carried
    assert carried.count(f"f32[{L},{VECTOR // 8}]") == 2, carried
    assert f"f32[{L},{_WHOLE}]" not in carried, carried  # the all-reduce's one buffer
    report = jaxsync.overlap_report(text)
    assert not report.in_loop(kind="all-reduce") and not report.in_loop(kind="all-gather")
    # and the step trains as SGD on one device does
    batch = _batch()
    state, _ = step(state, batch)
    want = jax.tree.map(
        lambda p, g: p - 0.1 * g, _params(), jax.grad(scanned_loss)(_params(), batch)
    )
    jax.tree.map(partial(np.testing.assert_allclose, rtol=2e-5, atol=2e-6), state.params, want)


def test_a_one_device_step_keeps_its_gradients_whole():
    """Nothing to shard on one device: the loop keeps the whole reduced stack."""
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = jaxsync.train_step(scanned_loss, optax.sgd(0.1), one, "ddp", stacked="blocks")
    state = step.init(_params())
    text = step.lower(state, _batch()).compile().as_text()
    assert f"f32[{L},{_WHOLE}]" in text and f"f32[{L},{VECTOR // 8}]" not in text


# ----------------------------------------------- experts: buffers over fewer axes
AXES, E, F = ("data", "expert"), 2, 16
RULES = jaxsync.SyncRules.of({r"^blocks\.experts\.": jaxsync.ExpertParallel("expert")})
SPECS = {
    "blocks": {
        "w": P(),
        "router": P(),
        "experts": {"w1": P(None, "expert"), "w2": P(None, "expert")},
    },
    "out": P(),
}


def _moe_params() -> dict:
    rng = np.random.default_rng(2)
    n = lambda *s: rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-2])  # noqa: E731
    return {
        "blocks": {
            "w": n(L, 6, 6),
            "router": n(L, 6, E),
            "experts": {"w1": n(L, E, 6, F), "w2": n(L, E, F, 6)},
        },
        "out": n(6, 3),
    }


def _moe_loss(params, batch, local=False):
    """Stacked blocks, each a residual tanh layer then a dense-routed MoE. ``local``:
    each rank holds one expert per layer and runs it on the expert group's rows."""
    x, y = batch

    def body(h, p):
        p = jaxsync.tap(p)
        h = h + jnp.tanh(h @ p["w"])
        gate = jax.nn.softmax(h @ p["router"])
        w1, w2 = p["experts"]["w1"], p["experts"]["w2"]
        if not local:
            mix = sum(gate[:, e : e + 1] * (jax.nn.gelu(h @ w1[e]) @ w2[e]) for e in range(E))
            return h + mix, None
        ha = jax.lax.all_gather(h, "expert", tiled=True)
        ga = jax.lax.all_gather(gate, "expert", tiled=True)
        mine = jnp.take(ga, jax.lax.axis_index("expert"), axis=1)[:, None]
        mix = jax.lax.psum_scatter(mine * (jax.nn.gelu(ha @ w1[0]) @ w2[0]), "expert", tiled=True)
        return h + mix, None

    h, _ = jax.lax.scan(body, x, params["blocks"])
    return jnp.mean((h @ params["out"] - y) ** 2)


@pytest.mark.parametrize("shard_grads", [True, False])
def test_stacked_experts_reduce_over_their_own_axes(shard_grads):
    """Experts reduced over ``data`` only (4 ranks), the rest over both axes (8), in the
    backward loop; with ``shard_grads`` each stacked buffer reduce-scattered over its
    own axes and gathered back over them. Either way the gradient of one device on
    the global batch (both failed before a buffer's key carried its expert axis)."""
    mesh = jax.make_mesh((4, 2), AXES)
    sync = jaxsync.DataParallel(AXES, rules=RULES, stacked="blocks", shard_grads=shard_grads)
    shapes = []

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(SPECS, P(AXES)), out_specs=SPECS)
    def run(params, batch):
        loss = partial(_moe_loss, local=True)
        _, g = jaxsync.value_and_grad(loss, axis_name=AXES, sync=sync)(params, batch)
        if not shard_grads:
            return g
        assert isinstance(g, jaxsync.ShardedGrads)
        shapes.extend(s.shape for s in g.shards)
        return sync.gather(g.shards, sync.layout(params))

    params, batch = _moe_params(), _batch()
    placed = jax.tree.map(lambda x, s: jax.device_put(x, jax.NamedSharding(mesh, s)), params, SPECS)
    got = run(placed, jaxsync.shard_batch(batch, mesh, axis_name=AXES))
    want = jax.grad(_moe_loss)(params, batch)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=2e-5, atol=2e-6), got, want)
    if shard_grads:
        # per layer: w (36 elements) and the router (12), each padded to 128 over 8
        # ranks; each rank's expert w1 / w2 (96) padded to lcm(4, 128) = 128 over 4
        stacked = sorted(s for s in shapes if len(s) == 2)
        assert stacked == sorted([(L, 16), (L, 16), (L, 32), (L, 32)]), stacked


def test_layout_outside_shard_map_says_where_it_runs():
    """It raised a bare ``KeyError: 'data'`` (found by probing the public API)."""
    dp = jaxsync.DataParallel("data", stacked="blocks", shard_grads=True)
    with pytest.raises(ValueError, match=r"DataParallel.layout must run inside `jax.shard_map`"):
        dp.layout(_params())
    mesh = jax.make_mesh((8,), ("data",))
    inside = jax.shard_map(
        lambda p: jnp.int32(len(dp.layout(p).buffers)), mesh=mesh, in_specs=P(), out_specs=P()
    )
    assert int(inside(_params())) > 0  # inside, it lays the params out

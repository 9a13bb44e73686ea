"""FSDP reduces first the half of a layer's gradient that its backward finishes first.

The order is read off the loss's program (a param's gradient is complete when the
backward of its first use is), not taken from the layout, whose sorted names put a
block's first-used norm beside its last-used matrix.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.fsdp import gather
from jaxsync._src.fsdp.gather import gather_pieces
from jaxsync._src.fsdp.ready_order import ready_orders, reduction_orders

D = 8


def _block_model(params, batch):
    """A pre-norm block: ``z_norm`` and ``z_attn`` used first, then the MLP's ``a_mlp1``
    and ``a_mlp2``. The layout stores a layer's params in reverse order of their
    names (norm, attn, mlp2, mlp1), and every piece has its own width."""
    x, y = batch

    @jax.checkpoint
    def body(h, layer):
        p = jaxsync.tap(layer)
        a = jnp.tanh((h * p["z_norm"]) @ p["z_attn"])[:, :D]
        m = jnp.tanh(a @ p["a_mlp1"])[:, :32] @ p["a_mlp2"]
        return h + m, None

    h, _ = jax.lax.scan(body, x, params["blocks"])
    return jnp.mean((h @ params["head"] - y) ** 2)


def _block_params(key):
    k = jax.random.split(key, 5)
    return {
        "blocks": {
            "z_norm": 1.0 + 0.1 * jax.random.normal(k[0], (2, D)),
            "z_attn": 0.3 * jax.random.normal(k[1], (2, D, 48)),
            "a_mlp1": 0.3 * jax.random.normal(k[2], (2, D, 64)),
            "a_mlp2": 0.3 * jax.random.normal(k[3], (2, 32, D)),
        },
        "head": 0.3 * jax.random.normal(k[4], (D, 4)),
    }


def test_the_ready_order_is_the_reverse_of_each_pieces_first_use(mesh8):
    """Read through reshapes, names and casts; an unused piece is ready at once."""
    widths = (2, 3, 4, 1)

    def f(shard, x):
        a, b, c, unused = gather_pieces(shard, widths, ("data",), (), "float32", "float32")
        del unused
        y = x[:32] * c.reshape(4, 8).astype(jnp.bfloat16).reshape(32)  # c first
        y = y[:16] + a  # then a
        return y.sum() + jax.lax.stop_gradient(b.reshape(3, 8)).sum()  # b last

    mapped = jax.shard_map(f, mesh=mesh8, in_specs=(P("data"), P()), out_specs=P(), check_vma=False)
    along = NamedSharding(mesh8, P("data"))
    shard = jax.ShapeDtypeStruct((8 * sum(widths),), jnp.float32, sharding=along)
    x = jax.ShapeDtypeStruct((32,), jnp.float32, sharding=NamedSharding(mesh8, P()))
    jaxpr = jax.make_jaxpr(mapped)(shard, x).jaxpr
    assert ready_orders(jaxpr) == {(16, 24, 32, 8): (3, 1, 0, 2)}


def test_halves_in_the_ready_order_reduce_to_the_shard_exactly(mesh8):
    """Halves that are not contiguous in the shard (pieces 1 and 3, then 0 and 2): each
    rank's shard gradient is the mean of every rank's cotangent of its part, exactly,
    as with the layout's halves."""
    widths, n = (3, 5, 2, 6), 8
    cts = [jax.random.normal(jax.random.key(i), (n, n * w)) for i, w in enumerate(widths)]

    def grad_of_shard(shard, *cts):
        def loss(s):
            outs = gather_pieces(s, widths, ("data",), (), "float32", "float32")
            return sum(jnp.sum(o * c[0]) for o, c in zip(outs, cts, strict=True))

        return jax.grad(loss)(shard)

    spec = (P("data"),) + (P("data"),) * len(widths)
    mapped = jax.jit(jax.shard_map(grad_of_shard, mesh=mesh8, in_specs=spec, out_specs=P("data")))
    args = [jax.device_put(jnp.zeros(n * sum(widths)), NamedSharding(mesh8, P("data")))]
    args += [jax.device_put(c, NamedSharding(mesh8, P("data"))) for c in cts]
    sizes = tuple(n * w for w in widths)
    with reduction_orders({sizes: (3, 1, 0, 2)}):
        ordered = np.asarray(mapped(*args))
        text = mapped.lower(*args).as_text()
    # a fresh jit: the one above holds the ordered trace
    layout = np.asarray(
        jax.jit(jax.shard_map(grad_of_shard, mesh=mesh8, in_specs=spec, out_specs=P("data")))(*args)
    )
    want = np.concatenate(
        [
            np.concatenate(
                [
                    np.asarray(c).reshape(n, n, w)[:, r].mean(0)
                    for c, w in zip(cts, widths, strict=True)
                ]
            )
            for r in range(n)
        ]
    )
    np.testing.assert_array_equal(ordered, layout)
    np.testing.assert_allclose(ordered, want, rtol=1e-6, atol=1e-7)
    assert text.count("reduce_scatter") == 2
    # the split: the first 3/5 of the width in that order, each group in shard order
    got = []
    halve = partial(gather.halves, widths, ("data",), ())
    jax.shard_map(
        lambda x: got.extend([halve((3, 1, 0, 2)), halve()]) or x,
        mesh=mesh8, in_specs=P(), out_specs=P(),
    )(jnp.zeros(()))  # fmt: skip
    assert got == [[[1, 3], [0, 2]], [[0, 1, 2], [3]]]


def test_fsdp_reduces_the_mlp_half_first_and_trains_as_optax(mesh8, monkeypatch):
    """On the block model the first half holds the MLP's two matrices (used last,
    differentiated first), the second the norm and attention's matrix; in the
    layout's order the first half would have held the norm, attention's matrix and
    ``a_mlp2``. Training matches optax on one device (SGD, two steps)."""
    seen = []
    halves = gather.halves

    def spy(widths, axes, replicate, order=None):
        seen.append((widths, order))
        return halves(widths, axes, replicate, order)

    monkeypatch.setattr(gather, "halves", spy)
    params = _block_params(jax.random.key(0))
    tx = optax.sgd(0.3)
    step = jaxsync.train_step(_block_model, tx, mesh8, "fsdp", stacked="blocks")
    state = step.init(params)
    data = [
        (
            jax.random.normal(jax.random.key(10 + i), (16, D)),
            jax.random.normal(jax.random.key(20 + i), (16, 4)),
        )
        for i in range(2)
    ]
    ref, opt = params, tx.init(params)
    for batch in data:
        state, _ = step(state, batch)
        upd, opt = tx.update(jax.grad(_block_model)(ref, batch), opt, ref)
        ref = optax.apply_updates(ref, upd)
    for a, b in zip(jax.tree.leaves(step.params(state)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    # the stacked unit's pieces, one rank's width each (padded to 16 elements)
    name = {16: "z_norm", 48: "z_attn", 64: "a_mlp1", 32: "a_mlp2"}
    (widths, order), *_ = [s for s in seen if len(s[0]) == 4]
    assert [name[w] for w in widths] == ["z_norm", "z_attn", "a_mlp2", "a_mlp1"]
    assert [name[widths[i]] for i in order] == ["a_mlp2", "a_mlp1", "z_attn", "z_norm"]
    first, second = _split(halves, widths, order)
    assert {name[widths[i]] for i in first} == {"a_mlp2", "a_mlp1"}
    assert {name[widths[i]] for i in second} == {"z_attn", "z_norm"}
    assert _split(halves, widths, None)[0] == [0, 1, 2]  # the layout's halves


def _split(halves, widths, order):
    out = []
    jax.shard_map(
        lambda x: out.extend(halves(widths, ("data",), (), order)) or x,
        mesh=jax.make_mesh((8,), ("data",)), in_specs=P(), out_specs=P(),
    )(jnp.zeros(()))  # fmt: skip
    return out

"""optax.contrib.muon as the user wrote it (its own dimension numbers), in sharded modes.

A stacked ``[L, D, D]`` param whose dimension numbers batch over ``L``, a plain
matrix, a vector and a head matrix (the user's dimension numbers give the head to
Newton-Schulz). Each step must train what optax's muon trains on one device: the
ZeRO and FSDP steps own each param whole on one rank and hand it to muon in the
param tree, so muon's state is spread over the ranks (FSDP kept a copy per rank).
Before, the step was refused with an internal pytree error, and the rewrite the
refusal spelled out (muon_labels + optax.adamw) trained another optimizer (9e-2 off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as MDN

import jaxsync

L, D, OUT, ROWS, STEPS = 3, 8, 4, 16, 3
TOL = dict(rtol=1e-5, atol=1e-6)


def params_and_dims():
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "blocks": {"w": jax.random.normal(k[0], (L, D, D)) * 0.3, "g": jnp.ones((L, D))},
        "mid": {"w": jax.random.normal(k[1], (D, D)) * 0.3},
        "b": jnp.zeros((D,)),
        "head": {"w": jax.random.normal(k[2], (D, OUT)) * 0.3},
    }
    dims = {
        "blocks": {"w": MDN(reduction_axis=(1,), output_axis=(2,)), "g": None},
        "mid": {"w": MDN()},
        "b": None,
        "head": {"w": MDN()},  # Muon's, by the user's word (muon_labels says adamw)
    }
    return params, dims


def loss_of(scale):
    def loss(p, batch):
        x, y = batch

        def body(h, layer):
            layer = jaxsync.tap(layer)  # FSDP gathers each layer here; elsewhere a no-op
            return jnp.tanh(h @ layer["w"]) * layer["g"], None

        h, _ = jax.lax.scan(body, x, p["blocks"])
        h = jnp.tanh(h @ p["mid"]["w"] + p["b"])
        return scale * jnp.mean((h @ p["head"]["w"] - y) ** 2)

    return loss


def batches():
    k = jax.random.split(jax.random.key(1), 2)
    return (
        np.asarray(jax.random.normal(k[0], (STEPS, ROWS, D))),
        np.asarray(jax.random.normal(k[1], (STEPS, ROWS, OUT))),
    )


def one_device(tx, params, loss):
    xs, ys = batches()
    state = tx.init(params)
    for i in range(STEPS):
        g = jax.grad(loss)(params, (xs[i], ys[i]))
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


def sharded(step, params):
    xs, ys = batches()
    state = step.init(params)
    for i in range(STEPS):
        state, _ = step(state, (xs[i], ys[i]))
    return step.params(state)


def close(want, got):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, **TOL), want, got)


# scale 1e-8: gradients near muon's and Adam's eps, where both stop hiding a scale
# of the gradient (a mean taken as a sum would show 8x there).
@pytest.mark.parametrize("scale", [1.0, 1e-8])
@pytest.mark.parametrize("stacked", [None, "blocks"])
@pytest.mark.parametrize("mode", [jaxsync.ZeRO(), jaxsync.FSDP()], ids=["zero", "fsdp"])
def test_trains_the_users_muon(mesh8, mode, stacked, scale):
    params, dims = params_and_dims()
    tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    loss = loss_of(scale)
    want = one_device(tx, params, loss)
    got = sharded(jaxsync.train_step(loss, tx, mesh8, mode, stacked=stacked), params)
    close(want, got)
    pairs = zip(jax.tree.leaves(want), jax.tree.leaves(params), strict=True)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    assert moved > 1e-3  # it trained


def test_distributed_optimizer_owns_each_param_whole(mesh8):
    """The explicit path: the stacked param is one unit, on one rank, [L, D, D] whole."""
    params, dims = params_and_dims()
    tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    dist = jaxsync.distributed_optimizer(tx, axis_name="data", stacked="blocks")
    report = jaxsync.ownership_report(dist, params, mesh8)
    shapes = {m.name: m.shape for m in report.matrices}
    assert shapes["blocks.w"] == (L, D, D) and shapes["head.w"] == (D, OUT)
    assert len(report.matrices) == 5 and all(m.layer is None for m in report.matrices)


def test_the_fsdp_refusal_spells_a_rewrite_that_trains_the_same(mesh8):
    """A label's muon beside another optimizer: FSDP (flat shards per label) refuses;
    the rewrite it writes out (ZeRO, the same `tx` and `labels`) trains what
    optax.multi_transform trains on one device."""
    params, dims = params_and_dims()
    tx = {"muon": optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims),
          "sgd": optax.sgd(0.1)}  # fmt: skip
    labels = jax.tree.map(lambda _: "muon", params)
    labels["blocks"]["g"] = "sgd"
    loss = loss_of(1.0)
    step = jaxsync.train_step(loss, tx, mesh8, jaxsync.FSDP(), labels=labels)
    rewrite = r"(?s)optax.contrib.muon.*jaxsync.ZeRO\(\).*same `labels`"
    with pytest.raises(ValueError, match=rewrite):
        step.init(params)
    want = one_device(optax.multi_transform(tx, labels), params, loss)
    close(want, sharded(jaxsync.train_step(loss, tx, mesh8, jaxsync.ZeRO(), labels=labels), params))


@pytest.mark.parametrize(("mode", "after"), [("zero", 4), ("fsdp", 4), ("fsdp", 8)])
def test_a_checkpoint_continues_the_users_muon(mesh8, tmp_path, mode, after):
    """Saved after one step on 8 devices, restored (on 4: ownership recomputed, in
    ZeRO and FSDP alike; the owned state is saved per param), two more steps:
    one-device muon."""
    params, dims = params_and_dims()
    tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    loss = loss_of(1.0)
    xs, ys = batches()
    step8 = jaxsync.train_step(loss, tx, mesh8, mode, stacked="blocks")
    state, _ = step8(step8.init(params), (xs[0], ys[0]))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step8, state)
    mesh = jax.make_mesh((after,), ("data",), devices=jax.devices()[:after])
    step = jaxsync.train_step(loss, tx, mesh, mode, stacked="blocks")
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        state = ckpt.restore_state(step, step.init(params)).state
    for i in range(1, STEPS):
        state, _ = step(state, (xs[i], ys[i]))
    close(one_device(tx, params, loss), step.params(state))


def bytes_per_device(tree):
    per = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values())


def test_fsdp_spreads_muons_state_over_the_owners(mesh8):
    """Twelve [D, D] matrices and three vectors on 8 ranks: each device holds the
    state of the params it owns (padded to the fullest rank's), not all of it. It
    held every byte on every device before (3284 here: one copy per rank)."""
    k = jax.random.split(jax.random.key(0), 12)
    params = {f"m{i:02d}": jax.random.normal(k[i], (D, D)) for i in range(12)}
    params.update({f"v{i}": jnp.zeros((D,)) for i in range(3)})
    dims = {n: (MDN() if n.startswith("m") else None) for n in params}
    tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)

    def loss(p, batch):
        h = batch[0]
        for i in range(12):
            h = jnp.tanh(h @ p[f"m{i:02d}"] + p[f"v{i % 3}"])
        return jnp.mean(h**2)

    step = jaxsync.train_step(loss, tx, mesh8, jaxsync.FSDP())
    state = step.init(params)
    whole = sum(x.nbytes for x in jax.tree.leaves(tx.init(params)))
    mine = bytes_per_device(state.opt_state)
    assert mine <= whole / 5, (mine, whole)  # 2 matrices' momenta of 12, padding included
    xs, ys = batches()
    # the owners get their params' columns by all-to-all (nothing gathered whole)
    assert "all-to-all" in step.lower(state, (xs[0], ys[0])).compile().as_text()
    state, _ = step(state, (xs[0], ys[0]))
    assert bytes_per_device(state.opt_state) == mine


def test_fsdp_owners_over_two_data_axes(mesh8):
    """Ranks numbered over ("replica", "data"), 2 x 4: the all-to-all and the owners
    agree on who is who (one-device muon)."""
    mesh = jax.make_mesh((2, 4), ("replica", "data"), devices=jax.devices()[:8])
    params, dims = params_and_dims()
    tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    loss = loss_of(1.0)
    step = jaxsync.train_step(
        loss, tx, mesh, jaxsync.FSDP(), axis_name=("replica", "data"), stacked="blocks"
    )
    close(one_device(tx, params, loss), sharded(step, params))

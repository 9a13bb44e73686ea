"""bf16 on the wire, fp32 sums: the default reduce-scatter of a bf16 model inside a host.

jaxsync promises gradients summed in fp32. For bf16 params the pieces cross the wire
in bf16 (GSPMD's bytes) and each rank adds the N pieces it receives in fp32: exact
for gradients computed in bf16, one bf16 rounding per input otherwise, never a
rounding of a running sum as a bf16 ring does.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.core import hosts

BF16, F32 = jnp.bfloat16, jnp.float32


def _layout(params):
    return jaxsync.build_layout(
        params,
        num_shards=8,
        bucket_size=1000,
        key_fn=lambda _, x: jaxsync.BufferKey(jnp.dtype(x.dtype).name, ("data",)),
    )


def _scatter(mesh, layout, reduce_dtype, grads_dtype):
    """Each rank's local gradients are its own rows of ``g``; the reduced shards."""

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    def run(g):
        local = {"w": g[0].astype(grads_dtype)}
        return jaxsync.bucket_reduce_scatter(
            local, layout, axis_name="data", reduce_dtype=reduce_dtype, average=False
        )[0]

    return run


def _put(mesh, rows):
    return jax.device_put(jnp.asarray(rows), jax.NamedSharding(mesh, P("data")))


def _exact_shards(layout, rows):
    total = np.asarray(rows, np.float64).sum(0).reshape(-1)
    flat = np.zeros(layout.buffers[0].size)
    for r in range(8):
        for piece in layout.shard_ranges(r):
            lo, hi = piece.in_shard
            plo, phi = piece.in_param
            flat[r * layout.shard_size(0) + lo : r * layout.shard_size(0) + hi] = total[plo:phi]
    return flat


@pytest.mark.parametrize("grads_dtype", [BF16, F32])
def test_bf16_buffers_sum_in_fp32_after_one_rounding_per_input(mesh8, grads_dtype):
    params = {"w": jnp.zeros((37, 53), BF16)}
    layout = _layout(params)
    rng = np.random.default_rng(0)
    scales = 10.0 ** rng.integers(-3, 3, (8, 1, 1))
    rows = (rng.standard_normal((8, 37, 53)) * scales).astype(np.float32)
    if grads_dtype == BF16:  # gradients computed in bf16: exact on the wire
        rows = np.asarray(jnp.asarray(rows).astype(BF16).astype(F32))
    run = _scatter(mesh8, layout, F32, grads_dtype)
    lowered = run.lower(_put(mesh8, rows)).as_text()
    counts = jaxsync.lowered_collective_counts(lowered)
    assert counts["all-to-all"] == 1 and counts["reduce-scatter"] == 0
    assert "tensor<8x" in lowered and "bf16" in lowered.split("all_to_all")[1][:400]
    got = np.asarray(run(_put(mesh8, rows)), np.float64).reshape(-1)
    exact = _exact_shards(layout, rows)
    # fp32 inputs: each rounded once to bf16 (unit roundoff 2^-8), then fp32 sums
    per_input = 2.0**-24 * 8 if grads_dtype == BF16 else 2.0**-8 + 2.0**-24 * 8
    scale = _exact_shards(layout, np.abs(rows))
    assert np.all(np.abs(got - exact) <= per_input * scale + 1e-30)
    # a bf16 ring rounds the running sum at every hop; this one does not
    ring = _scatter(mesh8, layout, BF16, grads_dtype)
    assert "reduce_scatter" in ring.lower(_put(mesh8, rows)).as_text()


def test_fp32_params_and_large_groups_keep_the_ring(mesh8, monkeypatch):
    rows = _put(mesh8, jnp.ones((8, 16, 16), F32))
    fp32 = _scatter(mesh8, _layout({"w": jnp.zeros((16, 16), F32)}), F32, F32)
    assert jaxsync.lowered_collective_counts(fp32.lower(rows).as_text())["all-to-all"] == 0
    # a group larger than one host's NVLink domain: the fp32 ring (XLA's model prices
    # a 64-way all-to-all at 5x the ring)
    monkeypatch.setattr(hosts, "ONE_HOST_RANKS", 4)
    bf16 = _scatter(mesh8, _layout({"w": jnp.zeros((16, 16), BF16)}), F32, BF16)
    counts = jaxsync.lowered_collective_counts(bf16.lower(rows).as_text())
    assert counts["all-to-all"] == 0 and counts["reduce-scatter"] == 1


def test_the_zero_step_of_a_bf16_model_sends_bf16(mesh8):
    """The default ZeRO step needs no option for it, and still trains like optax."""
    import optax

    params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((64, 32)), BF16)}
    x = jnp.asarray(np.random.default_rng(2).standard_normal((32, 64)), BF16)

    def loss(p, xb):
        return jnp.mean(jnp.square((xb @ p["w"]).astype(F32)))

    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh8, mode="zero")
    state = step.init(params)
    counts = jaxsync.lowered_collective_counts(step.lower(state, x).as_text())
    assert counts["all-to-all"] >= 1 and counts["reduce-scatter"] == 0
    state, _ = step(state, x)
    g = jax.grad(lambda w: loss({"w": w.astype(BF16)}, x))(params["w"].astype(F32))
    want = params["w"].astype(F32) - 0.1 * g
    np.testing.assert_allclose(np.asarray(state.params["w"], F32), want, rtol=2e-2, atol=2e-3)


def test_inside_the_layer_loop_the_ring_stays(mesh8):
    """XLA pipelines a reduce-scatter into the next layer's backward, but not an
    all-to-all: a scanned layer's gradients keep the fp32 ring, the rest go bf16."""
    import optax

    rng = np.random.default_rng(3)
    params = {
        "blocks": {"w": jnp.asarray(rng.standard_normal((3, 32, 32)) * 0.1, BF16)},
        "head": jnp.asarray(rng.standard_normal((32, 8)), BF16),
    }

    def loss(p, xb):
        def body(h, w):
            return jnp.tanh(h @ jaxsync.tap(w)["w"]), None

        h, _ = jax.lax.scan(body, xb, p["blocks"])
        return jnp.mean(jnp.square((h @ p["head"]).astype(F32)))

    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh8, mode="zero", stacked="blocks")
    x = jnp.asarray(rng.standard_normal((16, 32)), BF16)
    text = step.lower(step.init(params), x).as_text()
    counts = jaxsync.lowered_collective_counts(text)
    assert counts["all-to-all"] == 1 and counts["reduce-scatter"] == 1
    scatter = text.split("reduce_scatter")[1][:600]
    assert "xf32>" in scatter  # the loop's ring sums in fp32


def test_fsdps_unstacked_units_send_bf16_and_train_as_the_ring(mesh8, monkeypatch):
    """FSDP with a bf16 policy: the unstacked units (embedding, head), reduced once outside
    the layer loop, send bf16 and sum in fp32; the scanned layers keep the fp32 ring.
    The same training as with every unit on the ring (the sums differ in order only),
    and none of it with fp32 compute (the cotangents are fp32: nothing narrower to send)
    or with replica axes."""
    import optax

    from jaxsync._src.fsdp import gather

    rng = np.random.default_rng(4)
    params = {
        "embed": jnp.asarray(rng.standard_normal((64, 32)) * 0.3, F32),
        "blocks": {"w": jnp.asarray(rng.standard_normal((3, 32, 32)) * 0.1, F32)},
        "head": jnp.asarray(rng.standard_normal((32, 8)) * 0.3, F32),
    }

    def loss(p, tokens):
        h = p["embed"][tokens]

        def body(h, w):
            return jnp.tanh(h @ jaxsync.tap(w)["w"]), None

        h, _ = jax.lax.scan(body, h, p["blocks"])
        return jnp.mean(jnp.square((h @ p["head"]).astype(F32)))

    tokens = jnp.asarray(rng.integers(0, 64, (16,)), jnp.int32)
    tx = optax.sgd(0.1)

    def run(policy):
        step = jaxsync.train_step(loss, tx, mesh8, jaxsync.FSDP(policy=policy), stacked="blocks")
        state = step.init(params)
        counts = jaxsync.lowered_collective_counts(step.lower(state, tokens).as_text())
        for _ in range(2):
            state, _ = step(state, tokens)
        return counts, step.params(state)

    bf16 = jaxsync.MixedPrecision(param_dtype=BF16)
    counts, wired = run(bf16)
    assert counts["all-to-all"] == 2 and counts["reduce-scatter"] == 1, counts
    with monkeypatch.context() as m:
        m.setattr(gather, "wire_sum", lambda *a: False)
        ring_counts, ring = run(bf16)
    assert ring_counts["all-to-all"] == 0 and ring_counts["reduce-scatter"] == 3, ring_counts
    for a, b in zip(jax.tree.leaves(wired), jax.tree.leaves(ring), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    fp32_counts, _ = run(jaxsync.MixedPrecision(param_dtype=F32))
    assert fp32_counts["all-to-all"] == 0, fp32_counts

    def sends(mesh, axes, replicate):
        def grad(s):
            full = gather.gather_shard(s, axes, replicate, "bfloat16", "float32")
            return jnp.sum(jnp.square(full.astype(F32)))

        fn = jax.shard_map(jax.grad(grad), mesh=mesh, in_specs=P(axes), out_specs=P(axes))
        x = jax.ShapeDtypeStruct((64,), F32, sharding=jax.NamedSharding(mesh, P(axes)))
        return jaxsync.lowered_collective_counts(jax.jit(fn).lower(x).as_text())

    assert sends(mesh8, ("data",), ())["all-to-all"] == 1
    hybrid = sends(jax.make_mesh((2, 4), ("replica", "shard")), ("shard",), ("replica",))
    assert hybrid["all-to-all"] == 0 and hybrid["reduce-scatter"] == 1, hybrid

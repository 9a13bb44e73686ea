from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    count_collectives,
    count_lowered_collectives,
    make_batches,
    mlp_loss,
    mlp_params,
    scanned_params,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

STEPS = 4
GLOBAL_BATCH = 32


def single_device_run(params, opt, batches, compute_dtype=None):
    """Reference: plain optax on one device with the same global batches."""
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        p32 = (
            params
            if compute_dtype is None
            else jax.tree.map(lambda p: p.astype(compute_dtype), params)
        )
        grads = jax.grad(mlp_loss)(p32, batch)
        updates, state = opt.update(grads, state, p32)
        new = optax.apply_updates(p32, updates)
        if compute_dtype is not None:
            new = jax.tree.map(lambda n, p: n.astype(p.dtype), new, params)
        return new, state

    xs, ys = batches
    for i in range(xs.shape[0]):
        params, state = step(params, state, (xs[i], ys[i]))
    return params


def dp_run(mesh, params, opt, batches, bucket_size, reduce_dtype=jnp.float32):
    state = opt.init(params)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))
    def step(params, state, batch):
        loss, grads = jaxsync.value_and_grad(mlp_loss, axis_name="data")(params, batch)
        grads = jaxsync.all_reduce_grads(
            grads, axis_name="data", bucket_size=bucket_size, reduce_dtype=reduce_dtype
        )
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

    xs, ys = batches
    for i in range(xs.shape[0]):
        batch = jaxsync.shard_batch((xs[i], ys[i]), mesh, axis_name="data")
        params, state, _ = step(params, state, batch)
    return params


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("bucket_size", [None, 100, 700])
def test_data_parallel_equals_single_device(mesh8, opt_name, bucket_size):
    opt = optax.sgd(0.1) if opt_name == "sgd" else optax.adam(1e-2)
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), STEPS, GLOBAL_BATCH)
    ref = single_device_run(params, opt, batches)
    got = dp_run(mesh8, params, opt, batches, bucket_size)
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-3  # training actually changed the params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), ref, got)


def test_bf16_params_with_fp32_reduction(mesh8):
    opt = optax.sgd(0.1)
    params = mlp_params(jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    batches = make_batches(jax.random.PRNGKey(1), STEPS, GLOBAL_BATCH)
    # Reference: same bf16 params, grads in fp32 math on one device, update in fp32,
    # stored back in bf16.
    ref = single_device_run(params, opt, batches, compute_dtype=jnp.float32)

    state = opt.init(params)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    def step(params, state, batch):
        p32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        _, grads = jaxsync.value_and_grad(mlp_loss, axis_name="data")(p32, batch)
        grads = jaxsync.all_reduce_grads(grads, axis_name="data", bucket_size=200)
        updates, state = opt.update(grads, state, p32)
        new = optax.apply_updates(p32, updates)
        return jax.tree.map(lambda n, p: n.astype(p.dtype), new, params), state

    xs, ys = batches
    for i in range(STEPS):
        params, state = step(params, state, jaxsync.shard_batch((xs[i], ys[i]), mesh8))
    mismatched = 0
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # equal to bf16 rounding: at most one bf16 ulp apart
        np.testing.assert_allclose(a32, b32, rtol=2**-7, atol=1e-6)
        mismatched += int(np.sum(a32 != b32))
    assert mismatched <= 0.02 * sum(p.size for p in jax.tree.leaves(params))


def test_bf16_grads_reduced_in_fp32(mesh8):
    """The collective itself runs in fp32 (read from HLO) and the values match."""
    g = jax.random.normal(jax.random.PRNGKey(3), (8, 300)).astype(jnp.bfloat16)

    def compiled(reduce_dtype):
        @jax.jit
        @partial(jax.shard_map, mesh=mesh8, in_specs=P("data"), out_specs=P())
        def f(v):
            return jaxsync.all_reduce_grads(
                {"w": v[0]}, axis_name="data", reduce_dtype=reduce_dtype
            )["w"]

        return f.lower(jax.device_put(g, NamedSharding(mesh8, P("data"))))

    def reduce_types(lowered):
        # The program as jaxsync emitted it (XLA:CPU later widens bf16 reductions
        # itself, so the compiled text would not tell the two apart).
        lines = lowered.as_text().splitlines()
        return {
            lines[i + j].split("->")[-1].split("x")[-1].rstrip(">")
            for i, line in enumerate(lines)
            if "stablehlo.all_reduce" in line
            for j in range(1, 8)
            if i + j < len(lines) and "}) :" in lines[i + j]
        }

    assert reduce_types(compiled(jnp.float32)) == {"f32"}
    assert reduce_types(compiled(None)) == {"bf16"}
    out = compiled(jnp.float32).compile()(jax.device_put(g, NamedSharding(mesh8, P("data"))))
    assert out.dtype == jnp.bfloat16
    expect = (np.asarray(g, np.float32) / 8).sum(0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expect))


def _compiled_step_text(mesh, bucket_size, local=True):
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, GLOBAL_BATCH)
    batch = jaxsync.shard_batch((xs[0], ys[0]), mesh)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    def step(params, batch):
        if local:
            _, grads = jaxsync.value_and_grad(mlp_loss, axis_name="data")(params, batch)
            return jaxsync.all_reduce_grads(grads, axis_name="data", bucket_size=bucket_size)
        return jax.grad(mlp_loss)(params, batch)  # already all-reduced by JAX

    return step.lower(params, batch)


@pytest.mark.parametrize("bucket_size, buckets", [(None, 1), (600, 2), (1, 7)])
def test_compiled_step_has_one_all_reduce_per_bucket(mesh8, bucket_size, buckets):
    params = mlp_params(jax.random.PRNGKey(0))
    layout = jaxsync.build_layout(params, bucket_size=bucket_size)
    assert layout.num_buckets == buckets
    lowered = _compiled_step_text(mesh8, bucket_size)
    expect = {
        "all-reduce": buckets,
        "reduce-scatter": 0,
        "all-gather": 0,
        "collective-permute": 0,
        "all-to-all": 0,
    }
    assert count_lowered_collectives(lowered.as_text()) == expect
    assert count_collectives(lowered.compile().as_text()) == expect


def test_plain_grad_hides_an_all_reduce(mesh8):
    """Why value_and_grad exists: plain jax.grad of P() params adds all-reduces."""
    ops = count_collectives(_compiled_step_text(mesh8, None, local=False).compile().as_text())
    assert ops["all-reduce"] > 1


def test_accumulation_equals_one_big_batch(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, 64)
    x, y = xs[0], ys[0]

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P("data")), out_specs=(P(), P()))
    def big(params, batch):
        loss, g = jaxsync.value_and_grad(mlp_loss, axis_name="data")(params, batch)
        return jax.lax.pmean(loss, "data"), jaxsync.all_reduce_grads(g, axis_name="data")

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P(None, "data")), out_specs=(P(), P()))
    def micro(params, mbs):
        loss, g = jaxsync.accumulate_grads(mlp_loss, params, mbs, axis_name="data")
        return jax.lax.pmean(loss, "data"), jaxsync.all_reduce_grads(g, axis_name="data")

    loss_a, ga = big(params, jaxsync.shard_batch((x, y), mesh8))
    # 4 microbatches of 16; each device's rows are the same in both runs.
    mb = jax.tree.map(
        lambda a: (
            a.reshape(8, 4, 2, *a.shape[1:])
            .transpose(1, 0, 2, *range(3, a.ndim + 2))
            .reshape(4, 16, *a.shape[1:])
        ),
        (x, y),
    )
    mb = jax.device_put(mb, NamedSharding(mesh8, P(None, "data")))
    loss_b, gb = micro(params, mb)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ga, gb)
    ops = count_collectives(micro.lower(params, mb).compile().as_text())
    assert ops["all-reduce"] == 2  # one bucket of grads + the loss; none per microbatch


def test_nonfinite_flags_name_param_and_rank(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, GLOBAL_BATCH)
    x = xs[0].at[13, 0].set(jnp.inf)  # row 13 lives on rank 3 (4 rows per rank)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P("data"))
    def check(params, batch):
        _, g = jaxsync.value_and_grad(mlp_loss, axis_name="data")(params, batch)
        return jaxsync.nonfinite_grads(g, axis_name="data")

    flags = check(params, jaxsync.shard_batch((x, ys[0]), mesh8))
    assert flags["layer0"]["w"].shape == (8,)
    assert list(np.flatnonzero(flags["layer0"]["w"])) == [3]
    with pytest.raises(FloatingPointError, match=r"\['layer0'\]\['w'\] on rank\(s\) \[3\]"):
        jaxsync.raise_if_nonfinite(flags)
    clean = check(params, jaxsync.shard_batch((xs[0], ys[0]), mesh8))
    jaxsync.raise_if_nonfinite(clean)  # no error


def test_broadcast_params_makes_replicas_equal(mesh8):
    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=P("data"), out_specs=(P(), P("data")))
    def bcast(keys):
        params = mlp_params(keys[0])  # each rank initialises differently
        mine = jax.tree.map(lambda p: p[None], params)
        return jaxsync.broadcast_params(params, axis_name="data", bucket_size=300), mine

    keys = jax.random.split(jax.random.PRNGKey(7), 8)
    out, before = bcast(jax.device_put(keys, NamedSharding(mesh8, P("data"))))
    before = jax.device_get(before)
    assert not np.array_equal(before["layer0"]["w"][0], before["layer0"]["w"][1])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b[0]), out, before)


def test_unknown_axis_names_mesh_axes(mesh8):
    @partial(jax.shard_map, mesh=mesh8, in_specs=P(), out_specs=P())
    def f(params):
        return jaxsync.all_reduce_grads(params, axis_name="dat")

    with pytest.raises(ValueError, match=r"\['dat'\] is not an axis of the mesh.*\('data',\)"):
        jax.jit(f)({"w": jnp.zeros(3)})


def test_outside_shard_map_is_an_error():
    with pytest.raises(ValueError, match="inside `jax.shard_map`"):
        jaxsync.all_reduce_grads({"w": jnp.zeros(3)}, axis_name="data")


def test_batch_not_divisible(mesh8):
    with pytest.raises(ValueError, match=r"batch leaf \[0\] has shape \(12, 3\).*size 8"):
        jaxsync.shard_batch((jnp.zeros((12, 3)),), mesh8, axis_name="data")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        jaxsync.shard_batch(jnp.zeros((16, 3)), mesh8, axis_name="batch")


def test_integer_param_rejected(mesh8):
    @partial(jax.shard_map, mesh=mesh8, in_specs=P(), out_specs=P())
    def f(params):
        return jaxsync.all_reduce_grads(params, axis_name="data")

    with pytest.raises(TypeError, match=r"\['count'\] has dtype int32"):
        jax.jit(f)({"w": jnp.zeros(3), "count": jnp.zeros((), jnp.int32)})


def test_reduce_scatter_gives_each_rank_its_layout_ranges(mesh8):
    """Megatron's three ranges, as the layout states them, are what each rank receives."""
    params = mlp_params(jax.random.PRNGKey(0))
    layout = jaxsync.build_layout(
        params,
        num_shards=8,
        bucket_size=250,
        key_fn=lambda _, x: jaxsync.BufferKey(jnp.dtype(x.dtype).name, ("data",)),
    )
    assert layout.num_buckets > 1

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=P(), out_specs=P("data"))
    def scatter(params):
        local = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
        return jaxsync.bucket_reduce_scatter(local, layout, axis_name="data")[0]

    shards = np.asarray(scatter(params)).reshape(8, -1)
    leaves = [np.ravel(np.asarray(x)) for x in jax.tree.leaves(params)]
    covered = 0
    for r in range(8):
        for piece in layout.shard_ranges(r):
            lo, hi = piece.in_shard
            plo, phi = piece.in_param
            np.testing.assert_allclose(shards[r][lo:hi], leaves[piece.slot][plo:phi], rtol=1e-6)
            covered += hi - lo
    assert covered == sum(x.size for x in leaves)


def test_all_gather_lays_each_rank_shard_where_the_layout_says(mesh8):
    """bucket_all_gather of hand-cut shards (bucket by bucket, rank r owning the r-th
    slice of each): the full buffers the slots describe, padding zero; fp32, bf16
    and a stacked ``[layers, size]`` buffer (2, 1 and 3 buckets)."""
    params = scanned_params(jax.random.PRNGKey(0), layers=3)
    params["head"]["w"] = params["head"]["w"].astype(jnp.bfloat16)
    params["bias"] = 1.0 + jnp.arange(30, dtype=jnp.float32)
    layout = jaxsync.build_layout(params, num_shards=8, bucket_size=64, stacked="blocks")
    kinds = {(b.key.dtype, b.layers): len(b.buckets) for b in layout.buffers}
    assert kinds == {("float32", 0): 2, ("bfloat16", 0): 1, ("float32", 3): 3}, kinds
    leaves = jax.tree.leaves(params)

    fulls, shards = [], []
    for buf in layout.buffers:
        full = np.zeros((*buf.lead, buf.size), np.float32)
        for si in buf.slots:
            slot = layout.slots[si]
            x = np.asarray(leaves[slot.leaf_index], np.float32)
            full[..., slot.start : slot.end] = (
                x.reshape(buf.layers, -1) if buf.layers else x.ravel()
            )
        cut = [(b.start, b.size // 8) for b in buf.buckets]
        ranks = [np.concatenate([full[..., s + r * k : s + (r + 1) * k] for s, k in cut], -1)
                 for r in range(8)]  # fmt: skip
        fulls.append(full)
        shards.append(np.concatenate(ranks, -1))  # rank r's shard is the r-th eighth
    specs = tuple(P(None, "data") if buf.layers else P("data") for buf in layout.buffers)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(specs,), out_specs=(P(), P()))
    def gather(shards):
        return (
            jaxsync.bucket_all_gather(shards, layout, axis_name="data"),
            jaxsync.bucket_all_gather(shards, layout, axis_name="data", dtype=jnp.bfloat16),
        )

    placed = [
        jax.device_put(x, NamedSharding(mesh8, s)) for x, s in zip(shards, specs, strict=True)
    ]
    got, got_bf16 = gather(tuple(placed))
    for full, a, b in zip(fulls, got, got_bf16, strict=True):
        np.testing.assert_array_equal(np.asarray(a), full)
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b), full.astype(jnp.bfloat16))
    jax.tree.map(np.testing.assert_array_equal, layout.unflatten(got), params)


def test_value_and_grad_with_aux_gives_local_values(mesh8):
    """Outside deterministic mode, has_aux=True returns each device's own loss, its aux
    unchanged and jax.grad's gradients of its rows: nothing reduced."""
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, GLOBAL_BATCH)

    def with_aux(p, batch):
        loss = mlp_loss(p, batch)
        return loss, {"y_sum": jnp.sum(batch[1], axis=1), "twice": 2 * loss}

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P("data"))
    def local(params, batch):
        vg = jaxsync.value_and_grad(with_aux, axis_name="data", has_aux=True)
        return jax.tree.map(lambda x: x[None], vg(params, batch))

    out = local(params, jaxsync.shard_batch((xs[0], ys[0]), mesh8))
    (loss, aux), grads = jax.tree.map(np.asarray, out)
    ref = jax.jit(jax.value_and_grad(with_aux, has_aux=True))
    rows = GLOBAL_BATCH // 8
    for r in range(8):
        mine = (xs[0][r * rows : (r + 1) * rows], ys[0][r * rows : (r + 1) * rows])
        (want_loss, want_aux), want = ref(params, mine)
        np.testing.assert_allclose(loss[r], want_loss, rtol=1e-6)
        np.testing.assert_array_equal(aux["y_sum"][r], want_aux["y_sum"])
        np.testing.assert_allclose(aux["twice"][r], want_aux["twice"], rtol=1e-6)
        jax.tree.map(
            lambda g, w, r=r: np.testing.assert_allclose(g[r], w, rtol=1e-5, atol=1e-7),
            grads, want,
        )  # fmt: skip
    assert len(np.unique(loss)) == 8  # per device, not averaged

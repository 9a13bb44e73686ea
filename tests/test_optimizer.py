import math
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
    run_reference,
    run_sharded,
    sharded_step,
    state_bytes_on_device,
)
from jax.sharding import PartitionSpec as P

import jaxsync

STEPS = 4
BATCH = 32


def _decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda path, p: p.ndim > 1, params)


def _labels(params):
    return jax.tree.map(lambda m: "decay" if m else "no_decay", _decay_mask(params))


CASES = {
    "sgd": (lambda: optax.sgd(0.1), lambda: jaxsync.distributed_optimizer),
    "momentum": (lambda: optax.sgd(0.05, momentum=0.9, nesterov=True), None),
    "adam": (lambda: optax.adam(1e-2), None),
}


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("bucket_size", [None, 300])
def test_equals_single_device_optax(mesh8, name, bucket_size):
    make = CASES[name][0]
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, _ = run_reference(make(), params, batches)
    tx = jaxsync.distributed_optimizer(make(), axis_name="data", bucket_size=bucket_size)
    got, state = run_sharded(mesh8, tx, params, batches)
    assert (
        max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True)
        )
        > 1e-3
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, got)
    assert [m.dtype for m in state.master] == [jnp.float32]
    layout = tx.layout(params, mesh8)
    master = layout.unflatten(
        (layout.gather_shards(0, np.asarray(state.master[0]).reshape(8, -1)),)
    )
    # params land on the master values: exactly, except where a param changed sign
    # or by 2x in the last step (then `new - p` rounds): a few ulps there.
    jax.tree.map(lambda m, p: np.testing.assert_allclose(m, p, rtol=1e-6, atol=1e-9), master, got)
    exact = sum(
        int(np.sum(np.asarray(m) == np.asarray(p)))
        for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(got), strict=True)
    )
    assert exact >= 0.95 * sum(p.size for p in jax.tree.leaves(got))


def test_adamw_with_weight_decay_mask_via_labels(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, _ = run_reference(optax.adamw(1e-2, weight_decay=0.5, mask=_decay_mask), params, batches)
    tx = jaxsync.distributed_optimizer(
        {"decay": optax.adamw(1e-2, weight_decay=0.5), "no_decay": optax.adam(1e-2)},
        axis_name="data",
        labels=_labels,
        bucket_size=200,
    )
    got, _ = run_sharded(mesh8, tx, params, batches)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, got)
    layout = tx.layout(params, mesh8)
    assert sorted(b.key.label for b in layout.buffers) == ["decay", "no_decay"]
    # and without the labels the answer would differ (the test can fail):
    plain, _ = run_reference(optax.adamw(1e-2, weight_decay=0.5), params, batches)
    assert not np.allclose(plain["layer0"]["b"], got["layer0"]["b"], rtol=1e-4)


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_grad_norm_matches_optax_chain(mesh8, max_norm):
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, _ = run_reference(
        optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(1e-2)), params, batches
    )
    tx = jaxsync.distributed_optimizer(
        optax.adam(1e-2), axis_name="data", clip_grad_norm=max_norm, bucket_size=250
    )
    got, state = run_sharded(mesh8, tx, params, batches)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, got)
    # the reported norm is the single-device global norm of the last step's gradient
    prev, _ = run_reference(
        optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(1e-2)),
        params,
        jax.tree.map(lambda x: x[:-1], batches),
    )
    g = jax.grad(mlp_loss)(prev, (batches[0][-1], batches[1][-1]))
    np.testing.assert_allclose(state.metrics.grad_norm, optax.tree.norm(g), rtol=1e-5)


@pytest.mark.parametrize("name, tol", [("sgd", 2e-4), ("adam", 2.5e-2)])
def test_bf16_params_with_fp32_master(mesh8, name, tol):
    """bf16 params, fp32 master: the same master values as an fp32-master reference.

    The only difference to the reference is the bf16 rounding of each device's
    local gradient before the fp32 reduction, so SGD (linear in the gradient)
    matches tightly; Adam normalises tiny gradients to +-lr steps, so its bound
    is a fraction of lr * steps.
    """
    opt = optax.sgd(0.1) if name == "sgd" else optax.adam(1e-2)
    params = mlp_params(jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    batches = make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, ref_master = run_reference(opt, params, batches, master_dtype=jnp.float32)
    tx = jaxsync.distributed_optimizer(opt, axis_name="data", bucket_size=300)
    got, state = run_sharded(mesh8, tx, params, batches)
    layout = tx.layout(params, mesh8)
    (master,) = state.master
    assert master.dtype == jnp.float32
    full = layout.gather_shards(0, np.asarray(master).reshape(8, -1))
    master_tree = layout.unflatten((full,), jnp.float32)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=tol), ref_master, master_tree
    )
    for a, b, m in zip(
        jax.tree.leaves(ref), jax.tree.leaves(got), jax.tree.leaves(master_tree), strict=True
    ):
        assert b.dtype == jnp.bfloat16
        # params are exactly the bf16 rounding of our fp32 master
        np.testing.assert_array_equal(np.asarray(b), np.asarray(m.astype(jnp.bfloat16)))
        # and within one bf16 ulp of the reference (or of the master tolerance)
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=tol
        )


def test_memory_is_the_zero_figure(mesh8):
    # a few params of odd sizes, bf16, Adam: fp32 master + 2 fp32 moments per element
    key = jax.random.PRNGKey(0)
    params = {
        f"p{i}": jax.random.normal(key, (n,)).astype(jnp.bfloat16)
        for i, n in enumerate([10_000, 3_001, 777, 1])
    }
    n_params = sum(p.size for p in params.values())
    tx = jaxsync.distributed_optimizer(optax.adam(1e-3), axis_name="data", bucket_size=4096)
    state = tx.sharded_init(params, mesh8)
    layout = tx.layout(params, mesh8)
    shard = layout.shard_size(0)
    scalars = 4 + 4 + 4 + 4 + 4 + 1 + 4 + 4 + 4  # count, scale, 2 trackers, 5 metrics
    per_param = 2 * 4  # metrics: non-finite device count and first device, per param
    per_device = state_bytes_on_device(state, jax.devices()[0])
    assert per_device == 12 * shard + scalars + per_param * len(params)
    # shard = ceil(P / N) + this rank's share of the padding
    buf = layout.buffers[0]
    padding = buf.size - buf.used
    assert shard == (n_params + padding) // 8 and shard >= math.ceil(n_params / 8)
    bound = sum(128 + 63 * len(b.slots) for b in buf.buckets)  # bucket + param alignment
    assert padding <= bound
    # against replicated optax adam (mu and nu in the param dtype, on every device)
    replicated = jax.device_put(
        optax.adam(1e-3).init(params), jax.sharding.NamedSharding(mesh8, P())
    )
    rep_bytes = state_bytes_on_device(replicated, jax.devices()[0])
    assert rep_bytes == 2 * 2 * n_params + 4


def test_init_on_shape_dtype_structs_and_stable_state(mesh8):
    params = mlp_params(jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    structs = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    tx = jaxsync.distributed_optimizer(optax.adam(1e-2), axis_name="data", bucket_size=300)
    abstract = jax.eval_shape(lambda p: tx.sharded_init(p, mesh8), structs)
    specs = tx.state_specs(structs, mesh8)
    state0 = tx.sharded_init(params, mesh8)
    assert jax.tree.structure(abstract) == jax.tree.structure(state0)
    jax.tree.map(
        lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype) or pytest.fail(), abstract, state0
    )

    assert jax.tree.map(lambda s: s, specs) == tx.state_specs(params, mesh8)
    step = sharded_step(mesh8, tx, params, donate=True)
    xs, ys = make_batches(jax.random.PRNGKey(1), 3, BATCH)
    shardings0 = jax.tree.map(lambda x: x.sharding, state0)
    types0 = jax.tree.map(lambda x: (x.shape, x.dtype), state0)
    state = state0
    for i in range(3):
        params, state = step(params, state, jaxsync.shard_batch((xs[i], ys[i]), mesh8))
    assert type(state) is jaxsync.DistributedOptimizerState
    assert jax.tree.map(lambda x: x.sharding, state) == shardings0
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == types0
    assert state.inner_state[0][0].count == 3


def test_compiled_step_collectives_per_bucket(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    tx = jaxsync.distributed_optimizer(optax.adam(1e-2), axis_name="data", bucket_size=300)
    layout = tx.layout(params, mesh8)
    state = tx.sharded_init(params, mesh8)
    step = sharded_step(mesh8, tx, params)
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, BATCH)
    lowered = step.lower(params, state, jaxsync.shard_batch((xs[0], ys[0]), mesh8))
    k = layout.num_buckets
    assert k == 3
    # k reduce-scatters, k all-gathers, one all-reduce for (norm, zero count), and two
    # inside the conditional that only runs on the first of a run of skipped steps
    # (which params and devices had non-finite local grads); nothing else
    expect = {
        "all-reduce": 3,
        "reduce-scatter": k,
        "all-gather": k,
        "collective-permute": 0,
        "all-to-all": 0,
    }
    assert count_lowered_collectives(lowered.as_text()) == expect
    compiled_text = lowered.compile().as_text()
    assert count_collectives(compiled_text) == expect
    # bytes: each rank receives its fp32 slice of every bucket, then gathers the
    # fp32 updates of the whole buffer; the norm all-reduce moves two floats, the
    # conditional ones one int32 per param each.
    stats = jaxsync.collective_stats(compiled_text)
    size = layout.buffers[0].size
    assert stats["reduce-scatter"].bytes == size // 8 * 4
    assert stats["all-gather"].bytes == size * 4
    assert stats["all-reduce"].bytes == 8 + 2 * 4 * len(jax.tree.leaves(params))


def test_fp16_loss_scale_skips_nonfinite_step_and_backs_off(mesh8):
    params = mlp_params(jax.random.PRNGKey(0), dtype=jnp.float16)
    scaler = jaxsync.DynamicLossScale(initial_scale=2.0**10, growth_interval=2, hysteresis=1)
    tx = jaxsync.distributed_optimizer(optax.adam(1e-2), axis_name="data", loss_scale=scaler)
    xs, ys = make_batches(jax.random.PRNGKey(1), 4, BATCH)
    # step 0: clean, step 1: Inf in one rank's data, steps 2-3: clean
    xs = xs.at[1, 5, 0].set(jnp.inf)
    step = sharded_step(mesh8, tx, params, scale_loss=True)  # loss x state.loss_scale.scale
    state = tx.sharded_init(params, mesh8)
    history = []
    for i in range(4):
        before = (params, state)
        params, state = step(params, state, jaxsync.shard_batch((xs[i], ys[i]), mesh8))
        history.append((before, (params, state)))
    (p1, s1), (p2, s2) = history[1]
    assert bool(s2.metrics.skipped) and int(s2.metrics.skipped_steps) == 1
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    jax.tree.map(np.testing.assert_array_equal, s1.master, s2.master)
    jax.tree.map(np.testing.assert_array_equal, s1.inner_state, s2.inner_state)
    assert float(s2.loss_scale.scale) == 2.0**9
    # step 0 was clean: one growth step counted; after step 1 the tracker restarts
    assert int(history[0][1][1].loss_scale.growth_tracker) == 1
    assert int(s2.loss_scale.growth_tracker) == 0
    # two clean steps later the scale has grown back
    assert not bool(state.metrics.skipped)
    assert float(state.loss_scale.scale) == 2.0**10
    assert np.all(np.isfinite(np.asarray(params["layer0"]["w"], np.float32)))
    # the master moved on clean steps
    assert not np.array_equal(history[0][0][1].master[0], history[0][1][1].master[0])


def test_dynamic_loss_scale_hysteresis_and_min():
    from jaxsync._src.optim.loss_scale import init_loss_scale, update_loss_scale

    cfg = jaxsync.DynamicLossScale(
        initial_scale=8.0, hysteresis=2, min_scale=2.0, growth_interval=3
    )
    s = init_loss_scale(cfg)
    bad, good = jnp.asarray(False), jnp.asarray(True)
    s = update_loss_scale(cfg, s, bad)
    assert float(s.scale) == 8.0  # first overflow tolerated
    s = update_loss_scale(cfg, s, bad)
    assert float(s.scale) == 4.0
    s = update_loss_scale(cfg, s, bad)
    assert float(s.scale) == 2.0
    s = update_loss_scale(cfg, s, bad)
    assert float(s.scale) == 2.0  # min_scale
    for _ in range(3):
        s = update_loss_scale(cfg, s, good)
    assert float(s.scale) == 4.0 and int(s.hysteresis_tracker) == 2


def test_sync_grads_chain_equals_single_device(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    opt = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    ref, _ = run_reference(opt, params, batches)
    tx = optax.chain(jaxsync.sync_grads(axis_name="data", bucket_size=200), opt)
    state = tx.init(params)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
    def step(params, state, batch):
        _, grads = jaxsync.value_and_grad(mlp_loss, axis_name="data")(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(STEPS):
        params, state = step(
            params, state, jaxsync.shard_batch((batches[0][i], batches[1][i]), mesh8)
        )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, params)


@pytest.mark.parametrize(
    "inner, match",
    [
        (optax.lamb(1e-3), "not elementwise"),
        (optax.lars(1e-3), "not elementwise"),
        (optax.adafactor(1e-3), "not elementwise"),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "not elementwise"),
        (optax.adamw(1e-3, weight_decay=0.1, mask=_decay_mask), "not elementwise"),
    ],
)
def test_non_elementwise_inner_rejected(mesh8, inner, match):
    params = mlp_params(jax.random.PRNGKey(0))
    tx = jaxsync.distributed_optimizer(inner, axis_name="data")
    with pytest.raises(ValueError, match=match):
        tx.sharded_init(params, mesh8)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.lion(1e-3, weight_decay=1e-2),
        lambda: optax.rmsprop(1e-2),
        lambda: optax.adagrad(1e-1),
        lambda: optax.nadam(1e-2),
    ],
    ids=["lion", "rmsprop", "adagrad", "nadam"],  # adamw, momentum: trained above
)
def test_elementwise_inner_accepted_and_equal_to_single_device(mesh8, make):
    """Accepted by the elementwise probe, and trained on flat shards as optax trains
    the whole tree on one device (2 steps)."""
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), 2, BATCH)
    ref, _ = run_reference(make(), params, batches)
    tx = jaxsync.distributed_optimizer(make(), axis_name="data")
    got, _ = run_sharded(mesh8, tx, params, batches)
    moved = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, ref)


def test_bad_arguments(mesh8):
    with pytest.raises(ValueError, match="`labels` is required"):
        jaxsync.distributed_optimizer({"a": optax.sgd(1.0)}, axis_name="data")
    with pytest.raises(ValueError, match="clip_grad_norm"):
        jaxsync.distributed_optimizer(optax.sgd(1.0), axis_name="data", clip_grad_norm=0.0)
    with pytest.raises(ValueError, match="bucket_size"):
        jaxsync.distributed_optimizer(optax.sgd(1.0), axis_name="data", bucket_size=0)
    with pytest.raises(ValueError, match="loss_scale"):
        jaxsync.distributed_optimizer(optax.sgd(1.0), axis_name="data", loss_scale=-1.0)
    tx = jaxsync.distributed_optimizer(optax.sgd(1.0), axis_name="batch")
    with pytest.raises(ValueError, match=r"\['batch'\] is not an axis of the mesh"):
        tx.sharded_init({"w": jnp.zeros(3)}, mesh8)
    tx = jaxsync.distributed_optimizer({"a": optax.sgd(1.0)}, axis_name="data", labels={"w": "b"})
    with pytest.raises(ValueError, match=r"uses \['b'\]"):
        tx.sharded_init({"w": jnp.zeros(3)}, mesh8)


def test_constant_loss_scale_is_undone_exactly(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), 3, BATCH)
    plain = jaxsync.distributed_optimizer(optax.adam(1e-2), axis_name="data")
    scaled = jaxsync.distributed_optimizer(optax.adam(1e-2), axis_name="data", loss_scale=1024.0)
    a, _ = run_sharded(mesh8, plain, params, batches)
    b, state = run_sharded(mesh8, scaled, params, batches, scale_loss=True)
    assert float(state.loss_scale.scale) == 1024.0  # constant: never changes
    # a power-of-two scale is exact; what is left is XLA fusing the scaled program
    # differently (last-bit differences)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8), a, b)
    moved = max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-3


def test_num_zeros_counts_real_zeros_not_padding(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    params["unused"] = jnp.ones((37,))  # not in the loss: its gradient is exactly zero
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", bucket_size=200)
    layout = tx.layout(params, mesh8)
    assert sum(b.size - b.used for b in layout.buffers) > 0  # there is padding to ignore
    _, state = run_sharded(mesh8, tx, params, make_batches(jax.random.PRNGKey(1), 1, BATCH))
    assert int(state.metrics.num_zeros) == 37

"""Scanned (stacked) layers: layout, in-loop sync, equivalence, placement, memory."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from tests.helpers import (
    run_reference,
    scanned_batches,
    scanned_block,
    scanned_loss,
    scanned_params,
    state_bytes_on_device,
)

STEPS, BATCH, LAYERS = 3, 32, 4
CLIP = 0.5


def _inner():
    return optax.adamw(1e-2, weight_decay=0.1)


def _reference(params, batches, master_dtype=None):
    opt = optax.chain(optax.clip_by_global_norm(CLIP), _inner())
    return run_reference(opt, params, batches, loss_fn=scanned_loss, master_dtype=master_dtype)


def _train(mesh, mode, params, batches, microbatches=1, bucket_size=300, donate=False):
    """``mode``: "zero" (in-loop reduce-scatter), "ddp" (in-loop all-reduce),
    "zero-after" (the stacked optimizer fed local grads, synced after the loop)."""
    if mode.startswith("zero"):
        tx = jaxsync.distributed_optimizer(
            _inner(), axis_name="data", stacked="blocks", clip_grad_norm=CLIP,
            bucket_size=bucket_size,
        )  # fmt: skip
        sync = None if mode == "zero-after" else tx
        state = tx.sharded_init(params, mesh)
        specs = tx.state_specs(params, mesh)
    else:
        sync = jaxsync.DataParallel("data", stacked="blocks", bucket_size=bucket_size)
        tx = optax.chain(optax.clip_by_global_norm(CLIP), _inner())
        state = tx.init(params)
        specs = jax.tree.map(lambda _: P(), state)

    @partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
             out_specs=(P(), specs, P()))  # fmt: skip
    def step(p, s, batch):
        if microbatches > 1:
            mbs = jax.tree.map(lambda a: a.reshape(microbatches, -1, *a.shape[1:]), batch)
            loss, g = jaxsync.accumulate_grads(scanned_loss, p, mbs, axis_name="data", sync=sync)
        else:
            vg = jaxsync.value_and_grad(scanned_loss, axis_name="data", sync=sync)
            loss, g = vg(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, jax.lax.pmean(loss, "data")

    xs, ys = batches
    losses = []
    for i in range(xs.shape[0]):
        batch = jax.device_put((xs[i], ys[i]), NamedSharding(mesh, P("data")))
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state, tx, step, losses


# ------------------------------------------------------------------ layout
def test_stacked_layout_is_per_layer():
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    layout = jaxsync.build_layout(params, num_shards=8, bucket_size=300, stacked="blocks")
    stacks = layout.stacks()
    assert set(stacks) == {"blocks"}
    for bi, buf in enumerate(layout.buffers):
        assert buf.layers == (LAYERS if bi in stacks["blocks"] else 0)
    (sb,) = stacks["blocks"]
    buf = layout.buffers[sb]
    # one layer's row in reverse tree order (keys sort b1, g, w1, w2): w2 (384) closes
    # bucket 0; w1 (384) bucket 1; g (16) at 768, b1 (24) aligned to 832, bucket 2
    # padded to a multiple of 128.
    starts = {layout.slots[i].path: layout.slots[i].start for i in buf.slots}
    assert starts == {"['blocks']['w2']": 0, "['blocks']['w1']": 384,
                      "['blocks']['g']": 768, "['blocks']['b1']": 832}  # fmt: skip
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 384), (384, 768), (768, 896)]
    flat = layout.flatten(params)
    assert flat[sb].shape == (LAYERS, 896)
    back = layout.unflatten(flat)
    jax.tree.map(np.testing.assert_array_equal, params, back)
    # rank r owns the same range of every layer: shard_of on [L, size] slices columns
    shard = layout.shard_of(sb, flat[sb], 3)
    assert shard.shape == (LAYERS, 112)
    np.testing.assert_array_equal(shard[:, :48], flat[sb][:, 3 * 48 : 4 * 48])


def test_stacked_layout_errors():
    params = scanned_params(jax.random.PRNGKey(0))
    params["blocks"]["bad"] = jnp.zeros((LAYERS + 1, 3))
    with pytest.raises(ValueError, match=r"mixes layer counts.*blocks\.bad"):
        jaxsync.build_layout(params, stacked="blocks")
    with pytest.raises(ValueError, match=r"`stacked` names \['blokcs'\], which match no params"):
        jaxsync.build_layout(scanned_params(jax.random.PRNGKey(0)), stacked="blokcs")


def _array_bytes(shape: str) -> int:
    """Bytes of an f32 array named like ``f32[4,112]``; scalars (norms, loss) count 0."""
    assert shape.startswith("f32["), shape
    dims = [int(d) for d in shape[4:-1].split(",") if d]
    return 4 * int(np.prod(dims)) if dims else 0


# ------------------------------------------------------------- equivalence
@pytest.mark.parametrize("mode", ["zero", "ddp", "zero-after"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_scanned_equals_single_device(mesh8, mode, microbatches):
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, _ = _reference(params, batches)
    got, state, *_ = _train(mesh8, mode, params, batches, microbatches)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, got)
    if mode != "ddp":
        # the stacked state is [L, shard]: rank r owns the same columns of every layer
        shapes = {s.data.shape for m in state.master for s in m.addressable_shards}
        assert (LAYERS, 896 // 8) in shapes


def test_scanned_bf16_params_fp32_master(mesh8):
    params = scanned_params(jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    batches = scanned_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, ref_master = _reference(params, batches, master_dtype=jnp.float32)
    got, state, tx, *_ = _train(mesh8, "zero", params, batches)
    master = tx.to_portable(state, params, mesh8)["master"]
    names = [jaxsync.param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for name, r, m, g in zip(names, jax.tree.leaves(ref_master), [master[n] for n in names],
                             jax.tree.leaves(got), strict=True):  # fmt: skip
        assert m.dtype == jnp.float32 and g.dtype == jnp.bfloat16, name
        # Adam turns the bf16 rounding of local grads into at most a fraction of lr per step
        np.testing.assert_allclose(r, m, rtol=0, atol=2.5e-2, err_msg=name)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(m.astype(jnp.bfloat16)))
    ref_leaves = [np.asarray(a, np.float32) for a in jax.tree.leaves(ref)]
    got_leaves = [np.asarray(b, np.float32) for b in jax.tree.leaves(got)]
    for a, b in zip(ref_leaves, got_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=2**-7, atol=2.5e-2)


# --------------------------------------------------------------- placement
@pytest.mark.parametrize("mode, kind", [("zero", "reduce-scatter"), ("ddp", "all-reduce")])
def test_gradient_collectives_sit_in_the_backward_loop(mesh8, mode, kind):
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    p, state, tx, step, _ = _train(mesh8, mode, params, batches)
    batch = jax.device_put((batches[0][0], batches[1][0]), NamedSharding(mesh8, P("data")))
    report = jaxsync.overlap_report(step.lower(p, state, batch).compile())
    layout = jaxsync.build_layout(
        params, num_shards=8 if mode == "zero" else 1, bucket_size=300, stacked="blocks"
    )
    (sb,) = layout.stacks()["blocks"]
    n_buckets = len(layout.buffers[sb].buckets)
    in_loop = report.in_loop(kind=kind, role="backward")
    # one array per layer bucket (XLA:CPU's combiner may merge them into one tuple
    # collective), each run once per layer
    assert sum(len(c.shapes) for c in in_loop) == n_buckets, report
    assert all(c.trip_count == LAYERS for c in in_loop)
    row_bytes = sum(b.size for b in layout.buffers[sb].buckets) * 4
    assert sum(c.bytes for c in in_loop) == (row_bytes // 8 if mode == "zero" else row_bytes)
    # after the loop, only the unstacked params' gradients are reduced: no collective
    # touches the stacked gradients there
    entry = report.in_entry(kind=kind)
    free_bytes = sum(b.size for i, b in enumerate(layout.buffers) if i != sb) * 4
    grad_bytes = sum(_array_bytes(s) for c in entry for s in c.shapes)
    assert grad_bytes == (free_bytes // 8 if mode == "zero" else free_bytes), report
    assert not report.in_loop(kind=kind, role="forward")
    if mode == "zero":  # the new stacked params are gathered layer by layer, in a loop
        gathers = [c for c in report.in_loop(kind="all-gather") if c.trip_count == LAYERS]
        assert sum(c.bytes for c in gathers) == row_bytes, report  # one layer (fp32 params)
    else:
        assert not report.in_loop(role="forward")


def test_plain_value_and_grad_syncs_after_the_loop(mesh8):
    """The baseline the tap fixes: local grads of the stack, reduced after the loop."""
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    p, state, tx, step, _ = _train(mesh8, "zero-after", params, batches)
    batch = jax.device_put((batches[0][0], batches[1][0]), NamedSharding(mesh8, P("data")))
    report = jaxsync.overlap_report(step.lower(p, state, batch).compile())
    assert not report.in_loop(kind="reduce-scatter")
    assert report.in_entry(kind="reduce-scatter")


# -------------------------------------------------------------------- FSDP
def _train_fsdp(mesh, params, batches, microbatches=1, reshard=True, replicate=None):
    inner = _inner()
    axis = "data" if replicate is None else "shard"
    fs = jaxsync.fully_shard(
        params, axis_name=axis, units=["inp", "head"], mesh=mesh, stacked="blocks",
        reshard_after_forward=reshard, replicate_axis=replicate,
    )  # fmt: skip
    rows = P(tuple(mesh.axis_names))
    shards = fs.shard(params, mesh)
    state, state_specs = fs.init_optimizer(inner, shards, mesh)
    specs = fs.specs()

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(specs, state_specs, rows),
             out_specs=(specs, state_specs))  # fmt: skip
    def step(shards, state, batch):
        loss_fn = lambda s, b: scanned_loss(fs.view(s), b)  # noqa: E731
        _, g = fs.value_and_grad(loss_fn, shards, batch, microbatches=microbatches)
        updates, state = inner.update(g, state, shards)
        return optax.apply_updates(shards, updates), state

    xs, ys = batches
    for i in range(xs.shape[0]):
        batch = jax.device_put((xs[i], ys[i]), NamedSharding(mesh, rows))
        shards, state = step(shards, state, batch)
    return fs, shards, state, step, batch


def test_fsdp_scanned_hybrid_equals_single_device():
    """Stacked layers under hybrid sharding: sharded over 4, replicated over 2; each
    layer gathered param by param inside each replica group, its gradient reduced
    there and all-reduced across the replicas."""
    mesh = jax.make_mesh((2, 4), ("replica", "shard"))
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, _ = run_reference(_inner(), params, batches, loss_fn=scanned_loss)
    fs, shards, *_ = _train_fsdp(mesh, params, batches, replicate="replica")
    got = fs.unshard(shards, mesh)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, got)


@pytest.mark.parametrize("reshard, microbatches", [(True, 1), (False, 1), (True, 2)])
def test_fsdp_scanned_equals_single_device(mesh8, reshard, microbatches):
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, _ = run_reference(_inner(), params, batches, loss_fn=scanned_loss)
    fs, shards, *_ = _train_fsdp(mesh8, params, batches, microbatches, reshard)
    # the stack is one unit, [L, shard] per device; each param in a buffer of its own,
    # padded to 128: w1 384, b1 24 -> 128, w2 384, b2 16 -> 128, 1024 / 8 ranks
    assert {s.data.shape for s in shards["blocks"].addressable_shards} == {(LAYERS, 128)}
    got = fs.unshard(shards, mesh8)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, got)


def test_fsdp_scanned_gathers_in_forward_and_scatters_in_backward_loop(mesh8):
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    fs, shards, state, step, batch = _train_fsdp(mesh8, params, batches)
    report = jaxsync.overlap_report(step.lower(shards, state, batch).compile())
    # one all-gather per param of the layer, straight into its own array
    rows = sorted(f"f32[{b.size}]" for b in fs.layout("blocks").buffers)
    assert rows == ["f32[128]", "f32[128]", "f32[384]", "f32[384]"]
    fwd = report.in_loop(kind="all-gather", role="forward")
    assert sorted(c.shapes[0] for c in fwd) == rows and {c.trip_count for c in fwd} == {LAYERS}
    # the rematted layer body gathers again in the backward (reshard after forward)
    regather = report.in_loop(kind="all-gather", role="backward")
    assert sorted(c.shapes[0] for c in regather) == rows
    # and the layer's gradient goes back in two reduce-scatters (in one host, a half
    # each: fsdp/gather.halves), together every rank's shard
    rs = report.in_loop(kind="reduce-scatter", role="backward")
    assert len(rs) == 2 and {c.trip_count for c in rs} == {LAYERS}
    assert sum(int(c.shapes[0][len("f32[") : -1]) for c in rs) == 128
    # only the unstacked units are gathered and reduced outside the loops
    assert all(c.bytes <= 512 for c in report.in_entry())


# ------------------------------------------------------------------ memory
def test_stacked_state_is_the_zero_figure(mesh8):
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS, dtype=jnp.bfloat16)
    tx = jaxsync.distributed_optimizer(optax.adam(1e-3), axis_name="data", stacked="blocks")
    state = tx.sharded_init(params, mesh8)
    layout = tx.layout(params, mesh8)
    elems = sum(max(b.layers, 1) * layout.shard_size(i) for i, b in enumerate(layout.buffers))
    dev = jax.devices()[0]
    per_device = state_bytes_on_device(state, dev)
    n_counts = len(layout.buffers)  # Adam's count, one per buffer
    scalars = 4 * n_counts + 4 + 4 + 4 + 4 + 1 + 4 + 4 + 4  # + scale, metrics
    per_param = 2 * 4 * len(layout.slots)  # non-finite device count and first device
    assert per_device == 12 * elems + scalars + per_param
    n_params = sum(p.size for p in jax.tree.leaves(params))
    padding = sum(max(b.layers, 1) * (b.size - b.used) for b in layout.buffers)
    assert 8 * elems == n_params + padding


# ---------------------------------------------------------- checkpoint form
def test_stacked_state_portable_across_dp_sizes(mesh8):
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    _, state, tx, *_ = _train(mesh8, "zero", params, batches)
    portable = tx.to_portable(state, params, mesh8)
    assert portable["master"]["blocks.w1"].shape == (LAYERS, 16, 24)
    mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx2 = jaxsync.distributed_optimizer(
        _inner(), axis_name="data", stacked="blocks", clip_grad_norm=CLIP, bucket_size=300
    )
    params2 = jax.device_put(params, NamedSharding(mesh2, P()))
    state2 = tx2.from_portable(portable, params2, mesh2)
    assert (LAYERS, 896 // 2) in {s.data.shape for m in state2.master for s in m.addressable_shards}
    again = tx2.to_portable(state2, params2, mesh2)
    jax.tree.map(np.testing.assert_array_equal, portable, again)


# ------------------------------------------------------------------ misuse
def test_forgotten_tap_is_a_clear_error(mesh8):
    def no_tap(params, batch):
        x, _ = batch

        def body(h, p):
            return h @ p["w1"][:, :16], None

        h, _ = jax.lax.scan(body, x @ params["inp"]["w"], params["blocks"])
        return jnp.mean(h)

    params = scanned_params(jax.random.PRNGKey(0))
    sync = jaxsync.DataParallel("data", stacked="blocks")
    f = jax.shard_map(
        jaxsync.value_and_grad(no_tap, axis_name="data", sync=sync),
        mesh=mesh8, in_specs=(P(), P("data")), out_specs=(P(), P()),
    )  # fmt: skip
    batch = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    batch = jax.device_put((batch[0][0], batch[1][0]), NamedSharding(mesh8, P("data")))
    with pytest.raises(TypeError, match=r"jaxsync\.tap\(p\)"):
        jax.jit(f)(params, batch)


def test_nonfinite_local_grads_are_named_under_in_loop_sync(mesh8):
    """A NaN in rank 3's data: the step is skipped, and the report names the stacked
    params and the device, read from the taps' flags before the in-loop reduction."""
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    xs, ys = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    xs = xs.at[0, 3 * (BATCH // 8)].set(jnp.nan)  # a row of rank 3's shard
    got, state, tx, *_ = _train(mesh8, "zero", params, (xs, ys))
    assert bool(state.metrics.skipped) and int(state.metrics.consecutive_skips) == 1
    jax.tree.map(np.testing.assert_array_equal, params, got)  # the step changed nothing
    report = jaxsync.nonfinite_report(state, params, mesh8)
    assert "blocks.w1" in report and "inp.w" in report and "device 3" in report, report


def _shard_mapped(mesh, fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))


def test_sync_must_be_a_jaxsync_sync(mesh8):
    params = scanned_params(jax.random.PRNGKey(0))
    xs, ys = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    batch = jax.device_put((xs[0], ys[0]), NamedSharding(mesh8, P("data")))
    vg = jaxsync.value_and_grad(scanned_loss, axis_name="data", sync=optax.adam(1e-3))
    with pytest.raises(TypeError, match=r"`sync` must be a jaxsync\.DataParallel"):
        _shard_mapped(mesh8, vg)(params, batch)


def test_tap_on_the_whole_stack_is_an_error(mesh8):
    def whole(params, batch):
        p = jaxsync.tap(params["blocks"])  # not a layer's slice
        return jnp.sum(p["w1"]) * jnp.mean(batch[0])

    params = scanned_params(jax.random.PRNGKey(0))
    xs, ys = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    batch = jax.device_put((xs[0], ys[0]), NamedSharding(mesh8, P("data")))
    sync = jaxsync.DataParallel("data", stacked="blocks")
    vg = jaxsync.value_and_grad(whole, axis_name="data", sync=sync)
    with pytest.raises(
        ValueError, match=r"with shape \(4, 24\); one layer's slice has shape \(24,\)"
    ):
        _shard_mapped(mesh8, vg)(params, batch)


def test_labels_and_loss_scale_on_stacked_buffers(mesh8):
    """Per-label buffers inside the stack (decay on matrices only) and a constant loss
    scale (multiplied into the loss, undone after the in-loop reduction)."""
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    batches = scanned_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    labels = {"inp": {"w": "decay"}, "head": {"w": "decay"},
              "blocks": {"w1": "decay", "w2": "decay", "b1": "plain", "g": "plain"}}  # fmt: skip
    inner = {"decay": optax.adamw(1e-2, weight_decay=0.1), "plain": optax.adam(1e-2)}
    ref, _ = run_reference(optax.multi_transform(inner, labels), params, batches,
                           loss_fn=scanned_loss)  # fmt: skip
    tx = jaxsync.distributed_optimizer(
        inner, axis_name="data", labels=labels, stacked="blocks", loss_scale=1024.0
    )
    assert {b.key.label for b in tx.layout(params, mesh8).buffers if b.layers} == {"decay", "plain"}
    state, specs = tx.sharded_init(params, mesh8), tx.state_specs(params, mesh8)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), specs, P("data")),
             out_specs=(P(), specs))  # fmt: skip
    def step(p, s, batch):
        scaled = lambda q, b: scanned_loss(q, b) * s.loss_scale.scale  # noqa: E731
        _, g = jaxsync.value_and_grad(scaled, axis_name="data", sync=tx)(p, batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    got = params
    for i in range(STEPS):
        batch = jax.device_put((batches[0][i], batches[1][i]), NamedSharding(mesh8, P("data")))
        got, state = step(got, state, batch)
    # (ignoring the labels would decay b1 and g by ~3e-3: far outside this tolerance)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, got)


@pytest.mark.parametrize("devices", [1, 2])
def test_one_nonfinite_leaf_is_named_on_one_device_too(devices):
    """A NaN in one stacked leaf's gradient (b1) and nowhere else: the step is skipped
    and only that leaf is flagged, on one device (the flags read off the sinks after
    the loop, where the sinks hold the local gradient) as on two (flagged in the loop)."""

    def loss(params, batch):
        x, y = batch
        h = x @ params["inp"]["w"]

        def body(carry, p):
            h, bad = carry
            p = jaxsync.tap(p)
            # sqrt(-1) * 0: a NaN term whose gradient reaches b1 alone
            bad = bad + jnp.sum(jnp.sqrt(p["b1"] * 0.0 - 1.0)) * 0.0
            return (scanned_block(p, h), bad), None

        bad0 = jnp.sum(h) * 0.0  # (varying over the data axes, as the carry is)
        (h, bad), _ = jax.lax.scan(jax.checkpoint(body), (h, bad0), params["blocks"])
        return jnp.mean((h @ params["head"]["w"] - y) ** 2) + bad

    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    params = scanned_params(jax.random.PRNGKey(0), layers=LAYERS)
    xs, ys = scanned_batches(jax.random.PRNGKey(1), 1, BATCH)
    step = jaxsync.train_step(loss, optax.adam(1e-2), mesh, "zero", stacked="blocks")
    state, _ = step(step.init(params), (xs[0], ys[0]))
    m = state.opt_state.metrics
    assert bool(m.skipped)
    names = [jaxsync.param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    flagged = [n for n, c in zip(names, np.asarray(m.nonfinite_devices), strict=True) if c]
    assert flagged == ["blocks.b1"], flagged
    jax.tree.map(np.testing.assert_array_equal, step.params(state), params)

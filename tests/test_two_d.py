"""Tensor parallelism by specs: a GPT on (data=4, model=2), model code as on one device.

The params carry ``NamedSharding``s over ``"model"`` (tests/tp_gpt.py); the step is
manual over ``"data"`` only and GSPMD partitions the model. Each mode must match
single-device optax, keep the tensor-parallel per-device shapes, shard its
optimizer state 1/4 over the data axis on top of them, and reduce inside the
backward loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import local_shapes, place_by_specs, run_reference
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tp_gpt import gpt_batches, gpt_loss, gpt_params, tp_specs

import jaxsync

#: Per-device shapes of the params under tp_specs (the "model" dims halved).
TP_SHAPES = {
    "embed": (32, 16), "head": (16, 16), "ln_f": (16,),
    "blocks.ln1": (2, 16), "blocks.ln2": (2, 16), "blocks.qkv": (2, 16, 24),
    "blocks.out": (2, 8, 16), "blocks.up": (2, 16, 16), "blocks.up_b": (2, 16),
    "blocks.down": (2, 16, 16),
}  # fmt: skip
#: ...and of their ZeRO/FSDP shards: the first free dim (not the layer axis, not a
#: "model" dim) cut in 4; up_b has none (layer axis + "model"), so it stays whole.
#: Params "model" replicates (embed, the norms) are cut over "model" too: 1/8.
SHARD_SHAPES = {
    "embed": (4, 16), "head": (4, 16), "ln_f": (2,),
    "blocks.ln1": (2, 2), "blocks.ln2": (2, 2), "blocks.qkv": (2, 4, 24),
    "blocks.out": (2, 8, 4), "blocks.up": (2, 4, 16), "blocks.up_b": (2, 16),
    "blocks.down": (2, 16, 4),
}  # fmt: skip


def mesh_2d():
    require_devices(8)
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def placed(mesh, params):
    return place_by_specs(mesh, params, tp_specs())


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_gpt_on_data_and_model_axes(mode):
    mesh = mesh_2d()
    params = gpt_params(jax.random.key(0))
    batches = gpt_batches(jax.random.key(1), 2, 8)
    tx, labels = optax.adamw(1e-2, weight_decay=0.1), None
    if mode == "fsdp":  # parameter groups: weight decay on matrices only
        tx = {"decay": tx, "flat": optax.adamw(1e-2, weight_decay=0.0)}
        labels = jax.tree_util.tree_map_with_path(
            lambda path, x: "decay" if x.ndim - ("blocks" in str(path)) == 2 else "flat", params
        )
    # Gradient accumulation too (equal halves of each data rank's rows: the same step).
    step = jaxsync.train_step(
        gpt_loss, tx, mesh, mode=mode, stacked="blocks", clip_grad_norm=0.5, labels=labels,
        microbatches=1 if mode == "zero" else 2,
    )  # fmt: skip
    state = step.init(placed(mesh, params))
    # The abstract state (for compile-only GPU meshes) reads the same shardings.
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        placed(mesh, params),
    )
    abstract = step.abstract_state(shapes)
    assert jax.tree.map(lambda x: x.sharding.spec, abstract) == jax.tree.map(
        lambda x: x.sharding.spec, state
    )
    batch0 = (batches[0][0], batches[1][0])
    compiled = step.lower(state, batch0).compile()
    for i in range(2):
        state, loss = step(state, (batches[0][i], batches[1][i]))
        assert np.isfinite(loss)

    # Single-device optax, with optax's clipping: same params to float rounding.
    ref = tx if labels is None else optax.multi_transform(tx, labels)
    want, _ = run_reference(
        optax.chain(optax.clip_by_global_norm(0.5), ref), params, batches, loss_fn=gpt_loss
    )
    got = step.params(state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, want)
    assert int(state.step) == 2 and float(state.guard.metrics.grad_norm) > 0.5  # clipped

    # The compiler keeps the tensor-parallel layout: per-device shapes halved over "model".
    assert local_shapes(got) == TP_SHAPES
    assert jax.tree.map(lambda x: x.sharding.spec, got)["blocks"]["qkv"] == P(None, None, "model")
    held = local_shapes(state.params)
    assert held == (SHARD_SHAPES if mode == "fsdp" else TP_SHAPES)
    # The optimizer state: 1/4 over "data" on top of the TP split (DDP: the TP split).
    inner = state.opt_state.inner if mode == "zero" else state.opt_state
    mu = (
        inner[0].mu
        if mode != "fsdp"
        else jax.tree.map(  # the decay group's moments
            lambda d, f: d if not isinstance(d, optax.MaskedNode) else f,
            inner.inner_states["decay"].inner_state[0].mu,
            inner.inner_states["flat"].inner_state[0].mu,
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )
    )
    assert local_shapes(mu) == (TP_SHAPES if mode == "ddp" else SHARD_SHAPES)
    if mode == "zero":
        assert local_shapes(state.opt_state.master) == SHARD_SHAPES

    # The data reductions sit in the backward loop (FSDP's gathers in the forward one).
    report = jaxsync.overlap_report(compiled)
    kind = "all-reduce" if mode == "ddp" else "reduce-scatter"
    assert report.in_loop(kind, role="backward"), report.summary()
    if mode == "fsdp":
        assert report.in_loop("all-gather", role="forward"), report.summary()


@pytest.mark.parametrize("mode", ["zero", "ddp"])
def test_microbatches_reduce_once_per_step(mode):
    """ddp/zero with 3 microbatches: the first two sum local gradients with no data
    reduction, the last one's taps add them before reducing, so the step sends the
    data-axis bytes of one microbatch and equals the 1-microbatch step."""
    mesh = mesh_2d()
    params = gpt_params(jax.random.key(0))
    tokens, targets = gpt_batches(jax.random.key(1), 1, 24)
    batch = (tokens[0], targets[0])
    got, sent = {}, {}
    for k in (1, 3):
        step = jaxsync.train_step(
            gpt_loss, optax.adam(1e-2), mesh, mode=mode, stacked="blocks", microbatches=k
        )
        state = step.init(placed(mesh, params))
        report = jaxsync.overlap_report(step.lower(state, batch).compile())
        # Reduce-scatters are the data axis's alone (the compiler's TP sums are all-reduces).
        kinds = ("reduce-scatter",) if mode == "zero" else ("all-reduce", "reduce-scatter")
        sent[k] = sum(c.bytes * c.trip_count for c in report if c.kind in kinds)
        state, loss = step(state, batch)
        got[k] = (step.params(state), float(loss))
    if mode == "zero":
        assert sent[3] == sent[1] > 0, sent
    else:  # the TP all-reduces move the same bytes in 3 microbatches as in 1
        assert sent[3] < 1.1 * sent[1], sent
    np.testing.assert_allclose(got[3][1], got[1][1], rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got[3][0], got[1][0]
    )


@pytest.mark.parametrize(
    "mode,reduce_dtype",
    [("fsdp", jnp.bfloat16), ("fsdp", jnp.float32), ("zero", jnp.bfloat16), ("ddp", jnp.bfloat16)],
)
def test_mixed_precision(mode, reduce_dtype):
    """2-D steps with a bf16 model (FSDP: a compute policy; ZeRO: bf16 params) and a
    bf16 reduction match single-device optax on an fp32 master (on CPU, where
    XLA's own promotion of bf16 all-reduces aborted the compile). FSDP with a bf16
    reduction hands the scanned layers bf16 shards (the backward stacks bf16
    gradients, half of fp32: GSPMD's figure); with an fp32 one they stay fp32, so
    the reduced gradient is not rounded."""
    mesh = mesh_2d()
    params = gpt_params(jax.random.key(0))
    batches = gpt_batches(jax.random.key(1), 2, 8)
    seen = []

    def loss(params, batch):
        seen.append({x.dtype for x in jax.tree.leaves(params["blocks"])})
        return gpt_loss(params, batch)

    bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)  # noqa: E731
    tx = optax.sgd(0.5)  # not Adam, which would hide a wrongly scaled gradient
    if mode == "fsdp":
        policy = jaxsync.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=reduce_dtype)
        kw, held = {"policy": policy}, params
    else:
        kw, held = {"reduce_dtype": reduce_dtype}, bf16(params) if mode == "zero" else params
    step = jaxsync.train_step(loss, tx, mesh, mode=mode, stacked="blocks", **kw)
    state = step.init(placed(mesh, held))
    for i in range(2):
        state, _ = step(state, (batches[0][i], batches[1][i]))
    if mode == "fsdp":
        assert seen and all(s == {jnp.dtype(reduce_dtype)} for s in seen), seen
    model = params if mode == "ddp" else bf16(params)
    _, want = run_reference(tx, model, batches, loss_fn=gpt_loss, master_dtype=jnp.float32)
    got = step.master(state)

    # bf16 rounds each rank's gradient (the embedding's scatter-add sums in bf16)
    # where the reference rounds the whole batch's: within 10% of the update (5.3%
    # at most here), where a wrongly scaled or missing reduction is 50% and more.
    def close(path, a, b, p):
        step = np.max(np.abs(b - p))
        assert np.max(np.abs(a - b)) <= 0.1 * step, (jax.tree_util.keystr(path), step)

    jax.tree_util.tree_map_with_path(close, got, want, params)


def test_fsdp_remat_policy_keeps_gathered_layers():
    """2-D FSDP names each gathered layer as 1-D FSDP does: a layer body remat'd with
    save_only_these_names("jaxsync_gathered_layer") gathers once (forward), the
    default remat gathers again in the backward loop; both give the same step."""
    from functools import partial

    mesh = mesh_2d()
    params = gpt_params(jax.random.key(0))
    tokens, targets = gpt_batches(jax.random.key(1), 1, 8)
    batch = (tokens[0], targets[0])
    keep = jax.checkpoint_policies.save_only_these_names("jaxsync_gathered_layer")
    got = {}
    for name, policy in (("regather", None), ("keep", keep)):
        step = jaxsync.train_step(
            partial(gpt_loss, remat_policy=policy), optax.adam(1e-2), mesh, mode="fsdp",
            stacked="blocks",
        )  # fmt: skip
        state = step.init(placed(mesh, params))
        report = jaxsync.overlap_report(step.lower(state, batch).compile())
        got[name] = (report, step.params(step(state, batch)[0]))
    assert got["regather"][0].in_loop("all-gather", role="backward"), got["regather"][0].summary()
    assert not got["keep"][0].in_loop("all-gather", role="backward"), got["keep"][0].summary()
    assert got["keep"][0].in_loop("all-gather", role="forward"), got["keep"][0].summary()
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        got["keep"][1], got["regather"][1],
    )  # fmt: skip


def test_nnx_scanned_module_keeps_its_tensor_parallel_kernel():
    """An nnx.Module whose stacked kernel is placed over "model" (scan_layers, FSDP):
    its views reach scan_layers, the kernel keeps its split, results match one device."""
    from flax import nnx
    from test_step import Scanned, loss_fn, reference

    mesh = mesh_2d()
    model = Scanned(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    column = lambda path, x: (  # noqa: E731
        P(None, None, "model") if "blocks" in str(path) and x.ndim == 3 else P()
    )
    nnx.update(
        model,
        jax.tree_util.tree_map_with_path(
            lambda p, x: jax.device_put(x, NamedSharding(mesh, column(p, x))), params
        ),
    )
    step = jaxsync.train_step(loss_fn, optax.adam(1e-2), mesh, mode="fsdp", stacked="blocks")
    state = step.init(model)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((16, 6), np.float32), rng.standard_normal((16, 3), np.float32))
               for _ in range(2)]  # fmt: skip
    for b in batches:
        state, _ = step(state, b)
    assert state.params["blocks"]["lin"]["kernel"].sharding.spec == P(None, "data", "model")
    want, _ = reference(Scanned(nnx.Rngs(0)), optax.adam(1e-2), batches)
    got = nnx.to_pure_dict(nnx.state(step.model(state), nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, want)


@pytest.mark.parametrize(
    "shape,spec,dim,spread,padded",
    [
        ((10, 3), P(), 0, ("model",), 16),  # replicated over "model": spread, padded 10 -> 16
        ((8, 6), P(None, "model"), 0, (), 8),  # split over "model": cut over data only
        ((6, 8), P(), 1, ("model",), 8),  # the first dim 8 divides, not the first dim
        ((4, 6), P(), 0, (), 4),  # 4 divides, 4 x 2 divides none: not spread, no padding
    ],
)
def test_dim_collectives_match_numpy(shape, spec, dim, spread, padded):
    """Each data rank's gradient reduce-scattered (ZeRO), all-reduced (DDP) and the
    shards gathered back, on (data=4, model=2), against numpy sums."""
    from jaxsync._src.step.two_d.dims import DimSync, gather, plan_param, reduce, unpad
    from jaxsync._src.step.two_d.plan import project

    mesh = mesh_2d()
    plan = plan_param("w", shape, np.float32, spec, 4, False, {"model": 2})
    assert (plan.dim, plan.spread, plan.padded) == (dim, spread, padded)
    rows = np.random.default_rng(0).normal(size=(4, *shape)).astype(np.float32)
    want = rows.sum(0) * 0.5

    @jax.jit
    def run(x):
        def body(g):
            g = g[0]
            sync = DimSync(("data",), "float32", 0.5, scatter=True)
            shard = reduce(g, plan, sync)
            whole = reduce(g, plan, sync, scatter=False)
            return shard, whole, gather(shard, plan, ("data",))

        return jax.shard_map(
            body, mesh=mesh, in_specs=P("data"),
            out_specs=(project(plan.shard_spec(("data",)), {"data"}), P(), P()),
            axis_names={"data"},
        )(x)  # fmt: skip

    x = jax.device_put(rows, NamedSharding(mesh, P("data", *spec)))
    shard, whole, back = run(x)
    np.testing.assert_allclose(np.asarray(unpad(shard, plan)), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(whole), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(back), want, rtol=1e-6, atol=1e-6)
    # Each device holds 1/(4 x 2) of a spread param's padded dim, 1/4 otherwise.
    per_device = padded // (4 * (2 if spread else 1))
    assert shard.addressable_shards[0].data.shape[dim] == per_device


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_one_data_device_beside_a_model_axis_is_refused_by_name(mode):
    """(data=1, model=8): XLA's partitioner cannot compile a partially manual step whose
    manual axes have one device (an internal error); the step says so when it is built
    from the sharded params, naming the axes and what to do."""
    require_devices(8)
    mesh = jax.make_mesh((1, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    step = jaxsync.train_step(gpt_loss, optax.sgd(0.1), mesh, mode=mode, stacked="blocks")
    with pytest.raises(ValueError, match=r"data axes \['data'\] have 1 device.*'model': 8"):
        step.init(placed(mesh, gpt_params(jax.random.key(0))))

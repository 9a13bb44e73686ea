"""Expert parallelism by specs: an MoE GPT on (data=2, model=2, expert=2), model code as
on one device.

``"expert"`` is a compiler axis like ``"model"``: the experts carry a
``NamedSharding`` over it (tests/moe_gpt.py), the step is manual over ``"data"``
only, and the batch rows are split over ``("data", "expert")``, so the expert-axis
devices run different rows and GSPMD moves tokens to their experts. The expert
params' gradients are then reduced by jaxsync over ``"data"`` only (their split
over ``"expert"`` is the compiler's); a param replicated over ``"expert"`` (the
router, attention) gets every expert-axis device's rows from GSPMD's own sum,
which the comparison with single-device optax would catch if it were missing.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import local_shapes, place_by_specs, run_reference
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from moe_gpt import moe_batches, moe_loss, moe_params, moe_specs

import jaxsync

ROWS = P(("data", "expert"))
#: Per-device shapes under moe_specs: E/2 experts per device, "model" dims halved.
EP_SHAPES = {
    "embed": (32, 16), "head": (16, 16), "ln_f": (16,),
    "blocks.ln1": (2, 16), "blocks.ln2": (2, 16), "blocks.qkv": (2, 16, 24),
    "blocks.out": (2, 8, 16), "blocks.router": (2, 16, 4),
    "blocks.up": (2, 2, 16, 16), "blocks.down": (2, 2, 16, 16),
}  # fmt: skip
#: ...and of their ZeRO/FSDP shards: the first free dim (not the layer axis, not an
#: "expert" or "model" dim) halved over "data", and cut further over the compiler
#: axes the param is not split over (dims.plan_param's spread): the norms, router and
#: embed by 2 x 2 x 2, qkv/out/head by 2 x 2 ("data", "expert"), the experts by 2.
SHARD_SHAPES = {
    "embed": (4, 16), "head": (4, 16), "ln_f": (2,),
    "blocks.ln1": (2, 2), "blocks.ln2": (2, 2), "blocks.qkv": (2, 4, 24),
    "blocks.out": (2, 8, 4), "blocks.router": (2, 2, 4),
    "blocks.up": (2, 2, 8, 16), "blocks.down": (2, 2, 16, 8),
}  # fmt: skip


def mesh_3d():
    require_devices(8)
    return jax.make_mesh((2, 2, 2), ("data", "model", "expert"), axis_types=(AxisType.Auto,) * 3)


def placed(mesh, params):
    return place_by_specs(mesh, params, moe_specs())


def rows(mesh, tokens, targets):
    return jax.device_put((tokens, targets), NamedSharding(mesh, ROWS))


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_moe_gpt_on_data_model_and_expert_axes(mode):
    mesh = mesh_3d()
    params = moe_params(0)
    batches = moe_batches(1, 2, 8)
    # eps well above float rounding of the gradients: an expert weight whose summed
    # gradient cancels to ~1e-8 would otherwise take an update of g / (|g| + 1e-8),
    # any sign or size, from rounding alone (one element of blocks.up did).
    tx = optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)
    step = jaxsync.train_step(moe_loss, tx, mesh, mode=mode, stacked="blocks", clip_grad_norm=0.5)
    state = step.init(placed(mesh, params))
    batch0 = rows(mesh, batches[0][0], batches[1][0])
    # The rows stay split over "expert" too: placed as given, and so compiled.
    assert step.place(batch0)[0].sharding.spec == ROWS
    compiled = step.lower(state, batch0).compile()
    assert compiled.input_shardings[0][1][0].spec == ROWS
    losses = []
    for i in range(2):
        state, loss = step(state, rows(mesh, batches[0][i], batches[1][i]))
        losses.append(float(loss))

    # Single-device optax, with optax's clipping: same params and losses to float rounding.
    opt = optax.chain(optax.clip_by_global_norm(0.5), tx)
    want, _ = run_reference(opt, params, batches, loss_fn=moe_loss)
    got = step.params(state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, want)
    first = jax.jit(moe_loss)(params, (batches[0][0], batches[1][0]))
    np.testing.assert_allclose(losses[0], first, rtol=1e-6)
    assert int(state.step) == 2 and float(state.guard.metrics.grad_norm) > 0.5  # clipped

    # E/2 experts per device, the TP split kept; ZeRO/FSDP state 1/2 over "data" on top.
    assert local_shapes(got) == EP_SHAPES
    assert got["blocks"]["up"].sharding.spec == P(None, "expert", None, "model")
    assert local_shapes(state.params) == (SHARD_SHAPES if mode == "fsdp" else EP_SHAPES)
    inner = state.opt_state.inner if mode == "zero" else state.opt_state
    assert local_shapes(inner[0].mu) == (EP_SHAPES if mode == "ddp" else SHARD_SHAPES)
    if mode == "zero":
        assert local_shapes(state.opt_state.master) == SHARD_SHAPES

    # jaxsync's data reductions sit in the backward loop, one per expert block: a
    # layer's up/down gradient reduced over "data" as this device's E/2 experts.
    report = jaxsync.overlap_report(compiled)
    kind = "all-reduce" if mode == "ddp" else "reduce-scatter"
    ours = [
        s for s in report.in_loop(kind, role="backward")
        if ("psum" if mode == "ddp" else "reduce_scatter") in s.op_name
    ]  # fmt: skip
    shapes = {sh for s in ours for sh in s.shapes}
    want_blocks = {"f32[2,16,16]"} if mode == "ddp" else {"f32[2,8,16]", "f32[2,16,8]"}
    assert want_blocks <= shapes, report.summary()
    if mode == "fsdp":
        assert report.in_loop("all-gather", role="forward"), report.summary()


def test_a_param_split_over_a_data_axis_is_refused():
    """With "expert" among the data axes the step would hold every expert on every
    device (the results right, the split silently dropped): refused, naming the fix."""
    mesh = mesh_3d()
    step = jaxsync.train_step(
        moe_loss, optax.adam(1e-2), mesh, axis_name=("data", "expert"), stacked="blocks"
    )
    with pytest.raises(
        ValueError,
        match=r"param blocks\.down .*over \('expert',\).*data axes \('data', 'expert'\).*"
        r"axis_name='data'.*P\(\('data', 'expert'\)\)",
    ):
        step.init(placed(mesh, moe_params(0)))
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        placed(mesh, moe_params(0)),
    )
    with pytest.raises(ValueError, match=r"param blocks\.down"):
        step.abstract_state(shapes)


def test_rows_split_over_expert_before_data_are_refused():
    mesh = mesh_3d()
    step = jaxsync.train_step(moe_loss, optax.adam(1e-2), mesh, stacked="blocks")
    tokens, targets = moe_batches(1, 1, 8)
    bad = jax.device_put((tokens[0], targets[0]), NamedSharding(mesh, P(("expert", "data"))))
    with pytest.raises(ValueError, match=r"batch leaf \[0\] .*P\(\('data', 'expert'\)\)"):
        step.place(bad)
    # Rows over the data axes only (or host arrays) are placed over "data", as before.
    plain = jax.device_put((tokens[0], targets[0]), NamedSharding(mesh, P("data")))
    assert step.place(plain)[0].sharding.spec == P("data")
    assert step.place((tokens[0], targets[0]))[1].sharding.spec == P("data")

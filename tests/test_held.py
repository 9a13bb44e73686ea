"""ZeRO's stacked layers held as master shards and gathered in the forward.

A 1-D ``"zero"`` step keeps each stacked group only as the distributed optimizer's
fp32 master rows and gathers every layer in the next forward (Megatron's
``overlap_param_gather``) and again in the backward; ``reshard_after_forward=False``
keeps it for the backward instead, whatever the remat policy
(`jaxsync._src.sync.remat_keep`), and FSDP's ``reshard_after_forward=False`` keeps its
gathered layers the same way. These tests hold it to single-device optax (SGD too:
its update shows a gradient's scale), count the gathers of a compiled step, and check
what ``state.params`` and ``step.params`` say.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count_collectives, run_reference, scanned_batches, scanned_loss, scanned_params

import jaxsync
from jaxsync._src.core.held import HeldLayers

LAYERS = 4


def _train(mesh, tx, mode, batches, microbatches=1, **kw):
    step = jaxsync.train_step(scanned_loss, tx, mesh, mode, stacked="blocks",
                              microbatches=microbatches, **kw)  # fmt: skip
    state = step.init(scanned_params(jax.random.key(0), layers=LAYERS))
    xs, ys = batches
    for i in range(xs.shape[0]):
        state, _ = step(state, (xs[i], ys[i]))
    return step, state


def _assert_close(got, want, rtol=2e-5, atol=2e-6):
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=jaxsync.param_name(path))


@pytest.mark.parametrize(
    ("opt", "microbatches", "reshard"),
    [
        ("sgd", 1, False),
        ("adamw_clip", 1, False),
        ("adamw_clip", 1, True),
        ("sgd", 2, False),
    ],
)
def test_a_held_stack_trains_as_single_device_optax(mesh8, opt, microbatches, reshard):
    tx, clip = {"sgd": (optax.sgd(0.1), None), "adamw_clip": (optax.adamw(3e-2), 0.05)}[opt]
    batches = scanned_batches(jax.random.key(1), steps=3, batch=32)
    mode = jaxsync.ZeRO(reshard_after_forward=reshard)
    step, state = _train(mesh8, tx, mode, batches, microbatches, clip_grad_norm=clip)
    assert isinstance(state.params["blocks"], HeldLayers)
    ref = tx if clip is None else optax.chain(optax.clip_by_global_norm(clip), tx)
    want, _ = run_reference(ref, scanned_params(jax.random.key(0), layers=LAYERS), batches,
                            loss_fn=scanned_loss)  # fmt: skip
    _assert_close(step.params(state), want)
    _assert_close(step.master(state), want)
    # the stack moved well beyond the tolerance (a step that skipped it would fail above)
    moved = step.params(state)["blocks"]["w1"] - scanned_params(jax.random.key(0))["blocks"]["w1"]
    assert float(jnp.max(jnp.abs(moved))) > 1e-3


def test_state_params_point_to_step_params(mesh8):
    batches = scanned_batches(jax.random.key(1), steps=1, batch=16)
    step, state = _train(mesh8, optax.adam(1e-3), "zero", batches)
    assert "step.params(state)" in repr(state.params["blocks"])
    with pytest.raises(TypeError, match=r"state.params\['blocks'\].*step.params\(state\)"):
        state.params["blocks"]["w1"]
    # the rest of the params are the params; the count of the whole model is right
    full = step.params(state)
    assert state.params["inp"]["w"] is not None and "blocks" in full
    want = sum(x.size for x in jax.tree.leaves(scanned_params(jax.random.key(0), layers=LAYERS)))
    assert sum(x.size for x in jax.tree.leaves(full)) == want
    # no GPU holds the stack whole between steps: only its master shards, 1/8 each
    device = jax.devices()[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(state.params)
               for s in x.addressable_shards if s.device == device)  # fmt: skip
    rest = [x for k, sub in full.items() if k != "blocks" for x in jax.tree.leaves(sub)]
    assert held == sum(x.nbytes for x in rest)


def test_explicit_optimizer_calls_name_the_held_params(mesh8):
    batches = scanned_batches(jax.random.key(1), steps=1, batch=16)
    step, state = _train(mesh8, optax.adam(1e-3), "zero", batches)
    tx = step.optimizer(state)
    with pytest.raises(TypeError, match=r"distributed_optimizer: state.params\['blocks'\]"):
        tx.layout(state.params, mesh8)
    assert len(tx.layout(step.params(state), mesh8).slots) == 6


@pytest.mark.parametrize("reshard", [False, True])
def test_each_layer_is_gathered_once_per_step_unless_resharded(mesh8, reshard):
    """The forward gathers each layer; the backward gathers again only with
    ``reshard_after_forward`` (the remat policy keeps the gathered layer otherwise).
    Counted in the compiled CPU step, each inside a loop that runs LAYERS times: a
    buffer per stacked param either way, so one all-gather per param in each pass that
    gathers (XLA's GPU pipeline combines a layer's)."""
    batches = scanned_batches(jax.random.key(1), steps=1, batch=16)
    step, state = _train(mesh8, optax.adam(1e-3), jaxsync.ZeRO(reshard_after_forward=reshard),
                         batches)  # fmt: skip
    compiled = step.lower(state, (batches[0][0], batches[1][0])).compile()
    loops = jaxsync.overlap_report(compiled).in_loop(kind="all-gather")
    assert {c.trip_count for c in loops} == {LAYERS}
    layout = step.optimizer(state).layout(step.params(state), mesh8)
    stacked = [b for b in layout.buffers if b.key.stack == "blocks"]
    per_layer = len(scanned_params(jax.random.key(0))["blocks"])
    assert len(stacked) == per_layer  # a buffer per param
    assert {c.loop_role for c in loops} == ({"forward", "backward"} if reshard else {"forward"})
    assert len(loops) == (2 if reshard else 1) * per_layer
    # and no gather of the stack after the update: the only other all-gathers are
    # the unstacked buffers' (one per buffer, outside any loop)
    outside = count_collectives(compiled.as_text()).get("all-gather", 0) - len(loops)
    assert outside == len(layout.buffers) - len(stacked)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("later", ["keep", "zero"])
def test_a_held_state_checkpoint_continues_at_another_dp_size(mesh8, tmp_path, opt, later):
    """Saved at 8 devices from a step that keeps its gathered layers (the stack in the
    master shards, a buffer per stacked param), restored at 4, into such a step and
    into the default one that gathers again in the backward: the same params and
    master, the marker in place, and the next steps equal a run that never stopped
    (single-device optax, Adam's moments included)."""
    tx = {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-2)}[opt]
    batches = scanned_batches(jax.random.key(1), steps=3, batch=32)
    xs, ys = batches
    keep = jaxsync.ZeRO(reshard_after_forward=False)
    step8, state = _train(mesh8, tx, keep, (xs[:2], ys[:2]))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step8, state)
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    mode = keep if later == "keep" else "zero"
    step4 = jaxsync.train_step(scanned_loss, tx, mesh4, mode, stacked="blocks")
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step4, step4.init(scanned_params(jax.random.key(0)))).state
    assert isinstance(new.params["blocks"], HeldLayers)
    for a, b in zip(jax.tree.leaves(step8.master(state)), jax.tree.leaves(step4.master(new)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    new, _ = step4(new, (xs[2], ys[2]))
    want, _ = run_reference(tx, scanned_params(jax.random.key(0)), batches, loss_fn=scanned_loss)
    _assert_close(step4.params(new), want)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_keeps_its_gathered_layers_unless_it_reshards(mesh8, reshard):
    """FSDP's ``reshard_after_forward=False`` keeps each stacked layer it gathered in
    the forward for the backward, whatever the layer body's remat (as ZeRO does):
    one all-gather loop per step instead of two, and still single-device optax."""
    batches = scanned_batches(jax.random.key(1), steps=2, batch=32)
    mode = jaxsync.FSDP(reshard_after_forward=reshard)
    step, state = _train(mesh8, optax.sgd(0.1), mode, batches)
    want, _ = run_reference(optax.sgd(0.1), scanned_params(jax.random.key(0), layers=LAYERS),
                            batches, loss_fn=scanned_loss)  # fmt: skip
    _assert_close(step.params(state), want)
    compiled = step.lower(state, (batches[0][0], batches[1][0])).compile()
    loops = jaxsync.overlap_report(compiled).in_loop(kind="all-gather")
    assert {c.trip_count for c in loops} == {LAYERS}
    roles = sorted({c.loop_role for c in loops})
    assert roles == (["backward", "forward"] if reshard else ["forward"])
    per_layer = len(scanned_params(jax.random.key(0))["blocks"])  # an all-gather per param
    assert len(loops) == len(roles) * per_layer


@pytest.mark.parametrize("opt", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_one_device_holds_nothing_and_casts_in_the_update(opt):
    """With one data-parallel device there is nothing to gather or overlap, so ZeRO
    holds no stacked group: the state keeps the params, each stacked param has a
    buffer of its own, and the new param stack is that buffer cast in the update's
    pass (no loop beside the forward's and the backward's). From two devices on the
    group is held. Either way: single-device optax."""
    per_param = len(scanned_params(jax.random.key(0))["blocks"])
    batches = scanned_batches(jax.random.key(1), steps=2, batch=16)
    want, _ = run_reference(opt, scanned_params(jax.random.key(0), layers=LAYERS), batches,
                            loss_fn=scanned_loss)  # fmt: skip
    for n, held in ((1, False), (2, True)):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        step, state = _train(mesh, opt, "zero", batches)
        _assert_close(step.params(state), want)
        layout = step.optimizer(state).layout(step.params(state), mesh)
        assert sum(b.key.stack == "blocks" for b in layout.buffers) == per_param, n
        assert isinstance(state.params["blocks"], HeldLayers) is held, n
        hlo = step.lower(state, (batches[0][0], batches[1][0])).compile().as_text()
        if n == 1:  # the forward's and the backward's loops, no gather loop
            assert len(re.findall(r"\) while\(", hlo)) == 2


@pytest.mark.parametrize(("first", "then"), [(1, 2), (2, 1)])
def test_a_state_moves_between_one_device_and_a_held_step(tmp_path, first, then):
    """One device holds nothing (the params in the state), two hold the stacked group
    as master shards: Adam's state saved by either continues on the other, as
    single-device optax."""
    opt = optax.adam(1e-2)
    params = scanned_params(jax.random.key(0), layers=LAYERS)
    batches = scanned_batches(jax.random.key(1), steps=3, batch=16)
    xs, ys = batches
    mesh = jax.make_mesh((first,), ("data",), devices=jax.devices()[:first])
    step, state = _train(mesh, opt, "zero", (xs[:2], ys[:2]))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step, state)
    mesh = jax.make_mesh((then,), ("data",), devices=jax.devices()[:then])
    step = jaxsync.train_step(scanned_loss, opt, mesh, "zero", stacked="blocks")
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step, step.init(params)).state
    assert isinstance(new.params["blocks"], HeldLayers) is (then > 1)
    new, _ = step(new, (xs[2], ys[2]))
    want, _ = run_reference(opt, params, batches, loss_fn=scanned_loss)
    _assert_close(step.params(new), want)


def test_labels_on_split_stacks_train_and_move_between_sizes(mesh8, tmp_path):
    """Labels on a held group (a buffer per param and label): each label gets its own
    optimizer, as one-device optax.multi_transform does, and the state saved at 8
    devices continues at 4 (each label's per-param entries merged in the portable form)."""
    txs = {"decay": optax.adamw(1e-2, weight_decay=0.5), "no_decay": optax.adam(1e-2)}

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: "decay" if x.ndim >= 3 or path[-1].key == "w" else "no_decay", params
        )

    params = scanned_params(jax.random.key(0), layers=LAYERS)
    batches = scanned_batches(jax.random.key(1), steps=3, batch=32)
    xs, ys = batches
    step8, state = _train(mesh8, txs, "zero", (xs[:2], ys[:2]), labels=labels)
    layout = step8.optimizer(state).layout(step8.params(state), mesh8)
    assert {b.key.label for b in layout.buffers if b.key.stack} == {"decay", "no_decay"}
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step8, state)
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    step4 = jaxsync.train_step(scanned_loss, txs, mesh4, "zero", stacked="blocks", labels=labels)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step4, step4.init(params)).state
    new, _ = step4(new, (xs[2], ys[2]))
    want, _ = run_reference(optax.multi_transform(txs, labels), params, batches,
                            loss_fn=scanned_loss)  # fmt: skip
    _assert_close(step4.params(new), want)

"""FSDP with optimizer labels: one optimizer per label on its pieces of each unit.

Tiny models, three steps: train_step(mode="fsdp", labels=...) equals single-device
``optax.multi_transform`` (plain and scanned layers), each element's optimizer
state exists once, a label without an optimizer is named, and the whole state
checkpoints and restores at another data-parallel size.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import (
    make_batches,
    mlp_loss,
    mlp_params,
    run_reference,
    scanned_batches,
    scanned_loss,
    scanned_params,
)

import jaxsync

RTOL, ATOL = 2e-6, 1e-6


def decay_weights(params):
    """Weight decay on the matrices (``w``, ``w1``, ``w2``), not on biases and gains;
    by name, since a stacked bias has a layer axis too."""

    def one(path, _):
        return "decay" if jaxsync.param_name(path).split(".")[-1].startswith("w") else "no_decay"

    return jax.tree_util.tree_map_with_path(one, params)


# One mapping for the whole file: the elementwise probe (most of an init's time
# here) is cached per optimizer and shapes, so later inits of a model reuse it.
TRANSFORMS = {
    "decay": optax.adamw(1e-2, weight_decay=0.5),
    "no_decay": optax.adamw(1e-2, weight_decay=0.0),
}


def mesh_of(n):
    require_devices(8)
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def size(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("stacked", [False, True])
def test_labels_equal_multi_transform_with_one_state_per_element(stacked):
    if stacked:  # scanned layers: each layer gathered inside the scan
        params, loss_fn = scanned_params(jax.random.PRNGKey(0), layers=3), scanned_loss
        data = scanned_batches(jax.random.PRNGKey(1), 3, 16)
    else:
        params, loss_fn = mlp_params(jax.random.PRNGKey(0)), mlp_loss
        data = make_batches(jax.random.PRNGKey(1), 3, 16)
    step = jaxsync.train_step(
        loss_fn, TRANSFORMS, mesh_of(8), mode="fsdp", labels=decay_weights,
        stacked="blocks" if stacked else None,
    )  # fmt: skip
    state = step.init(params)
    for i in range(3):
        state, _ = step(state, (data[0][i], data[1][i]))
    # Decay moves every param by lr * 0.5 * |p| per step (about 1% here), far beyond
    # the tolerance: matching means each label got its own optimizer.
    want, _ = run_reference(optax.multi_transform(TRANSFORMS, decay_weights), params, data, loss_fn)
    got = step.params(state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), got, want)

    # Each element's state once: Adam's two moments cover the shards exactly
    # (padding included), plus one step count per label.
    fs = step.fully_shard(state)
    padded = sum(b.size * max(b.layers, 1) for u in fs.units for b in fs.layout(u).buffers)
    assert size(state.params) == padded
    assert size(state.opt_state) == 2 * padded + 2
    # every unit buffer holds one label, and a label's buffers lie side by side: one
    # piece of each unit's shard per label (a stacked unit has a buffer per param)
    labels = {u: [b.key.label for b in fs.layout(u).buffers] for u in fs.units}
    pieces = {u: [lab for v, lab, _, _ in fs.pieces() if v == u] for u in fs.units}
    assert all(len(set(v)) == len(v) for v in pieces.values())
    assert sorted(pieces["blocks" if stacked else "layer0"]) == ["decay", "no_decay"]
    if stacked:
        assert len(labels["blocks"]) == len(params["blocks"])  # one buffer per param
    else:
        assert all(len(set(v)) == len(v) for v in labels.values())


def test_explicit_path_and_label_errors():
    mesh = mesh_of(8)
    params = mlp_params(jax.random.PRNGKey(0))
    fs = jaxsync.fully_shard(
        params, axis_name="data", mesh=mesh, units=["layer0", "layer1", "layer2", "scale"],
        labels=decay_weights,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"param layer0\.b has label 'no_decay', which"):
        fs.multi_transform({"decay": optax.adamw(1e-2)})
    with pytest.raises(TypeError, match=r"fs\.multi_transform\(tx\)"):
        fs.init_optimizer(TRANSFORMS, fs.shard(params))
    with pytest.raises(TypeError, match=r"the label of param layer0\.b is None"):
        jaxsync.fully_shard(
            params, axis_name="data", mesh=mesh, units=["layer0", "layer1", "layer2", "scale"],
            labels=lambda p: {**decay_weights(p), "layer0": {"w": "decay", "b": None}},
        )  # fmt: skip
    plain = jaxsync.fully_shard(params, axis_name="data", mesh=mesh, units=["layer0", "scale"] +
                                ["layer1", "layer2"])  # fmt: skip
    with pytest.raises(ValueError, match=r"built without `labels`.*jaxsync\.fully_shard"):
        plain.multi_transform(TRANSFORMS)
    # train_step names the param and its label at init
    typo = lambda p: {**decay_weights(p), "scale": "nodecay"}  # noqa: E731
    step = jaxsync.train_step(mlp_loss, TRANSFORMS, mesh, mode="fsdp", labels=typo)
    named = r"param scale has label 'nodecay'.*\['decay', 'no_decay'\]"
    with pytest.raises(ValueError, match=named):
        step.init(params)
    # a mask, refused by the probe, points to labels in every mode
    masked = optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    with pytest.raises(ValueError, match="not elementwise") as e:
        jaxsync.train_step(mlp_loss, masked, mesh, mode="fsdp").init(params)
    assert "works in every mode" in str(e.value) and "fs.multi_transform" in str(e.value)


def test_whole_state_checkpoint_at_another_dp_size(tmp_path):
    # The stacked test's model and batches: its probe and 8-device step are cached.
    params = scanned_params(jax.random.PRNGKey(0), layers=3)
    data = scanned_batches(jax.random.PRNGKey(1), 3, 16)
    batch = lambda i: (data[0][i], data[1][i])  # noqa: E731

    def make(n):
        step = jaxsync.train_step(
            scanned_loss, TRANSFORMS, mesh_of(n), mode="fsdp", labels=decay_weights,
            stacked="blocks",
        )  # fmt: skip
        return step, step.init(params)

    step8, state = make(8)
    state, _ = step8(state, batch(0))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step8, state)
    step4, like = make(4)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step4, like).state
    jax.tree.map(np.testing.assert_array_equal, step8.master(state), step4.master(new))
    # the moments came back too: one more step at 4 devices matches one more at 8
    state, _ = step8(state, batch(1))
    new, _ = step4(new, batch(1))
    assert int(new.step) == 2
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
        step8.params(state), step4.params(new),
    )  # fmt: skip

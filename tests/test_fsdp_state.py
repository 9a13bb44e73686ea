"""What an FSDP step's ``state.params`` is: an :class:`jaxsync.FsdpShards`, not the params.

A user porting a trainer counted params with ``jax.tree.leaves(state.params)`` under
``mode="fsdp"`` and got the padded size of the flat unit shards (issue #30): the plain
``{unit: shard}`` dict read like the params. These tests pin what the container says,
that the step trains and checkpoints through it as before, and the counts that differ.
"""

import math

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import make_batches, mlp_loss, mlp_params, run_reference

import jaxsync

LR = 0.1


def _step(mesh, mode="fsdp"):
    step = jaxsync.train_step(mlp_loss, optax.sgd(LR), mesh, mode)
    return step, step.init(mlp_params(jax.random.key(0)))


def test_state_params_says_what_it_holds(mesh8):
    step, state = _step(mesh8)
    fs = step.fully_shard(state)
    assert isinstance(state.params, jaxsync.FsdpShards)
    assert state.params.units == tuple(fs.units)  # in unit order
    assert "step.params(state)" in repr(state.params) and "padded" in repr(state.params)
    # Key paths (checkpoints, specs, tree_map) read as the plain dict's did.
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    assert paths == [f"[{u!r}]" for u in sorted(fs.units)]
    assert isinstance(step.state_specs(state).params, jaxsync.FsdpShards)
    assert isinstance(step.abstract_state(mlp_params(jax.random.key(0))).params, jaxsync.FsdpShards)
    # It answers no mapping question: the error names the units and the way to the params.
    with pytest.raises(TypeError, match=r"layer0.*\['w'\].*step\.params\(state\)"):
        state.params["w"]
    with pytest.raises(TypeError, match=r"TrainStep.init: .*FsdpShards.*step\.params\(state\)"):
        step.init(state.params)
    # FullyShard's own methods take it as they take fs.shard's dict.
    jax.tree.map(np.testing.assert_array_equal, fs.unshard(state.params), step.master(state))


def test_the_params_count_and_the_shards_count_differ(mesh8):
    params = mlp_params(jax.random.key(0))
    step, state = _step(mesh8)
    fs = step.fully_shard(state)
    exact = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    padded = sum(b.size * max(b.layers, 1) for u in fs.units for b in fs.layout(u).buffers)
    assert sum(x.size for x in jax.tree.leaves(step.params(state))) == exact
    assert sum(x.size for x in jax.tree.leaves(state.params)) == padded > exact  # the miscount


def test_two_fsdp_steps_equal_single_device_optax(mesh8):
    params = mlp_params(jax.random.key(0))
    batches = make_batches(jax.random.key(1), steps=2, batch=16)
    units = ("scale", "layer2", "layer0", "layer1")  # not sorted: the order is kept
    step, state = _step(mesh8, jaxsync.FSDP(units=units))
    for i in range(2):
        state, _ = step(state, (batches[0][i], batches[1][i]))
    assert isinstance(state.params, jaxsync.FsdpShards) and state.params.units == units
    want, _ = run_reference(optax.sgd(LR), params, batches)
    got = step.params(state)
    assert jax.tree.structure(got) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)


def test_whole_state_checkpoint_round_trips(mesh8, tmp_path):
    params = mlp_params(jax.random.key(0))
    batches = make_batches(jax.random.key(1), steps=1, batch=16)
    step, state = _step(mesh8)
    state, _ = step(state, (batches[0][0], batches[1][0]))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step, state)
    # The saved format is unchanged: the params per param, unpadded.
    saved = ocp.StandardCheckpointer().metadata(tmp_path / "1" / "state")
    saved = getattr(saved, "item_metadata", saved)
    saved = getattr(saved, "tree", saved)
    shapes = jax.tree.map(lambda x: tuple(x.shape), saved["params"])
    assert shapes == jax.tree.map(lambda x: tuple(x.shape), params)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore_state(step, step.init(params)).state
    assert isinstance(restored.params, jaxsync.FsdpShards)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.sharding == b.sharding
    step(restored, (batches[0][0], batches[1][0]))  # the step takes it

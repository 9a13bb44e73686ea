"""The whole TrainState through one Checkpointer call, at another DP size, and
one writer per checkpoint directory."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import jaxsync
from jaxsync._src.checkpoint.lock import LOCK_NAME

BATCH = {
    "x": np.random.RandomState(0).randn(16, 4).astype(np.float32),
    "y": np.ones((16, 3), np.float32),
}


class WithStats(nnx.Module):
    def __init__(self, rngs, norm=True):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs) if norm else None

    def __call__(self, x):
        y = self.lin(x)
        return self.bn(y) if self.bn is not None else y


def loss_fn(m, b):
    return jnp.mean((m(b["x"]) - b["y"]) ** 2)


def make(mode, n, norm=True):
    require_devices(8)
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    scale = jaxsync.DynamicLossScale(initial_scale=2.0**10, growth_interval=2)
    step = jaxsync.train_step(loss_fn, optax.adam(1e-2), mesh, mode=mode, loss_scale=scale)
    return step, step.init(WithStats(nnx.Rngs(0), norm))


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_whole_state_continues_at_another_dp_size(tmp_path, mode):
    # Before: ddp/fsdp restored the loss scale and skip counters at their init
    # values, and every mode the BatchNorm statistics.
    step8, state = make(mode, 8)
    for _ in range(3):
        state, _ = step8(state, BATCH)
    assert int(state.step) == 3 and float(state.loss_scale.scale) == 2048.0
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step8, state, meta={"data_position": 3})
    step4, like = make(mode, 4)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore_state(step4, like)
    new = restored.state
    assert restored.step == 3 and restored.meta == {"data_position": 3}
    assert int(new.step) == 3
    for a, b in zip(
        leaves(state.guard or state.opt_state.loss_scale),
        leaves(new.guard or new.opt_state.loss_scale),
        strict=True,
    ):  # scale, skip counters, metrics
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(step8.params(state)), leaves(step4.params(new)), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(step8.model(state).bn.mean[...], step4.model(new).bn.mean[...])
    assert float(jnp.abs(step4.model(new).bn.mean[...]).sum()) > 0  # not the init zeros
    for a, b in zip(leaves(step8.master(state)), leaves(step4.master(new)), strict=True):
        np.testing.assert_array_equal(a, b)
    new, _ = step4(new, BATCH)  # it trains on: the step and the scale continue
    assert int(new.step) == 4 and float(new.loss_scale.scale) == 4096.0


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_optimizer_state_continues_exactly(tmp_path, mode):
    # Without BatchNorm the loss does not depend on the DP size: one more step
    # from the restored state at 4 devices matches one more at 8.
    step8, state = make(mode, 8, norm=False)
    state, _ = step8(state, BATCH)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step8, state)
    step4, like = make(mode, 4, norm=False)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step4, like).state
    state, _ = step8(state, BATCH)
    new, _ = step4(new, BATCH)
    for a, b in zip(leaves(step8.params(state)), leaves(step4.params(new)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_restore_names_the_state_it_cannot_find(tmp_path):
    step, state = make("ddp", 8, norm=False)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step, state)
    other, like = make("ddp", 8, norm=True)  # this model has BatchNorm statistics
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(jaxsync.CheckpointMismatchError, match=r"missing from.*model_state"):
            ckpt.restore_state(other, like)
        zero, zlike = make("zero", 8, norm=False)
        with pytest.raises(jaxsync.CheckpointMismatchError, match="mode='ddp' TrainState"):
            ckpt.restore_state(zero, zlike)
        with pytest.raises(jaxsync.CheckpointMismatchError, match="restore_state"):
            ckpt.restore(params_like=state.params, opt_state_like=state.opt_state)


def test_a_second_writer_is_refused(tmp_path):
    step, state = make("ddp", 8, norm=False)
    first = jaxsync.Checkpointer(tmp_path)
    first.save_state(step, state, step=1)
    owner = json.loads((tmp_path / LOCK_NAME).read_text())
    assert owner["pid"] == os.getpid()
    second = jaxsync.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=f"being written by another run: process {os.getpid()}"):
        second.save_state(step, state, step=2)
    first.save_state(step, state, step=3)  # the owner goes on
    first.close()
    assert not (tmp_path / LOCK_NAME).exists()
    second.save_state(step, state, step=4)  # the directory is free again
    second.close()
    assert jaxsync.Checkpointer(tmp_path).all_steps() == [1, 3, 4]


def test_stale_and_foreign_owners(tmp_path):
    step, state = make("ddp", 8, norm=False)
    lock = tmp_path / LOCK_NAME
    # a dead process on this host: its marker is stale and taken over
    dead = {"host": os.uname().nodename, "pid": 2**22 + 12345, "started": "1", "token": "x"}
    lock.write_text(json.dumps(dead))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step, state, step=1)
    # another host cannot be checked: refused, unless taken over explicitly
    lock.write_text(json.dumps(dict(dead, host="elsewhere", pid=1)))
    ckpt = jaxsync.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="host 'elsewhere'.*take_over=True"):
        ckpt.save_state(step, state, step=2)
    ckpt.close()
    with jaxsync.Checkpointer(tmp_path, take_over=True) as ckpt:
        ckpt.save_state(step, state, step=2)


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_restore_into_an_abstract_state(tmp_path, mode):
    step8, state = make(mode, 8)
    state, _ = step8(state, BATCH)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step8, state)
    step2, _ = make(mode, 2)
    like = step2.abstract_state(WithStats(nnx.Rngs(0)))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step2, like).state
    for a, b in zip(leaves(step8.params(state)), leaves(step2.params(new)), strict=True):
        np.testing.assert_array_equal(a, b)
    new, _ = step2(new, BATCH)
    assert int(new.step) == 2


def make_zero(shape, axes, n):
    require_devices(8)
    mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:n])
    step = jaxsync.train_step(loss_fn, optax.adam(1e-2), mesh, mode="zero", axis_name=axes)
    return step, step.init(WithStats(nnx.Rngs(0), norm=False))


def test_zero_state_moves_between_named_data_axes(tmp_path):
    # Before: a ZeRO state saved with axis_name=("replica", "data") named its buffers
    # "float32.replica+data.all", and a 1-D ("data",) step found none of them (and back).
    two_d, state = make_zero((2, 4), ("replica", "data"), 8)
    one_d8, state8 = make_zero((8,), ("data",), 8)
    one_d4, _ = make_zero((4,), ("data",), 4)
    for _ in range(2):
        state, _ = two_d(state, BATCH)
        state8, _ = one_d8(state8, BATCH)
    with jaxsync.Checkpointer(tmp_path / "2d") as ckpt:
        ckpt.save_state(two_d, state)
    with jaxsync.Checkpointer(tmp_path / "1d") as ckpt:
        ckpt.save_state(one_d8, state8)
    state, _ = two_d(state, BATCH)  # the uninterrupted runs
    state8, _ = one_d8(state8, BATCH)
    runs = [(two_d, state, "2d", one_d8, 1e-6), (two_d, state, "2d", one_d4, 1e-5)]
    runs += [(one_d8, state8, "1d", two_d, 1e-6)]
    for saved_by, done, path, step, tol in runs:
        with jaxsync.Checkpointer(tmp_path / path) as ckpt:
            new = ckpt.restore_state(step, step.init(WithStats(nnx.Rngs(0), norm=False))).state
        new, _ = step(new, BATCH)
        assert int(new.step) == 3
        for a, b in zip(leaves(saved_by.params(done)), leaves(step.params(new)), strict=True):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol / 10)

"""replica_check: every copy of every replicated leaf compared, the faulty device named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import launch, make_batches, mlp_loss, mlp_params

import jaxsync

SIZES = (16, 40, 24, 4)


def _trained(mesh, mode, steps=2):
    params = mlp_params(jax.random.PRNGKey(0), sizes=SIZES)
    step = jaxsync.train_step(mlp_loss, optax.adam(1e-3), mesh, mode)
    state = step.init(params)
    xs, ys = make_batches(jax.random.PRNGKey(1), steps, 32, SIZES)
    for i in range(steps):
        state, _ = step(state, (xs[i], ys[i]))
    return step, state


def _flip_bit(x: jax.Array, device_index: int, bit: int = 3) -> jax.Array:
    """``x`` with one bit of its first element flipped in one device's copy only."""
    shards = []
    for s in x.addressable_shards:
        data = np.asarray(s.data).copy()
        if s.device == x.sharding.mesh.devices.flat[device_index]:
            word = data.reshape(-1).view(np.uint32)
            word[0] ^= np.uint32(1 << bit)
        shards.append(jax.device_put(data, s.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_a_flipped_bit_in_one_device_s_copy_is_named(mesh8, mode):
    step, state = _trained(mesh8, mode)
    clean = jaxsync.replica_check(step, state)
    assert clean.ok and clean.checked >= 7  # the 7 params at least
    w = state.params["layer1"]["w"]
    bad = state._replace(params={**state.params, "layer1": {**state.params["layer1"],
                                                             "w": _flip_bit(w, 5)}})  # fmt: skip
    report = jaxsync.replica_check(step, bad)
    assert not report.ok
    (m,) = report.mismatches
    assert m.leaf.endswith("params['layer1']['w']")
    assert m.devices == (int(mesh8.devices.flat[5].id),) and m.copies == 8
    assert "device(s) [" in str(report) and "layer1" in str(report)


def test_ddp_optimizer_state_is_checked_too(mesh8):
    step, state = _trained(mesh8, "ddp")
    mu = state.opt_state[0].mu["layer0"]["b"]
    inner = state.opt_state[0]._replace(mu={**state.opt_state[0].mu,
                                            "layer0": {**state.opt_state[0].mu["layer0"],
                                                       "b": _flip_bit(mu, 0, bit=30)}})  # fmt: skip
    bad = state._replace(opt_state=(inner, *state.opt_state[1:]))
    report = jaxsync.replica_check(step, bad)
    assert [m.leaf for m in report.mismatches] == [".opt_state[0].mu['layer0']['b']"]
    assert report.devices == (int(mesh8.devices.flat[0].id),)


def test_sharded_leaves_have_no_copies_to_compare(mesh8):
    # FSDP without hybrid sharding: every shard is its device's own; the guard and
    # the step counter are the replicated leaves.
    step, state = _trained(mesh8, "fsdp")
    report = jaxsync.replica_check(step, state)
    n_replicated = sum(
        1 for x in jax.tree.leaves(state) if not any(e is not None for e in x.sharding.spec)
    )
    assert report.ok and report.checked == n_replicated


def test_clean_training_raises_no_alarm(mesh8):
    step, state = _trained(mesh8, "ddp", steps=1)
    xs, ys = make_batches(jax.random.PRNGKey(2), 20, 32, SIZES)
    for i in range(20):
        state, _ = step(state, (xs[i], ys[i]))
        assert jaxsync.replica_check(step, state).ok


def test_a_state_on_another_mesh_is_named(mesh8):
    step, state = _trained(mesh8, "ddp")
    other = jax.device_put(jnp.ones(3), jax.devices()[0])
    with pytest.raises(ValueError, match="not sharded over the step's mesh"):
        jaxsync.replica_check(step, {"x": other})


JOB = """
import os, sys
import jax, numpy as np, optax
import jaxsync
jaxsync.initialize()
sys.path.insert(0, sys.argv[1])
from helpers import launch, mlp_loss, mlp_params
mesh = jax.make_mesh((jax.device_count(),), ("data",))
step = jaxsync.train_step(mlp_loss, optax.adam(1e-3), mesh, "ddp")
state = step.init(mlp_params(jax.random.PRNGKey(0)))
rows = 16 // jax.process_count()
batch = (np.ones((rows, 12), np.float32), np.ones((rows, 5), np.float32))
state, loss = step(state, batch)
print("clean", jaxsync.replica_check(step, state).ok, flush=True)
w = state.params["layer1"]["w"]
last = w.sharding.mesh.devices.flat[-1]  # process 1's second device
shards = []
for s in w.addressable_shards:
    data = np.asarray(s.data).copy()
    if s.device == last:
        data.reshape(-1).view(np.uint32)[0] ^= np.uint32(8)
    shards.append(jax.device_put(data, s.device))
bad = jax.make_array_from_single_device_arrays(w.shape, w.sharding, shards)
state = state._replace(params={**state.params, "layer1": {**state.params["layer1"], "w": bad}})
report = jaxsync.replica_check(step, state)
print("named", report.devices == (last.id,), [m.leaf for m in report.mismatches], flush=True)
"""


@pytest.mark.multiprocess
def test_two_processes_name_the_device_of_the_other_process(tmp_path):
    out = launch(tmp_path, JOB)
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):  # every process reads the same verdict
        assert f"[{rank}] clean True" in out.stdout, out.stdout
        assert f"[{rank}] named True [\".params['layer1']['w']\"]" in out.stdout, out.stdout

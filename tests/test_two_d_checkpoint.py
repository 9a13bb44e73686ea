"""Whole-state checkpoints of 2-D (tensor-parallel-by-spec) train states, restored
onto other mesh shapes: data=8 <-> (data=4, model=2), and (4, 2) -> (2, 4).

A 2-D state is saved in the same per-param form as a 1-D state of its mode, so
the checkpoint moves between the two in both directions; the run then goes on
as if it had never stopped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tp_gpt import gpt_batches, gpt_loss, gpt_params, tp_specs

import jaxsync
from jaxsync._src.checkpoint.train_state import portable_like, to_portable

MESHES = {"data8": (8,), "data4_model2": (4, 2), "data2_model4": (2, 4)}
MODES = ["ddp", "zero", "fsdp"]
N, K = 2, 2  # steps before the checkpoint, steps after it
BATCHES = gpt_batches(jax.random.key(1), N + K, 8)


def make(mesh_name, mode, loss_scale=None, labels=False, loss_fn=gpt_loss):
    """A step on the named mesh and its initial state (2-D: the params placed by tp_specs)."""
    require_devices(8)
    shape = MESHES[mesh_name]
    names = ("data",) if len(shape) == 1 else ("data", "model")
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    params = gpt_params(jax.random.key(0))
    tx, groups = optax.adam(1e-2), None
    if labels:  # weight decay on matrices only
        tx = {"decay": optax.adamw(1e-2, weight_decay=0.1), "flat": optax.adam(1e-2)}
        groups = jax.tree_util.tree_map_with_path(
            lambda path, x: "decay" if x.ndim - ("blocks" in str(path)) == 2 else "flat", params
        )
    step = jaxsync.train_step(
        loss_fn, tx, mesh, mode=mode, stacked="blocks", loss_scale=loss_scale, labels=groups
    )
    if len(shape) > 1:
        params = jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, tp_specs(),
            is_leaf=lambda x: isinstance(x, P),
        )  # fmt: skip
    return step, step.init(params)


def batch(i):
    return BATCHES[0][i], BATCHES[1][i]


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(leaves(a), leaves(b), strict=True))


#: Every mode between 1-D and 2-D, one direction each (both directions read and write
#: the same portable tree, which test_the_portable_form_is_the_one_dimensional_one
#: compares); another model size for ZeRO, whose padded shards change with it.
CASES = [
    ("zero", "data8", "data4_model2"), ("fsdp", "data4_model2", "data8"),
    ("ddp", "data4_model2", "data8"), ("zero", "data4_model2", "data2_model4"),
]  # fmt: skip


@pytest.mark.parametrize("mode,src,dst", CASES)
def test_a_run_continues_on_another_mesh_shape(tmp_path, mode, src, dst):
    step_a, state = make(src, mode)
    for i in range(N):
        state, _ = step_a(state, batch(i))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step_a, state, meta={"data_position": N})
    saved = leaves(to_portable(step_a, state, "test"))
    saved_master = leaves(step_a.master(state))

    step_b, like = make(dst, mode)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore_state(step_b, like)
    new = restored.state
    assert restored.step == N and int(new.step) == N and restored.meta == {"data_position": N}
    # Moving the state is exact: the same per-param master, moments, counts and
    # guard, read back through the other layout's own conversion.
    for a, b in zip(saved, leaves(to_portable(step_b, new, "test")), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(saved_master, leaves(step_b.master(new)), strict=True):
        np.testing.assert_array_equal(a, b)

    for i in range(N, N + K):  # the uninterrupted run, and the resumed one
        state, _ = step_a(state, batch(i))
        new, _ = step_b(new, batch(i))
    assert int(new.step) == N + K
    want, got = step_a.params(state), step_b.params(new)
    assert max_diff(want, got) < 2e-6, max_diff(want, got)
    assert max_diff(step_a.params(make(src, mode)[1]), got) > 1e-2  # it did train


def poisoned_loss(params, batch):
    """The GPT's loss times each row's weight: an Inf weight makes the step non-finite."""
    tokens, targets, weight = batch
    return gpt_loss(params, (tokens, targets)) * jnp.mean(weight)


def weighted(i, poison=False):
    return (*batch(i), np.full((8,), np.inf if poison else 1.0, np.float32))


@pytest.mark.parametrize("mode", ["zero", "fsdp"])  # the guard state DDP shares with them
def test_the_loss_scale_and_skip_counters_survive(tmp_path, mode):
    scale = jaxsync.DynamicLossScale(initial_scale=2.0**10, growth_interval=3, hysteresis=1)
    step_a, state = make("data4_model2", mode, loss_scale=scale, loss_fn=poisoned_loss)
    for i in range(N + 1):  # one skipped step (the scale halves), then two applied ones
        state, _ = step_a(state, weighted(i, poison=i == 1))
    m = state.metrics
    assert (int(m.skipped_steps), int(state.step), float(state.loss_scale.scale)) == (1, N, 2.0**9)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step_a, state)
    step_b, like = make("data8", mode, loss_scale=scale, loss_fn=poisoned_loss)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step_b, like).state
    assert int(new.step) == N
    # Scalars only: an FSDP step's NaN diagnostics are per unit on 1-D, per param on 2-D.
    scalars = lambda s: [np.asarray(x) for x in (*s.loss_scale, *s.metrics[:5])]  # noqa: E731
    for a, b in zip(scalars(state), scalars(new), strict=True):
        np.testing.assert_array_equal(a, b)
    # Both go on the same. The growth counter was saved at 1 (one applied step
    # since the skip): two more steps grow the scale, as three would from 0.
    scales = []
    for i, poison in ((N + 1, False), (N + 2, False), (N + 3, True)):
        state, _ = step_a(state, weighted(i % (N + K), poison))
        new, _ = step_b(new, weighted(i % (N + K), poison))
        for a, b in zip(scalars(state)[:3], scalars(new)[:3], strict=True):  # the scaler
            np.testing.assert_array_equal(a, b)
        scales.append(float(new.loss_scale.scale))
    assert scales == [2.0**9, 2.0**10, 2.0**9]
    assert int(new.metrics.skipped_steps) == 2 and int(new.step) == N + 2


@pytest.mark.parametrize("labels", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_the_portable_form_is_the_one_dimensional_one(mode, labels):
    """Same keys, shapes and dtypes as a 1-D state's: what lets a checkpoint move."""
    one_d, state_1 = make("data8", mode, labels=labels)
    two_d, _ = make("data4_model2", mode, labels=labels)
    spec = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(two_d.mesh, s)),
        gpt_params(jax.random.key(0)), tp_specs(), is_leaf=lambda x: isinstance(x, P),
    )  # fmt: skip
    state_2 = two_d.abstract_state(spec)

    def form(tree):
        return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]

    assert form(portable_like(two_d, state_2, "t")) == form(portable_like(one_d, state_1, "t"))


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_parameter_groups_continue_on_another_mesh_shape(tmp_path, mode):
    step_a, state = make("data4_model2", mode, labels=True)
    state, _ = step_a(state, batch(0))
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step_a, state)
    step_b, like = make("data8", mode, labels=True)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step_b, like).state
    for i in (1, 2):
        state, _ = step_a(state, batch(i))
        new, _ = step_b(new, batch(i))
    assert max_diff(step_a.params(state), step_b.params(new)) < 2e-6


def small_loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] + params["b"] - y) ** 2)


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_padded_shards_move_unpadded(tmp_path, mode):
    """Dims of 6 over data=4 are padded to 8 on the 2-D mesh; the checkpoint holds
    them unpadded, as the 1-D step on data=8 (which pads its own way) reads them."""
    require_devices(8)
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((6, 4), np.float32),
        "v": rng.standard_normal((4, 6), np.float32),
        "b": np.zeros((6,), np.float32),
    }
    data = [(rng.standard_normal((8, 6), np.float32), rng.standard_normal((8, 6), np.float32))
            for _ in range(3)]  # fmt: skip
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = {"w": P(None, "model"), "v": P("model", None), "b": P()}
    step_a = jaxsync.train_step(small_loss, optax.adam(1e-2), mesh, mode=mode)
    state = step_a.init(
        {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in params.items()}
    )
    padded = state.params if mode == "fsdp" else state.opt_state.master
    assert padded["w"].shape == (8, 4) and padded["b"].shape == (8,)  # the test's premise
    state, _ = step_a(state, data[0])
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step_a, state)
    mesh8 = jax.make_mesh((8,), ("data",))
    step_b = jaxsync.train_step(small_loss, optax.adam(1e-2), mesh8, mode=mode)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step_b, step_b.init(params)).state
    for a, b in zip(leaves(step_a.master(state)), leaves(step_b.master(new)), strict=True):
        np.testing.assert_array_equal(a, b)
    for b in data[1:]:
        state, _ = step_a(state, b)
        new, _ = step_b(new, b)
    assert max_diff(step_a.params(state), step_b.params(new)) < 2e-6

"""Whole-state checkpoints of 2-D (tensor-parallel-by-spec) train states, restored
onto other mesh shapes: data=8 <-> (data=4, model=2), and (4, 2) -> (2, 4).

A 2-D state is saved in the same per-param form as a 1-D state of its mode, so
the checkpoint moves between the two in both directions; the run then goes on
as if it had never stopped.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tp_gpt import gpt_batches, gpt_loss, gpt_params, tp_specs

import jaxsync
from jaxsync._src.train_state_checkpoint import portable_like, to_portable

MESHES = {"data8": (8,), "data4_model2": (4, 2), "data2_model4": (2, 4)}
MODES = ["ddp", "zero", "fsdp"]
N, K = 2, 2  # steps before the checkpoint, steps after it
BATCHES = gpt_batches(jax.random.key(1), N + K, 8)


def make(mesh_name, mode, loss_scale=None, labels=False):
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
        gpt_loss, tx, mesh, mode=mode, stacked="blocks", loss_scale=loss_scale, labels=groups
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "src,dst",
    [("data8", "data4_model2"), ("data4_model2", "data8"), ("data4_model2", "data2_model4")],
)
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


@pytest.mark.parametrize("mode", MODES)
def test_the_loss_scale_and_skip_counters_survive(tmp_path, mode):
    # 2**127 overflows the scaled fp32 loss: the first steps are skipped and the
    # scale backs off until the steps apply.
    scale = jaxsync.DynamicLossScale(initial_scale=2.0**127, growth_interval=2, hysteresis=1)
    step_a, state = make("data4_model2", mode, loss_scale=scale)
    for i in range(N + 1):
        state, _ = step_a(state, batch(i))
    assert int(state.metrics.skipped_steps) > 0, state.metrics
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step_a, state)
    step_b, like = make("data8", mode, loss_scale=scale)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        new = ckpt.restore_state(step_b, like).state
    assert int(new.step) == int(state.step)
    # Scalars only: an FSDP step's NaN diagnostics are per unit on 1-D, per param on 2-D.
    scalars = lambda s: [np.asarray(x) for x in (*s.loss_scale, *s.metrics[:5])]  # noqa: E731
    for a, b in zip(scalars(state), scalars(new), strict=True):
        np.testing.assert_array_equal(a, b)
    state, _ = step_a(state, batch(N + 1))
    new, _ = step_b(new, batch(N + 1))
    for a, b in zip(scalars(state), scalars(new), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert int(new.step) == int(state.step)


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
    form = lambda t: (  # noqa: E731
        jax.tree.structure(t), [(x.shape, x.dtype) for x in jax.tree.leaves(t)]
    )
    assert form(portable_like(two_d, state_2, "t")) == form(portable_like(one_d, state_1, "t"))

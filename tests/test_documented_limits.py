"""Restrictions the README and the docstrings state, each refused with a message that
names what is at fault and says what to write instead (issue #29, item 2). Each test
builds the misuse and fails without its check: the FSDP one trained Muon on flat
shards without a word; the others had checks that no test fired."""

from functools import partial

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import require_devices
from helpers import make_batches, mlp_loss, mlp_params, scanned_loss
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxsync

DET = jaxsync.Deterministic(units=8)
MUON = jaxsync.whole_matrices(optax.contrib.muon(0.02))
UNITS = ["layer0", "layer1", "layer2", "scale"]


@pytest.fixture
def setup(mesh8):
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=1, batch=16)
    return mesh8, params, jaxsync.shard_batch((xs[0], ys[0]), mesh8)


def _lower_unit_grads(mesh, params, batch, reduce):
    """``reduce(unit_grads)`` traced inside shard_map, after a deterministic grad."""

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    def f(p, b):
        _, g = jaxsync.value_and_grad(mlp_loss, axis_name="data", deterministic=DET)(p, b)
        return reduce(g, p)

    return jax.jit(f).lower(params, batch)


# ------------------------------------------------------------- whole matrices
def test_fsdp_refuses_whole_matrices_as_its_optimizer(setup):
    """README (Muon): whole_matrices is refused by FSDP's fully_shard. Given as the
    optimizer itself with `check_elementwise=False`, FSDP ran Muon on flat shards
    without a word; `train_step(mode="fsdp")` answered with the probe's advice to use
    whole_matrices. Now both name whole_matrices and point to mode='zero'."""
    mesh, params, _ = setup
    fs = jaxsync.fully_shard(params, axis_name="data", mesh=mesh, units=UNITS)
    named = r"`tx` is routed to `jaxsync.whole_matrices`.*FSDP runs every optimizer on flat"
    with pytest.raises(ValueError, match=named):
        fs.init_optimizer(MUON, fs.shard(params), check_elementwise=False)
    with pytest.raises(ValueError, match=r"FullyShard.init_optimizer: `tx` is routed.*'zero'"):
        jaxsync.train_step(mlp_loss, MUON, mesh, "fsdp").init(params)
    # By label (FullyShard.multi_transform), as train_step routes a mapping `tx`.
    tx = {"muon": MUON, "adamw": optax.adamw(1e-3)}
    step = jaxsync.train_step(mlp_loss, tx, mesh, "fsdp", labels=jaxsync.muon_labels)
    with pytest.raises(ValueError, match=r"labels \['muon'\] are routed to `jaxsync.whole_ma"):
        step.init(params)


# ------------------------------------------------------------ deterministic mode
def test_deterministic_step_refuses_microbatches_and_stacked(mesh8):
    """README: the step's units already run one after another (raise `units` rather
    than `microbatches`); `stacked=` is not covered by the mode."""
    with pytest.raises(ValueError, match=r"does not support microbatches=2.*Deterministic\("):
        jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, jaxsync.ZeRO(deterministic=DET),
                           microbatches=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"`deterministic` does not support `stacked`; drop"):
        jaxsync.train_step(scanned_loss, optax.sgd(0.1), mesh8, jaxsync.DDP(deterministic=DET),
                           stacked="blocks")  # fmt: skip


def test_deterministic_optimizer_refuses_what_it_does_not_cover():
    """Docstring of distributed_optimizer: plain data parallelism only (no `rules`,
    `stacked`); `reduce_dtype` fp32."""
    with pytest.raises(NotImplementedError, match=r"drop `rules` \(None\) and `stacked` \(\("):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", deterministic=DET,
                                      stacked="blocks")  # fmt: skip
    with pytest.raises(ValueError, match=r"`reduce_dtype` must be float32, got .*bfloat16"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", deterministic=DET,
                                      reduce_dtype=jnp.bfloat16)  # fmt: skip


def test_deterministic_value_and_grad_takes_params_and_no_rules():
    rules = jaxsync.SyncRules.of({r"scale": jaxsync.Tied("data")})
    with pytest.raises(NotImplementedError, match=r"plain data parallelism only, not `rules`"):
        jaxsync.value_and_grad(mlp_loss, axis_name="data", deterministic=DET, rules=rules)
    with pytest.raises(ValueError, match=r"`fun\(params, batch\)` with argnums=0, got argnums=1"):
        jaxsync.value_and_grad(mlp_loss, axis_name="data", deterministic=DET, argnums=1)


def test_unit_grads_are_averaged_without_rules(setup):
    """all_reduce_grads docstring: with `deterministic`, `average=True` and no `rules`
    (a sum or a rule would not be the mean over units the exact sum gives)."""
    mesh, params, batch = setup
    summed = lambda g, p: jaxsync.all_reduce_grads(  # noqa: E731
        g, axis_name="data", deterministic=DET, average=False
    )
    with pytest.raises(NotImplementedError, match=r"all_reduce_grads: .*`average` must be True"):
        _lower_unit_grads(mesh, params, batch, summed)
    rules = jaxsync.SyncRules.of({r"scale": jaxsync.Tied("data")})
    tx = jaxsync.sync_grads(axis_name="data", deterministic=DET, rules=rules)
    with pytest.raises(NotImplementedError, match=r"sync_grads: .*and `rules` None"):
        _lower_unit_grads(mesh, params, batch, lambda g, p: tx.update(g, tx.init(p), p)[0])


def test_unit_grads_of_other_units_are_refused(setup):
    mesh, params, batch = setup
    other = jaxsync.Deterministic(units=16)
    reduce = lambda g, p: jaxsync.all_reduce_grads(g, axis_name="data", deterministic=other)  # noqa: E731
    with pytest.raises(ValueError, match=r"made with units=8, but this sync has .*units=16"):
        _lower_unit_grads(mesh, params, batch, reduce)


def test_deterministic_zero_needs_the_data_axes_to_be_the_whole_mesh():
    """README: plain data parallelism only. On a (data, model) mesh with replicated
    params the ZeRO step's exact reduce-scatter would not cover the mesh."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), steps=1, batch=16)
    # An idle "model" axis is refused at init (tests/test_mesh_axes.py); declared as the
    # loss's own, the deterministic step still needs the data axes to be the whole mesh.
    step = jaxsync.train_step(
        mlp_loss, optax.sgd(0.1), mesh, jaxsync.ZeRO(deterministic=DET), loss_axes="model"
    )
    with pytest.raises(NotImplementedError, match=r"data axes \('data',\) to be the whole mesh"):
        step(step.init(params), (xs[0], ys[0]))


# ------------------------------------------------------------------- in-loop sync
def test_in_loop_sync_takes_one_argnum_and_its_own_rules():
    """value_and_grad docstring: with `sync`, `argnums` is one int and `rules` come
    from the sync (one place decides them)."""
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    with pytest.raises(ValueError, match=r"`argnums` must be a single int .* got \(0,\)"):
        jaxsync.value_and_grad(mlp_loss, axis_name="data", sync=tx, argnums=(0,))
    rules = jaxsync.SyncRules.of({r"scale": jaxsync.Tied("data")})
    with pytest.raises(ValueError, match=r"pass `rules` to the sync .*not to value_and_grad"):
        jaxsync.value_and_grad(mlp_loss, axis_name="data", sync=tx, rules=rules)

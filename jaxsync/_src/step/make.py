"""A step's first state and plan from the params, per mode.

What ``TrainStep.init`` and ``abstract_state`` share: the optimizer wrapped for the
mode (ZeRO's distributed optimizer, FSDP's units, DDP's replicated optax), its
state and specs, the guard DDP and FSDP keep beside it, and the :class:`Plan` the
step is compiled from. Traceable (no host reads), so ``abstract_state`` builds the
same state as ``jax.ShapeDtypeStruct``s. Beside it, the placement ``init`` wraps it
in: the params copied (the step donates its state, never the caller's arrays), and
every state buffer distinct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.names import group_of, param_name
from ..core.specs import full_spec
from ..fsdp.fully_shard import fully_shard
from ..fsdp.held import FsdpShards
from ..optim.layerwise import as_written
from ..optim.logged import norms_on, records_rate
from ..optim.loss_scale import init_loss_scale
from ..optim.master import needs_master, with_fp32_master
from ..optim.optimizer import distributed_optimizer
from ..optim.state import initial_metrics
from ..optim.whole_tree import owned_tree
from .held import held_groups, split_stacks, strip
from .modes import DDP, ZeRO
from .parts import Plan
from .train_state import GuardState, TrainState
from .two_d.plan import make_state as make_2d_state

PyTree = Any


def make_state(
    step: Any, model: Any, params: PyTree, rest: PyTree, layout: Any = None
) -> tuple[TrainState, Plan]:
    """The state and its plan from replicated ``params`` (traceable: no host reads);
    with ``layout`` (params sharded over other axes) the 2-D state of :mod:`two_d.plan`.
    ``step`` is the :class:`~jaxsync.TrainStep` (its mesh, optimizer and options)."""
    if layout is not None:
        master = isinstance(step.mode, DDP) and needs_master(params)
        tx = with_fp32_master(step.tx) if master else step.tx
        state, specs, tx, dims = make_2d_state(step, params, rest, layout, tx)
        return state, Plan(model, template_of(params), tx, None, specs, None, dims)  # type: ignore[arg-type]
    mesh, axes, rep = step.mesh, step.axis_name, NamedSharding(step.mesh, P())
    n_leaves = len(jax.tree.leaves(params))
    template = template_of(params)
    fs, tx, mode, groups = None, step.tx, step.mode, ()
    if isinstance(mode, ZeRO):
        tx = distributed_optimizer(
            step.tx, axis_name=axes, bucket_size=mode.bucket_size,
            reduce_dtype=mode.reduce_dtype, clip_grad_norm=step.clip_grad_norm,
            loss_scale=step.loss_scale, rules=mode.rules, stacked=step.stacked or None,
            deterministic=mode.deterministic, labels=step.labels,
            norms=norms_on(step.metrics),
        )  # fmt: skip
        tx._config.unit_prints = prints_of(step)  # before init: its metrics hold them
        # A buffer per stacked param (held.split_stacks): the forward's gathers (held
        # groups, on more than one device) or the update's cast (one device) then
        # land in each param's array, not in a slice copied out of a shared row.
        tx._config.split_stacks = split_stacks(mode)
        opt_state = tx.sharded_init(params, mesh)
        if records_rate(step.metrics, opt_state):  # the rate lives beside ZeRO's norms
            tx._config.rate = True
            zero = jax.device_put(jnp.zeros((), jnp.float32), rep)
            opt_state = opt_state._replace(metrics=opt_state.metrics._replace(learning_rate=zero))
        opt_specs = tx.state_specs(params, mesh)
        groups = held_groups(tx, template, mesh, mode, step.stacked)
        held, n_flags = strip(params, groups), n_leaves
        param_specs = jax.tree.map(lambda _: P(), held)
    elif isinstance(mode, DDP):
        # fp32 master weights for bf16/fp16 params (optim/master.py), as ZeRO keeps.
        tx = with_fp32_master(step.tx) if needs_master(params) else step.tx
        init = jax.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P())
        opt_state = jax.jit(init)(params)
        opt_specs = jax.tree.map(lambda _: P(), opt_state)
        param_specs, held, n_flags = jax.tree.map(lambda _: P(), params), params, n_leaves
    else:
        fs = fully_shard(
            params, axis_name=axes, units=mode.units or default_units(params, step.stacked),
            mesh=mesh, policy=mode.policy, reshard_after_forward=mode.reshard_after_forward,
            stacked=step.stacked or None, labels=step.labels,
        )  # fmt: skip
        shards = fs.shard(params)
        tx = step.tx if step.labels is None else fs.multi_transform(step.tx)
        if step.labels is None and as_written(tx) is not tx:  # muon as written: owned whole
            fs.owned_tree = owned_tree(fs, tx)  # its checkpoint form is read through fs
            tx = fs.owned_tree.transform()
            opt_state, opt_specs = fs.owned_tree.init(params, mesh)
        else:
            opt_state, opt_specs = fs.init_optimizer(tx, shards, mesh)  # over the plain dict
        # state.params says what it holds (not the params) and where they are.
        held, param_specs = FsdpShards(shards, fs.units), FsdpShards(fs.specs(), fs.units)
        n_flags = len(fs.units)
    guard = None
    if not isinstance(mode, ZeRO):
        on, rate = norms_on(step.metrics), records_rate(step.metrics, opt_state)
        units = mode.deterministic.units if prints_of(step) else 0  # DDP: FSDP has none
        metrics = initial_metrics(n_flags, on, rate, units)
        guard = jax.device_put(GuardState(init_loss_scale(step.loss_scale), metrics), rep)
    state = TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), rep),
        params=held,
        opt_state=opt_state,
        model_state=rest,
        guard=guard,
    )
    specs = TrainState(
        step=P(), params=param_specs, opt_state=opt_specs,
        model_state=jax.tree.map(lambda _: P(), rest),
        guard=jax.tree.map(lambda _: P(), guard),
    )  # fmt: skip
    plan = Plan(model, template, tx, fs, specs, None, held=groups)  # type: ignore[arg-type]
    return state, plan


def prints_of(step: Any) -> bool:
    """Whether the step records its units' gradient fingerprints (deterministic mode,
    ``TrainerMetrics(unit_prints=True)``; ``train_step`` refuses them elsewhere)."""
    return step.metrics is not None and step.metrics.unit_prints


def replicated_copy(tree: PyTree, mesh: Mesh) -> PyTree:
    """``tree`` replicated over ``mesh`` in new buffers (``device_put`` may reuse the
    caller's buffer for one device, even with ``may_alias=False``)."""
    placed = jax.device_put(tree, NamedSharding(mesh, P()))
    copy = jax.shard_map(
        lambda t: jax.tree.map(jnp.copy, t), mesh=mesh, in_specs=P(), out_specs=P()
    )
    return jax.jit(copy)(placed)


def template_of(params: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def distinct(tree: PyTree) -> PyTree:
    """``tree`` as the step returns it: specs written out per dimension (``P()`` of
    a matrix is ``P(None, None)``, else the second call would compile again), and
    no buffer twice (shared zeros, tied leaves), since the step donates the state
    and XLA refuses to donate one buffer for two arguments."""
    seen: set[Any] = set()

    def one(x: jax.Array) -> jax.Array:
        spec = x.sharding.spec
        if len(spec) < x.ndim:
            x = jax.device_put(x, NamedSharding(x.sharding.mesh, full_spec(spec, x.ndim)))
        ptrs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        if ptrs & seen:
            x = jax.device_put(x, x.sharding, may_alias=False)
            ptrs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        seen.update(ptrs)
        return x

    return jax.tree.map(one, tree)


def default_units(params: PyTree, stacked: Sequence[str]) -> list[str]:
    """One FSDP unit per top-level entry of the params (stacked groups: their own)."""
    units: dict[str, None] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = param_name(path)
        if group_of(name, stacked) is None:
            units[name.split(".")[0]] = None
    return list(units)

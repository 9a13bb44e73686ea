""":func:`jaxsync.train_step` when params are also sharded over other mesh axes.

A param that arrives with a ``NamedSharding`` over an axis that is not a data
axis (``"model"``) keeps it: the step's ``shard_map`` is manual over the data
axes only and the compiler partitions the model over the others, from the
model's single-device code. jaxsync reduces over the data axes and shards the
optimizer over them, param by param along a free dimension (:mod:`dims`):

- ``"ddp"``: each gradient all-reduced in ``reduce_dtype``; optax state shaped
  and sharded like the params.
- ``"zero"``: each gradient reduce-scattered; fp32 master shards and the optax
  state on them (:class:`SpecZeroState`); new params all-gathered.
- ``"fsdp"``: fp32 param shards held; each gathered where the model uses it and
  its gradient reduce-scattered in the backward.

Stacked groups are reduced (and, for FSDP, gathered) inside the backward scan
by :func:`jaxsync.tap`, as on a 1-D mesh (the step itself: :mod:`two_d.body`).
This module holds the plans, the state and its specs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.axes import mesh_axes_size
from ...core.names import group_of, param_name
from ...core.specs import entry_axes, full_spec, keep_axes
from ...layout.ownership import WholeMatrices
from ...optim.logged import norms_on, records_rate
from ...optim.loss_scale import init_loss_scale
from ...optim.master import MasterState
from ...optim.state import initial_metrics
from ..checks import labeled_tx
from ..train_state import GuardState, TrainState
from .dims import DimPlan, pad, plan_param, unpad

PyTree = Any


class SpecZeroState(NamedTuple):
    """ZeRO's state for compiler-sharded params: fp32 master shards, optax state on them."""

    master: PyTree
    inner: PyTree


def compiler_axes(params: PyTree, data: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes, other than the data axes, that some param is sharded over."""
    found: dict[str, None] = {}
    for x in jax.tree.leaves(params):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        for entry in spec or ():
            for a in entry_axes(entry):
                if a not in data:
                    found[a] = None
    return tuple(found)


def param_spec(x: Any, data: tuple[str, ...]) -> P:
    """A param's spec without the data axes (the step replicates it over those)."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    return keep_axes(full_spec(spec, len(x.shape)), lambda a: a not in data)


def project(spec: P, manual: frozenset[str]) -> P:
    """``spec`` over the manual axes only (what ``shard_map``'s specs may name)."""
    return keep_axes(spec, lambda a: a in manual)


@dataclasses.dataclass(frozen=True, eq=False)
class SpecLayout:
    """The per-param plans of one 2-D step and the axes it is manual over."""

    plans: PyTree  # a DimPlan per param, shaped like the params
    data: tuple[str, ...]
    compiler: tuple[str, ...]
    stacked: tuple[str, ...]

    def leaves(self) -> list[DimPlan]:
        return jax.tree.leaves(self.plans, is_leaf=lambda x: isinstance(x, DimPlan))

    def map(self, fn: Any, *trees: PyTree) -> PyTree:
        return jax.tree.map(fn, self.plans, *trees, is_leaf=lambda x: isinstance(x, DimPlan))

    def manual(self, mesh: Mesh) -> frozenset[str]:
        return frozenset(a for a in mesh.axis_names if a not in self.compiler)


def plan_layout(
    params: PyTree,
    data: tuple[str, ...],
    compiler: Mapping[str, int],
    n: int,
    stacked: tuple,
    whole: frozenset[str] = frozenset(),
) -> SpecLayout:
    def one(path: Any, x: Any) -> DimPlan:
        name = param_name(path)
        layered = group_of(name, stacked) is not None
        spec = param_spec(x, data)
        cut = name not in whole
        return plan_param(name, tuple(x.shape), x.dtype, spec, n, layered, compiler, cut)

    plans = jax.tree_util.tree_map_with_path(one, params)
    return SpecLayout(plans, data, tuple(compiler), stacked)


EXPLICIT_AXES = (
    "jaxsync.train_step: params are sharded over {compiler}, so the step leaves those axes "
    "to the compiler (tensor parallelism by specs), which needs the mesh's axes to be "
    "AxisType.Auto; this mesh has Explicit axes {axes} (jax.make_mesh's default). Build it "
    "with `jax.make_mesh(shape, {names}, axis_types=(jax.sharding.AxisType.Auto,) * "
    "{n})` and place the params on that mesh."
)


def spec_layout(cfg: Any, params: PyTree) -> SpecLayout | None:
    """The 2-D plan of ``params`` (arrays or ShapeDtypeStructs with shardings), or None
    when no param is sharded over an axis other than the data axes."""
    data = cfg.axis_name
    compiler = compiler_axes(params, data)
    if not compiler:
        return None
    n = mesh_axes_size(cfg.mesh, data, "jaxsync.train_step")
    explicit = [
        a for a, t in zip(cfg.mesh.axis_names, cfg.mesh.axis_types, strict=True)
        if t == AxisType.Explicit
    ]  # fmt: skip
    if explicit:
        raise ValueError(
            EXPLICIT_AXES.format(
                axes=explicit, compiler=list(compiler), names=cfg.mesh.axis_names,
                n=len(cfg.mesh.axis_names),
            )
        )  # fmt: skip
    sizes = {a: cfg.mesh.shape[a] for a in compiler}
    if n == 1:
        # XLA's partitioner refuses a partially manual step whose manual axes have one
        # device ("Cross-partition allreduce must be in (partial) manual partitioning
        # mode", an internal error): say so here, with what to do.
        raise ValueError(
            f"jaxsync.train_step: the data axes {list(data)} have 1 device, and the params "
            f"are sharded over {sizes}. With one data-parallel device there is no gradient "
            "to sync: jit the step with the params' NamedShardings (the compiler then "
            "partitions it over the other axes), or give the data axes 2 or more devices."
        )
    return plan_layout(params, data, sizes, n, cfg.stacked, _owned_names(cfg, params))


def _owned_names(cfg: Any, params: PyTree) -> frozenset[str]:
    """Params of :func:`jaxsync.whole_matrices` labels: kept whole over the data axes
    (the optimizer must see each matrix whole; 1-D steps own each on one rank)."""
    tx, labels = cfg.tx, cfg.labels
    if not isinstance(tx, Mapping) or labels is None:
        return frozenset()
    owned = {k for k, v in tx.items() if isinstance(v, WholeMatrices)}
    tree = labels(params) if callable(labels) else labels
    return frozenset(
        param_name(path)
        for path, label in jax.tree_util.tree_flatten_with_path(tree)[0]
        if label in owned
    )


def make_state(
    cfg: Any, params: PyTree, rest: PyTree, layout: SpecLayout, tx: Any = None
) -> tuple[TrainState, TrainState, Any, SpecLayout]:
    """``(state, full specs, optimizer, layout)`` for compiler-sharded ``params``
    (traceable: the shardings come from ``layout``); ``tx``: the optimizer to build
    the state for (default ``cfg.tx``; DDP's over fp32 masters, optim/master.py)."""
    mesh, data = cfg.mesh, cfg.axis_name
    tx = cfg.tx if tx is None else tx
    if isinstance(tx, Mapping):  # zero/fsdp parameter groups (ddp's tx is wrapped already)
        tx = labeled_tx(tx, cfg.labels, cfg.stacked)
    sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    param_specs = layout.map(lambda p: P(*p.spec))
    shard_specs = layout.map(lambda p: p.shard_spec(data))
    params = jax.jit(
        lambda t: jax.tree.map(jnp.copy, t), out_shardings=jax.tree.map(sharding, param_specs)
    )(params)
    if cfg.mode.name == "ddp":
        held, held_specs, trained = params, param_specs, params
    else:
        master = jax.jit(
            lambda t: layout.map(lambda p, x: pad(x.astype(jnp.float32), p), t),
            out_shardings=jax.tree.map(sharding, shard_specs),
        )(params)
        trained = master
        fsdp = cfg.mode.name == "fsdp"
        held, held_specs = (master, shard_specs) if fsdp else (params, param_specs)
    inner_specs = _state_specs(tx, trained, shard_specs if cfg.mode.name != "ddp" else param_specs)
    inner = jax.jit(tx.init, out_shardings=jax.tree.map(sharding, inner_specs))(trained)
    opt_state, opt_specs = inner, inner_specs
    if cfg.mode.name == "zero":
        opt_state = SpecZeroState(trained, inner)
        opt_specs = SpecZeroState(shard_specs, inner_specs)
    rep = NamedSharding(mesh, P())
    on, rate = norms_on(cfg.metrics), records_rate(cfg.metrics, inner)
    metrics = initial_metrics(len(layout.leaves()), on, rate)
    guard = jax.device_put(GuardState(init_loss_scale(cfg.loss_scale), metrics), rep)
    state = TrainState(jax.device_put(jnp.zeros((), jnp.int32), rep), held, opt_state, rest, guard)
    specs = TrainState(
        P(), held_specs, opt_specs, jax.tree.map(lambda _: P(), rest),
        jax.tree.map(lambda _: P(), guard),
    )  # fmt: skip
    return state, specs, tx, layout


def _state_specs(tx: Any, params: PyTree, specs: PyTree) -> PyTree:
    """Specs of ``tx``'s state: a leaf whose path ends in a param's path and has its
    shape (Adam's ``mu["blocks"]["qkv"]``, a ``multi_transform`` group's too) is
    sharded like that param; the rest (counts, scalars) is replicated.

    (``optax.tree_map_params`` cannot see through a ``multi_transform`` with a
    fixed labels tree: it inits on one placeholder.)
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs_ = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    named = {param_name(path): (x.shape, s) for (path, x), s in zip(flat, specs_, strict=True)}
    return specs_by_param(jax.eval_shape(tx.init, params), named)


def specs_by_param(tree: PyTree, named: Mapping[str, tuple[tuple[int, ...], P]]) -> PyTree:
    """Each leaf of ``tree`` (an optax state, or a portable form of it) with the spec of
    the param whose name ends its path and whose shape it has; ``P()`` otherwise.
    ``named``: ``{param name: (shape, spec)}``."""

    def one(path: Any, x: Any) -> P:
        name = param_name(path)
        for k, (shape, spec) in named.items():
            if (name == k or name.endswith("." + k)) and tuple(x.shape) == tuple(shape):
                return spec
        return P()

    return jax.tree_util.tree_map_with_path(one, tree)


# ------------------------------------------------------------- the state API


def spec_params(cfg: Any, plan: Any, state: TrainState) -> PyTree:
    """The whole params in their own dtypes and shardings (FSDP: gathered)."""
    if cfg.mode.name != "fsdp":
        return state.params
    return _unsharded(cfg, plan, state.params, cast=True)


def spec_master(cfg: Any, plan: Any, state: TrainState) -> PyTree:
    """The fp32 master weights, whole, sharded like the params."""
    if cfg.mode.name == "ddp":
        if isinstance(state.opt_state, MasterState):
            return state.opt_state.master
        return jax.tree.map(lambda x: x.astype(jnp.float32), state.params)
    held = state.params if cfg.mode.name == "fsdp" else state.opt_state.master
    return _unsharded(cfg, plan, held, cast=False)


def _unsharded(cfg: Any, plan: Any, shards: PyTree, cast: bool) -> PyTree:
    return _unshard_fn(plan.dims, cfg.mesh, cast)(shards)


@functools.cache
def _unshard_fn(layout: SpecLayout, mesh: Mesh, cast: bool) -> Any:
    """One jitted unpad (and cast) per layout: ``step.params`` each step compiles once."""
    out = layout.map(lambda p: NamedSharding(mesh, P(*p.spec)))

    def fn(t: PyTree) -> PyTree:
        return layout.map(lambda p, x: unpad(x, p).astype(p.dtype if cast else x.dtype), t)

    return jax.jit(fn, out_shardings=out)

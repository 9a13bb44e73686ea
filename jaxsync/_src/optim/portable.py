"""A form of the sharded optimizer state that does not depend on the DP size.

On device the state is flat shards whose boundaries depend on the number of
ranks, the bucket size and the padding. On disk we want one array per parameter
(and per shard-shaped optimizer leaf), so a run saved on 8 ranks resumes on 4:
``to_portable`` maps shards -> per-parameter arrays and ``from_portable`` maps
them back onto whatever layout the new mesh gives. Params sharded over tensor,
pipeline or expert axes are reassembled into their global arrays by their
PartitionSpecs, so only the data-parallel size may change. Both run as one jitted
program over the global arrays; XLA moves the data between devices (no host
gathers), and the per-parameter outputs stay sharded over the data axis where
their leading dimension allows, so orbax writes them from every host in parallel.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.cpu_order import put, settle
from ..core.names import param_name
from ..layout.buffer_names import buffer_name, saved_entry
from ..layout.layout import Layout
from . import layerwise
from .loss_scale import LossScaleState
from .state import DistributedOptimizerState, metrics_from

PyTree = Any


def slot_names(layout: Layout, params: PyTree) -> list[str]:
    return [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def owned_of(plan: Any, layout: Layout, buffer: int) -> Any:
    """The :class:`WholeMatrices` transformation of an owned buffer, else None."""
    key = layout.buffers[buffer].key
    return None if key.owned is None else plan.transform_of(key.label)


def _auto(mesh: Mesh) -> Mesh:
    # The conversion needs XLA to move data between devices freely (GSPMD), which
    # Explicit axes forbid; the same devices with Auto axes change nothing else.
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def param_sharding(mesh: Mesh, axes: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    spec = P(axes) if shape and shape[0] % n == 0 else P()
    return NamedSharding(mesh, spec)


def _entries(spec: P, ndim: int) -> list[tuple[str, ...]]:
    """Mesh axes of each array dimension in ``spec`` (``()`` where unsharded)."""
    out = []
    for d in range(ndim):
        e = spec[d] if d < len(spec) else None
        out.append(() if e is None else ((e,) if isinstance(e, str) else tuple(e)))
    return out


def assemble(stacked: jax.Array, spec: P, varying: tuple[str, ...]) -> jax.Array:
    """``(*n_varying, *local)`` pieces of a param -> the global param (by ``spec``)."""
    nv = len(varying)
    local = stacked.shape[nv:]
    perm, shape = [], []
    for d, axes in enumerate(_entries(spec, len(local))):
        perm += [varying.index(a) for a in axes] + [nv + d]
        shape.append(local[d] * int(np.prod([stacked.shape[varying.index(a)] for a in axes])))
    return jnp.transpose(stacked, perm).reshape(shape)


def disassemble(
    full: jax.Array, spec: P, varying: tuple[str, ...], sizes: dict[str, int]
) -> jax.Array:
    """Inverse of :func:`assemble`: the global param -> ``(*n_varying, *local)`` pieces."""
    entries = _entries(spec, full.ndim)
    split, order = [], []
    for d, axes in enumerate(entries):
        n = int(np.prod([sizes[a] for a in axes]))
        split += [sizes[a] for a in axes] + [full.shape[d] // n]
        order += list(axes) + [None]
    x = full.reshape(split)
    pos = {a: i for i, a in enumerate(order) if a is not None}
    local = [i for i, a in enumerate(order) if a is None]
    return jnp.transpose(x, [pos[a] for a in varying] + local)


def _row_specs(layout: Layout, buffer: int, specs: list[P]) -> list[P]:
    """Specs of one layer's slice: a stacked leaf's spec without its layer entry."""
    if not layout.buffers[buffer].layers:
        return specs
    return [P(*tuple(s)[1:]) for s in specs]


def shards_to_params(
    layout: Layout,
    buffer: int,
    global_shards: jax.Array,
    names: list[str],
    specs: list[P],
    sizes: dict[str, int],
) -> dict[str, jax.Array]:
    """Global shard array of one buffer -> ``{param name: global param array}``.

    The global array is laid out as ``(dp ranks, *varying axes, shard)``, the
    order of the buffer's ``P(axes + varying)`` spec; a stacked buffer has a
    leading layer axis, converted layer by layer.
    """
    buf = layout.buffers[buffer]
    rows = _row_specs(layout, buffer, specs)
    if buf.layers:
        return jax.vmap(lambda g: _row_to_params(layout, buffer, g, names, rows, sizes))(
            global_shards
        )
    return _row_to_params(layout, buffer, global_shards, names, rows, sizes)


def _row_to_params(
    layout: Layout,
    buffer: int,
    global_shards: jax.Array,
    names: list[str],
    specs: list[P],
    sizes: dict[str, int],
) -> dict[str, jax.Array]:
    buf = layout.buffers[buffer]
    varying = buf.key.varying
    nv = [sizes[a] for a in varying]
    x = global_shards.reshape(buf.num_shards, *nv, -1)
    x = jnp.moveaxis(x, 0, -2).reshape(-1, buf.num_shards, x.shape[-1])
    flat = jax.vmap(lambda st: layout.gather_shards(buffer, st))(x).reshape(*nv, -1)
    out = {}
    for si in buf.slots:
        slot = layout.slots[si]
        if slot.pieces:  # an owned stacked param: its layers lie apart
            rows = [flat[..., p : p + slot.size] for p in slot.pieces]
            out[names[si]] = jnp.stack(rows).reshape(slot.shape)
            continue
        piece = flat[..., slot.start : slot.end].reshape(*nv, *slot.row_shape)
        out[names[si]] = assemble(piece, specs[si], varying) if varying else piece
    return out


def params_to_shards(
    layout: Layout,
    buffer: int,
    arrays: dict[str, jax.Array],
    names: list[str],
    specs: list[P],
    sizes: dict[str, int],
) -> jax.Array:
    """Inverse of :func:`shards_to_params`, for (possibly) another layout and mesh."""
    buf = layout.buffers[buffer]
    rows = _row_specs(layout, buffer, specs)
    if buf.layers:
        mine = {names[si]: arrays[names[si]] for si in buf.slots}
        return jax.vmap(lambda a: _params_to_row(layout, buffer, a, names, rows, sizes))(mine)
    return _params_to_row(layout, buffer, arrays, names, rows, sizes)


def _params_to_row(
    layout: Layout,
    buffer: int,
    arrays: dict[str, jax.Array],
    names: list[str],
    specs: list[P],
    sizes: dict[str, int],
) -> jax.Array:
    buf = layout.buffers[buffer]
    varying = buf.key.varying
    nv = [sizes[a] for a in varying]
    dtype = next(iter(arrays.values())).dtype
    flat = jnp.zeros((*nv, buf.size), dtype)
    for si in buf.slots:
        slot = layout.slots[si]
        piece = arrays[names[si]]
        if slot.pieces:  # an owned stacked param: its layers lie apart
            rows = piece.reshape(slot.layers, slot.size)
            for layer, p in enumerate(slot.pieces):
                flat = flat.at[..., p : p + slot.size].set(rows[layer])
            continue
        if varying:
            piece = disassemble(piece, specs[si], varying, sizes)
        flat = flat.at[..., slot.start : slot.end].set(piece.reshape(*nv, slot.size))
    parts = [flat[..., b.start : b.end].reshape(*nv, buf.num_shards, -1) for b in buf.buckets]
    x = jnp.concatenate(parts, axis=-1)
    return jnp.moveaxis(x, -2, 0).reshape(-1)


def global_shape(shape: tuple[int, ...], spec: P, sizes: dict[str, int]) -> tuple[int, ...]:
    """Global shape of an array whose per-device shape is ``shape`` under ``spec``."""
    return tuple(
        d * math.prod(sizes[a] for a in axes)
        for d, axes in zip(shape, _entries(spec, len(shape)), strict=True)
    )


def signature(tree: PyTree) -> tuple[Any, ...]:
    """Hashable structure, shapes, dtypes and PartitionSpecs of ``tree``'s leaves.

    A step computes it on every call (its plan is looked up by it), so each
    sharding's spec is read once (:func:`_spec_key`), not per leaf and call.
    """
    leaves, treedef = jax.tree.flatten(tree)
    return (
        treedef,
        tuple(
            (tuple(x.shape), x.dtype, _spec_key(getattr(x, "sharding", None), len(x.shape)))
            for x in leaves
        ),
    )


@functools.lru_cache(maxsize=4096)
def _spec_key(sharding: Any, ndim: int) -> tuple[tuple[str, ...], ...]:
    # As param_specs_of reads it (no NamedSharding means P()), normalised per
    # dimension, so P() and P(None, None) are the same; an axis of size 1
    # splits nothing (XLA returns P() for P("data") on a 1-GPU mesh).
    if not isinstance(sharding, NamedSharding):
        return tuple(_entries(P(), ndim))
    sizes = sharding.mesh.shape
    return tuple(tuple(a for a in axes if sizes[a] > 1) for axes in _entries(sharding.spec, ndim))


# Conversion programs by caller-given key, so a run that saves every N steps
# compiles each conversion once, not at every save.
_PROGRAMS: dict[Any, Any] = {}
_MAX_PROGRAMS = 64


def convert(fn: Any, args: Any, mesh: Mesh, out_shardings: Any, *, key: Any = None) -> Any:
    """Runs ``fn(*args)`` jitted on an Auto-axes view of ``mesh``.

    With ``key`` (everything ``fn`` depends on besides its arguments' values),
    the compiled program is reused by later calls with the same key.
    """
    auto = _auto(mesh)
    # Each put below may be a reshard program with collectives: one at a time, and
    # none while the step that made the arrays is still running (cpu_order).
    args = jax.tree.map(
        lambda x: (
            put(settle(x), NamedSharding(auto, x.sharding.spec))
            if isinstance(getattr(x, "sharding", None), NamedSharding)
            else x
        ),
        args,
    )
    jitted = _PROGRAMS.get(key) if key is not None else None
    if jitted is None:
        outs = jax.tree.map(
            lambda s: NamedSharding(auto, s.spec),
            out_shardings,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        jitted = jax.jit(fn, out_shardings=outs)
        if key is not None:
            if len(_PROGRAMS) >= _MAX_PROGRAMS:
                _PROGRAMS.pop(next(iter(_PROGRAMS)))
            _PROGRAMS[key] = jitted
    out = settle(jitted(*args))  # callers convert per label or slot: cpu_order
    return jax.tree.map(put, out, out_shardings)


def from_portable(
    plan: Any, portable: dict[str, Any], params: PyTree, mesh: Mesh
) -> DistributedOptimizerState:
    """Inverse of :meth:`to_portable` onto ``mesh``, whose DP size may differ."""
    layout, _, pspecs = plan.layout_outside(params, mesh)
    pspecs = jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P))
    sizes = dict(mesh.shape)
    names = slot_names(layout, params)
    specs = plan.state_specs(params, mesh)
    missing = sorted(set(names) - set(portable.get("master", {})))
    if missing:
        raise ValueError(
            f"the saved optimizer state has no master values for params {missing}; "
            "it was saved for a different model."
        )

    every = frozenset(names)

    def fn(portable: dict[str, Any]) -> DistributedOptimizerState:
        master, inner = [], []
        for bi in range(len(layout.buffers)):
            master.append(params_to_shards(layout, bi, portable["master"], names, pspecs, sizes))
            mine = frozenset(names[si] for si in layout.buffers[bi].slots)
            saved = saved_entry(portable["inner_state"], buffer_name(layout, bi), mine, every)
            owned = owned_of(plan, layout, bi)
            if owned is not None:
                inner.append(layerwise.from_portable(layout, bi, owned, saved, names))
                continue
            inner.append(
                jax.tree.map(
                    lambda s, x, bi=bi: (
                        params_to_shards(layout, bi, x, names, pspecs, sizes) if s != P() else x
                    ),
                    specs.inner_state[bi],
                    saved,
                    is_leaf=lambda x: isinstance(x, P),
                )
            )
        return DistributedOptimizerState(
            master=tuple(master),
            inner_state=tuple(inner),
            loss_scale=LossScaleState(*portable["loss_scale"]),
            metrics=metrics_from(portable["metrics"], plan.norms, plan.rate, plan.unit_prints),
        )

    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    key = ("from_portable", plan, signature(params), signature(portable), mesh)
    return convert(fn, (portable,), mesh, shardings, key=key)


def _merged(a: Any, b: Any) -> Any:
    """Two buffers' portable states of one structure: ``{param: array}`` dicts united,
    anything else (step counts, equal in both) taken from ``a``."""
    is_named = lambda x: isinstance(x, dict) and bool(x)  # noqa: E731
    leaves_a, treedef = jax.tree.flatten(a, is_leaf=is_named)
    leaves_b = treedef.flatten_up_to(b)
    return treedef.unflatten(
        [{**x, **y} if is_named(x) else x for x, y in zip(leaves_a, leaves_b, strict=True)]
    )


def portable_fn(plan: Any, params: PyTree, mesh: Mesh) -> tuple[Any, Any, Any]:
    """(fn: global state -> portable dict, its output shardings, abstract global state)."""
    layout, local, pspecs = plan.layout_outside(params, mesh)
    pspecs = jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P))
    sizes = dict(mesh.shape)
    names = slot_names(layout, params)
    specs = plan.state_specs(params, mesh)
    axes = plan.axes
    leaves = jax.tree.leaves(params)
    by_name = {names[i]: (tuple(leaves[i].shape), pspecs[i]) for i in range(len(names))}

    def fn(state: DistributedOptimizerState) -> dict[str, Any]:
        def to_params(bi: int, x: jax.Array) -> dict[str, jax.Array]:
            return shards_to_params(layout, bi, x, names, pspecs, sizes)

        master: dict[str, jax.Array] = {}
        inner = {}
        for bi in range(len(layout.buffers)):
            master.update(to_params(bi, state.master[bi]))
            owned = owned_of(plan, layout, bi)
            if owned is not None:
                inner[buffer_name(layout, bi)] = layerwise.to_portable(
                    layout, bi, owned, state.inner_state[bi], names
                )
                continue
            mine = jax.tree.map(
                lambda s, x, bi=bi: to_params(bi, x) if s != P() else x,
                specs.inner_state[bi],
                state.inner_state[bi],
                is_leaf=lambda x: isinstance(x, P),
            )
            name = buffer_name(layout, bi)
            # Buffers that differ only in their part (a buffer per stacked param) save
            # as one: their per-param entries together, their counts (equal) once. So
            # the form does not depend on how a step splits its buffers.
            inner[name] = mine if name not in inner else _merged(inner[name], mine)
        return {
            "master": master,
            "inner_state": inner,
            "loss_scale": tuple(state.loss_scale),
            "metrics": tuple(x for x in state.metrics if x is not None),
        }

    def sharding_for(path: Any, x: Any) -> NamedSharding:
        # Per-param arrays: sharded like the param where it is model-parallel,
        # else over the data axes where the leading dimension divides.
        name = param_name(path[-1:]) if path else ""
        shape = tuple(getattr(x, "shape", ()))
        if name in by_name and shape == by_name[name][0]:
            if by_name[name][1] != P():
                return NamedSharding(mesh, by_name[name][1])
            return param_sharding(mesh, axes, shape)
        return NamedSharding(mesh, P())

    abstract = jax.eval_shape(lambda p: plan.init_for_rank(p, layout, lambda _: 0), local)
    glob = jax.tree.map(
        # None: metrics a step does not record (optim.logged)
        lambda x, s: (
            None if x is None else jax.ShapeDtypeStruct(global_shape(x.shape, s, sizes), x.dtype)
        ),
        abstract,
        specs,
        is_leaf=lambda x: isinstance(x, P) or x is None,
    )
    out = jax.tree_util.tree_map_with_path(sharding_for, jax.eval_shape(fn, glob))
    return fn, out, glob

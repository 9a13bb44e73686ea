"""The owner's side of whole-matrix ownership: ``inner`` on whole matrices, state packed.

An owned buffer's shard on rank ``r`` holds rank ``r``'s matrices whole (see
:mod:`ownership`). Here that shard becomes a transformation the distributed
optimizer runs like any inner one (``init(master shard)``,
``update(grad shard, state, master shard)``): it cuts the shard into its
matrices, runs ``inner`` on each on its own, and packs the new state.

Ranks own different matrices, but SPMD needs one program and one state shape:
the update is a ``lax.switch`` on the rank with one branch per rank (each runs
only its own matrices, so the compute is the balanced one), and each rank's
state is packed into one 1-D vector per dtype, padded to the largest rank's.
Per-matrix state leaves become per-param arrays in the portable form, so a
checkpoint restores on any data-parallel size (ownership is recomputed there).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..core.axes import rank as axis_rank
from ..core.axes import to_varying
from ..core.introspect import factories, is_muon
from ..layout.layout import Layout
from ..layout.ownership import CROSS_PARAM, WholeMatrices

PyTree = Any


class Unit(NamedTuple):
    """One owned matrix: a param, or one layer of a stacked param."""

    slot: int
    layer: int | None
    shape: tuple[int, ...]
    offset: int  # in the owner's shard


class LeafAt(NamedTuple):
    """Where one state leaf of one unit lives in its rank's packed vector."""

    unit: int  # index into the rank's units
    leaf: int
    dtype: str
    offset: int
    shape: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def owned_units(layout: Layout, buffer: int) -> tuple[tuple[Unit, ...], ...]:
    """Per rank, its units in shard order."""
    buf = layout.buffers[buffer]
    n = buf.num_shards
    offsets = layout.bucket_shard_offsets(buffer)
    per_rank: list[list[Unit]] = [[] for _ in range(n)]
    for si in buf.slots:
        slot = layout.slots[si]
        for start, layer in slot.spans():
            shape = slot.row_shape if layer is not None else slot.shape
            b = next(k for k, bk in enumerate(buf.buckets) if bk.start <= start < bk.end)
            piece = buf.buckets[b].size // n
            r, off = divmod(start - buf.buckets[b].start, piece)
            per_rank[r].append(Unit(si, layer, shape, offsets[b] + off))
    return tuple(tuple(sorted(u, key=lambda x: x.offset)) for u in per_rank)


class UnitTx(NamedTuple):
    """``inner`` as one unit sees it: on the bare matrix, or (``tree``) in the param tree."""

    init: Callable[[jax.Array], Any]
    update: Callable[..., tuple[jax.Array, Any]]


def unit_tx(layout: Layout, whole: WholeMatrices, u: Unit) -> UnitTx:
    """``whole.inner`` on unit ``u`` alone. A ``tree`` optimizer (muon with its own
    dimension numbers) gets the param tree with every other param an
    ``optax.MaskedNode``, as ``optax.multi_transform`` hands it on one device."""
    inner = whole.inner
    if not whole.tree:
        return UnitTx(inner.init, inner.update)
    n = len(layout.slots)

    def tree(x: jax.Array | None) -> Any:
        if x is None:
            return None
        leaves: list[Any] = [optax.MaskedNode()] * n
        leaves[u.slot] = x
        return jax.tree.unflatten(layout.treedef, leaves)

    def update(g: jax.Array, s: Any, m: jax.Array | None = None) -> tuple[jax.Array, Any]:
        out, s = inner.update(tree(g), s, tree(m))
        return jax.tree.leaves(out)[0], s

    return UnitTx(lambda x: inner.init(tree(x)), update)


def _template(layout: Layout, whole: WholeMatrices, u: Unit) -> tuple[Any, list[Any]]:
    init = unit_tx(layout, whole, u).init
    state = jax.eval_shape(init, jax.ShapeDtypeStruct(u.shape, jnp.float32))
    leaves, treedef = jax.tree.flatten(state)
    return treedef, leaves


class StatePlan(NamedTuple):
    """Static packing of every rank's per-matrix states into one vector per dtype."""

    sizes: tuple[tuple[str, int], ...]  # (dtype, padded length), dtypes sorted
    leaves: tuple[tuple[LeafAt, ...], ...]  # per rank
    treedefs: tuple[tuple[Any, ...], ...]  # per rank, per unit


@functools.lru_cache(maxsize=256)
def state_plan(layout: Layout, buffer: int, whole: WholeMatrices) -> StatePlan:
    units = owned_units(layout, buffer)
    templates: dict[tuple[int, ...], Any] = {}
    fill: list[dict[str, int]] = []
    leaves, treedefs = [], []
    for mine in units:
        at, defs, pos = [], [], {}
        for ui, u in enumerate(mine):
            key = (u.slot if whole.tree else None, u.shape)  # tree: the state says where
            if key not in templates:
                templates[key] = _template(layout, whole, u)
            treedef, tl = templates[key]
            defs.append(treedef)
            for li, leaf in enumerate(tl):
                dt = jnp.dtype(leaf.dtype).name
                at.append(LeafAt(ui, li, dt, pos.get(dt, 0), tuple(leaf.shape)))
                pos[dt] = pos.get(dt, 0) + math.prod(leaf.shape)
        fill.append(pos)
        leaves.append(tuple(at))
        treedefs.append(tuple(defs))
    dtypes = sorted({d for f in fill for d in f})
    sizes = tuple((d, max(max(f.get(d, 0) for f in fill), 1)) for d in dtypes)
    return StatePlan(sizes, tuple(leaves), tuple(treedefs))


def unpack_states(plan: StatePlan, r: int, packed: dict[str, jax.Array]) -> list[Any]:
    """Rank ``r``'s packed vectors -> one state tree per unit."""
    per_unit: list[list[Any]] = [[] for _ in plan.treedefs[r]]
    for at in plan.leaves[r]:
        n = math.prod(at.shape)
        per_unit[at.unit].append(packed[at.dtype][at.offset : at.offset + n].reshape(at.shape))
    return [jax.tree.unflatten(d, x) for d, x in zip(plan.treedefs[r], per_unit, strict=True)]


def pack_states(plan: StatePlan, r: int, states: list[Any]) -> dict[str, jax.Array]:
    """Inverse of :func:`unpack_states`, padded to the common length per dtype."""
    flat = [jax.tree.leaves(s) for s in states]
    parts: dict[str, list[jax.Array]] = {d: [] for d, _ in plan.sizes}
    for at in plan.leaves[r]:
        parts[at.dtype].append(jnp.ravel(flat[at.unit][at.leaf]).astype(at.dtype))
    return {d: _fill(parts[d], n, d) for d, n in plan.sizes}


def _fill(parts: list[jax.Array], n: int, dtype: str) -> jax.Array:
    used = sum(p.shape[0] for p in parts)
    if used < n:
        parts = [*parts, jnp.zeros((n - used,), dtype)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _matrices(units: tuple[Unit, ...], shard: jax.Array) -> list[jax.Array]:
    return [shard[u.offset : u.offset + math.prod(u.shape)].reshape(u.shape) for u in units]


def _shard_of(units: tuple[Unit, ...], mats: list[jax.Array], size: int) -> jax.Array:
    parts, pos = [], 0
    for u, m in zip(units, mats, strict=True):
        if u.offset > pos:
            parts.append(jnp.zeros((u.offset - pos,), jnp.float32))
        parts.append(jnp.ravel(m).astype(jnp.float32))
        pos = u.offset + math.prod(u.shape)
    return _fill(parts, size, "float32")


def _by_rank(
    rank: int | jax.Array | None, axes: tuple[str, ...], branches: list[Callable[..., Any]], *args
) -> Any:
    """``branches[rank](*args)``: a plain call for a static rank, else a ``lax.switch``."""
    if isinstance(rank, int):
        return branches[rank](*args)
    if rank is None:
        rank = axis_rank(axes)
    # Every branch's outputs typed device-varying alike (an idle rank makes zeros).
    return jax.lax.switch(rank, [lambda *a, b=b: to_varying(b(*a), axes) for b in branches], *args)


def owned_transform(
    layout: Layout, buffer: int, whole: WholeMatrices, rank: int | jax.Array | None = None
) -> optax.GradientTransformation:
    """``whole.inner`` run on each matrix of this rank's shard of an owned buffer.

    Args:
      rank: this rank's index over the buffer's axes (static or traced); None:
        read it from the mesh (inside shard_map).
    """
    units = owned_units(layout, buffer)
    plan = state_plan(layout, buffer, whole)
    size = layout.shard_size(buffer)
    axes = layout.buffers[buffer].key.axes
    txs = [[unit_tx(layout, whole, u) for u in mine] for mine in units]

    def init_fn(master: jax.Array) -> dict[str, jax.Array]:
        def branch(r: int) -> Callable[..., Any]:
            def run(m: jax.Array) -> dict[str, jax.Array]:
                mats = _matrices(units[r], m)
                return pack_states(plan, r, [t.init(x) for t, x in zip(txs[r], mats, strict=True)])

            return run

        return _by_rank(rank, axes, [branch(r) for r in range(len(units))], master)

    def update_fn(
        grads: jax.Array, state: dict[str, jax.Array], params: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        def branch(r: int) -> Callable[..., Any]:
            def run(g: jax.Array, s: dict[str, jax.Array], m: jax.Array) -> Any:
                gs, ms = _matrices(units[r], g), _matrices(units[r], m)
                out, new = [], []
                states = unpack_states(plan, r, s)
                for t, gu, su, mu in zip(txs[r], gs, states, ms, strict=True):
                    u, s2 = t.update(gu, su, mu)
                    out.append(u)
                    new.append(s2)
                return _shard_of(units[r], out, size), pack_states(plan, r, new)

            return run

        branches = [branch(r) for r in range(len(units))]
        return _by_rank(rank, axes, branches, grads, state, params)

    return optax.GradientTransformation(init_fn, update_fn)


# ------------------------------------------------------------------ portable form
def to_portable(
    layout: Layout,
    buffer: int,
    whole: WholeMatrices,
    packed: dict[str, jax.Array],
    names: list[str],
) -> dict[str, Any]:
    """Global packed state (``[N * length]`` per dtype) -> ``{param name: state}``.

    A stacked param's state leaves get a leading layer axis.
    """
    plan = state_plan(layout, buffer, whole)
    units = owned_units(layout, buffer)
    n = len(units)
    rows = {d: packed[d].reshape(n, -1) for d, _ in plan.sizes}
    per_slot: dict[int, dict[int | None, Any]] = {}
    for r, mine in enumerate(units):
        states = unpack_states(plan, r, {d: rows[d][r] for d in rows})
        for u, s in zip(mine, states, strict=True):
            per_slot.setdefault(u.slot, {})[u.layer] = s
    out = {}
    for si, by_layer in per_slot.items():
        if None in by_layer:
            out[names[si]] = by_layer[None]
        else:
            layers = [by_layer[k] for k in sorted(by_layer)]
            out[names[si]] = jax.tree.map(lambda *x: jnp.stack(x), *layers)
    return out


def from_portable(
    layout: Layout, buffer: int, whole: WholeMatrices, saved: dict[str, Any], names: list[str]
) -> dict[str, jax.Array]:
    """Inverse of :func:`to_portable` for this layout (any data-parallel size)."""
    plan = state_plan(layout, buffer, whole)
    units = owned_units(layout, buffer)
    per_rank: dict[str, list[jax.Array]] = {d: [] for d, _ in plan.sizes}
    for r, mine in enumerate(units):
        states = []
        for u in mine:
            s = saved[names[u.slot]]
            states.append(s if u.layer is None else jax.tree.map(lambda x, u=u: x[u.layer], s))
        for d, vec in pack_states(plan, r, states).items():
            per_rank[d].append(vec)
    return {d: jnp.concatenate(v) for d, v in per_rank.items()}


def as_written(tx: Any) -> Any:
    """A bare ``optax.contrib.muon`` (with its own dimension numbers or not), run as
    the user wrote it: every param it gets owned whole by one rank and handed to it in
    the param tree (:func:`jaxsync.whole_matrices` with ``tree=True``), which is what
    it computes on one device. Muon and its Adam treat each param on its own, so this
    is exact; flat shards would cut its matrices apart. Anything else is returned as
    it is (and probed)."""
    if isinstance(tx, WholeMatrices) or not is_muon(tx) or factories(tx) & CROSS_PARAM:
        return tx
    return WholeMatrices(tx, "muon", tree=True)

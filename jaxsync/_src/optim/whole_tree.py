"""A per-param optimizer that is not elementwise, run as written inside an FSDP step,
each param owned whole by one rank.

FSDP keeps each unit's params as flat shards that cut params apart, and runs the
optimizer on those shards: right for elementwise optimizers only. Muon with its own
dimension numbers (Newton-Schulz on the matrices it names, its Adam elsewhere) needs
each param whole and in the param tree its routing reads. :class:`OwnedTree` gives
it that the way ZeRO's ``jaxsync.whole_matrices(tx, tree=True)`` does: every param (a
stacked ``[L, D, D]`` one whole too) is owned by one data-parallel rank, placed by
the same LPT balancing (:func:`~jaxsync._src.layout.ownership.place_owned`) in an
owned flat layout over the FSDP axes, and run by the same owner's code
(:func:`~jaxsync._src.optim.layerwise.owned_transform`: the param handed to ``tx``
in the param tree, every other param an ``optax.MaskedNode``). So the owner alone
holds that param's state and computes its update; the state per device is about
1/N of the optimizer's.

Inside the step, each rank sends every owner the part of the owner's params its
FSDP shards hold (one all-to-all of the reduced gradient, one of the fp32 params:
static blocks, :func:`routes`), the owner runs ``tx`` on its params whole, and a
third all-to-all sends each rank the columns of the update that its FSDP shards
hold. Each element moves once per exchange (a message is padded to the longest
one); nothing is whole on every rank. Equal to the optimizer on one device.

The state is ``OwnedTreeState``: one packed vector per dtype, ``[N * length]``
sharded over the data axes (layerwise's packing). Its checkpoint form is per param
(:meth:`OwnedTree.to_portable`, the form of ZeRO's owned state), so a checkpoint
restores at any data-parallel size, ownership recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..layout.layout import Layout
from ..layout.ownership import WholeMatrices
from ..layout.placement import build_layout
from ..layout.records import BufferKey
from . import layerwise

PyTree = Any


class OwnedTreeState(NamedTuple):
    """State of :meth:`OwnedTree.transform`.

    Attributes:
      packed: ``{dtype name: [N * length]}``: rank ``r``'s slice packs the state of
        the params it owns (see :mod:`layerwise`), sharded over the data axes.
    """

    packed: dict[str, jax.Array]


class OwnedTreePortable(NamedTuple):
    """Checkpoint form of :class:`OwnedTreeState`: ``{param name: tx's state of it}``."""

    per_param: dict[str, Any]


def _plain(shards: Any) -> dict[str, jax.Array]:
    return shards.as_dict() if hasattr(shards, "as_dict") else dict(shards)


class Block(NamedTuple):
    """The part of one param that one rank's FSDP shard holds: columns ``[j0, j1)``
    of the param seen as ``[rows, row]`` (rows: its layers when stacked, else 1)."""

    leaf: int
    unit: str
    src: int  # the FSDP rank holding it
    dst: int  # the param's owner
    j0: int
    j1: int
    col: int  # where column j0 lies in the source's local shard
    pos: int  # where the block lies in the (src -> dst) message
    rows: int


class Routes(NamedTuple):
    """Static all-to-all plan between the FSDP shards and the owners' shards."""

    blocks: tuple[Block, ...]
    width: int  # one message's length (the longest, padded to it)
    piece: int  # one owner's shard length in the owned layout
    where: dict[int, tuple[int, int, int]]  # leaf -> (owner, offset in its shard, row)


def routes(fs: Any, layout: Layout) -> Routes:
    n = fs.num_shards
    buf = layout.buffers[0]
    piece = buf.size // n
    where, blocks, fill = {}, [], [[0] * n for _ in range(n)]
    leaf_of = {name: i for i, name in enumerate(fs.param_names)}
    for u in fs.units:
        flat = fs.unit_flat(u)
        # Each buffer's part of a rank's shard: rank src holds [src * k, (src + 1) * k)
        # of the buffer, at column ``at`` of its shard (a stacked unit: a buffer per param).
        ats = [sum(flat.widths[:bi]) for bi in range(len(flat.widths))]
        for slot in flat.layout.slots:
            i = leaf_of[flat.names[slot.leaf_index]]
            d, off = divmod(layout.slots[i].start, piece)
            where[i] = (d, off, slot.size)
            k, at = flat.widths[slot.buffer], ats[slot.buffer]
            for src in range(n):
                j0, j1 = max(0, src * k - slot.start), min(slot.size, (src + 1) * k - slot.start)
                if j1 > j0:
                    rows = max(slot.layers, 1)
                    col = at + slot.start + j0 - src * k
                    blocks.append(Block(i, u, src, d, j0, j1, col, fill[src][d], rows))
                    fill[src][d] += rows * (j1 - j0)
    width = max(max(max(f) for f in fill), 1)
    return Routes(tuple(blocks), width, piece, where)


def _message(parts: list[jax.Array], width: int) -> jax.Array:
    used = sum(p.shape[0] for p in parts)
    parts = [*parts, jnp.zeros((width - used,), jnp.float32)] if used < width else parts
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


@dataclasses.dataclass(frozen=True, eq=False)
class OwnedTree:
    """``tx`` over an FSDP step's ``{unit: shard}``, each param owned whole by one rank.

    Build with :func:`owned_tree`. ``layout`` is one owned fp32 buffer (one bucket)
    over ``fs``'s data axes; ``whole`` is ``whole_matrices(tx, tree=True)``.
    """

    fs: Any
    tx: optax.GradientTransformation
    whole: WholeMatrices
    layout: Layout

    @property
    def names(self) -> list[str]:
        return list(self.fs.param_names)

    def _spec(self) -> P:
        axes = self.fs.axes
        return P(axes if len(axes) > 1 else axes[0])

    # ------------------------------------------------------- inside the step
    @functools.cached_property
    def routes(self) -> Routes:
        return routes(self.fs, self.layout)

    def _exchange(self, send: list[Callable[..., jax.Array]], x: Any) -> jax.Array:
        """Each rank's ``[N, width]`` messages (row ``d`` to rank ``d``), all-to-all:
        row ``s`` of the result came from rank ``s``."""
        axes = self.fs.axes
        out = layerwise._by_rank(None, axes, send, x)
        return jax.lax.all_to_all(out, axes, 0, 0, tiled=True)

    def to_owners(self, shards: Any) -> jax.Array:
        """FSDP shards ``{unit: [(L,) k]}`` -> this rank's owned shard (all-to-all)."""
        r, n = self.routes, self.fs.num_shards
        shards = {u: x.astype(jnp.float32) for u, x in _plain(shards).items()}

        def send(src: int) -> Callable[..., jax.Array]:
            def run(shards: dict[str, jax.Array]) -> jax.Array:
                rows: list[list[jax.Array]] = [[] for _ in range(n)]
                for b in (b for b in r.blocks if b.src == src):
                    local = shards[b.unit].reshape(b.rows, -1)
                    rows[b.dst].append(local[:, b.col : b.col + b.j1 - b.j0].ravel())
                return jnp.stack([_message(m, r.width) for m in rows])

            return run

        def place(dst: int) -> Callable[..., jax.Array]:
            def run(recv: jax.Array) -> jax.Array:
                parts, pos = [], 0
                for i, (d, off, _) in sorted(r.where.items(), key=lambda t: t[1][1]):
                    if d != dst:
                        continue
                    mine = [b for b in r.blocks if b.leaf == i]  # by source rank
                    cols = [
                        recv[b.src, b.pos : b.pos + b.rows * (b.j1 - b.j0)].reshape(b.rows, -1)
                        for b in mine
                    ]
                    whole = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1)
                    if off > pos:
                        parts.append(jnp.zeros((off - pos,), jnp.float32))
                    parts.append(whole.ravel())
                    pos = off + whole.size
                return _message(parts, r.piece)

            return run

        recv = self._exchange([send(s) for s in range(n)], shards)
        return layerwise._by_rank(None, self.fs.axes, [place(d) for d in range(n)], recv)

    def from_owners(self, owned: jax.Array) -> dict[str, jax.Array]:
        """Inverse of :meth:`to_owners`: each rank's FSDP shards of the owners' values."""
        r, n, fs = self.routes, self.fs.num_shards, self.fs

        def send(dst: int) -> Callable[..., jax.Array]:
            def run(owned: jax.Array) -> jax.Array:
                rows: list[list[jax.Array]] = [[] for _ in range(n)]
                for b in (b for b in r.blocks if b.dst == dst):
                    _, off, row = r.where[b.leaf]
                    whole = owned[off : off + b.rows * row].reshape(b.rows, row)
                    rows[b.src].append(whole[:, b.j0 : b.j1].ravel())
                return jnp.stack([_message(m, r.width) for m in rows])

            return run

        def place(src: int) -> Callable[..., dict[str, jax.Array]]:
            def run(recv: jax.Array) -> dict[str, jax.Array]:
                out = {}
                for u in fs.units:
                    flat = fs.unit_flat(u)
                    local = jnp.zeros((*flat.lead, flat.shard_size), jnp.float32)
                    view = local.reshape(max(flat.lead, default=1), -1)
                    for b in (b for b in r.blocks if b.src == src and b.unit == u):
                        w = b.j1 - b.j0
                        x = recv[b.dst, b.pos : b.pos + b.rows * w].reshape(b.rows, w)
                        view = view.at[:, b.col : b.col + w].set(x)
                    out[u] = view.reshape(local.shape)
                return out

            return run

        recv = self._exchange([send(d) for d in range(n)], owned)
        return layerwise._by_rank(None, self.fs.axes, [place(s) for s in range(n)], recv)

    def transform(self) -> optax.GradientTransformation:
        """The optimizer over ``{unit: shard}`` (inside the step's shard_map)."""
        owner = layerwise.owned_transform(self.layout, 0, self.whole)

        def init_fn(shards: Any) -> OwnedTreeState:
            return OwnedTreeState(owner.init(self.to_owners(shards)))

        def update_fn(
            grads: Any, state: OwnedTreeState, params: Any = None
        ) -> tuple[dict[str, jax.Array], OwnedTreeState]:
            g = self.to_owners(grads)
            # muon reads params for weight decay only; without them, zeros as its own
            m = jnp.zeros_like(g) if params is None else self.to_owners(params)
            u, packed = owner.update(g, state.packed, m)
            return self.from_owners(u), OwnedTreeState(packed)

        return optax.GradientTransformation(init_fn, update_fn)

    # ------------------------------------------------------ outside the step
    def _from_per_param(self, per_param: dict[str, Any]) -> OwnedTreeState:
        return OwnedTreeState(
            layerwise.from_portable(self.layout, 0, self.whole, per_param, self.names)
        )

    def init(self, params: PyTree, mesh: Mesh) -> tuple[OwnedTreeState, OwnedTreeState]:
        """The state from the replicated ``params`` (traceable); returns (state, specs):
        ``tx.init`` of each fp32 param in the param tree, packed on its owner."""
        layout, whole = self.layout, self.whole
        units = {u.slot: u for mine in layerwise.owned_units(layout, 0) for u in mine}

        def build(p: PyTree) -> OwnedTreeState:
            leaves = jax.tree.leaves(p)
            per_param = {
                self.names[si]: layerwise.unit_tx(layout, whole, u).init(
                    jnp.asarray(leaves[si], jnp.float32)
                )
                for si, u in units.items()
            }
            return self._from_per_param(per_param)

        state = jax.jit(build, out_shardings=NamedSharding(mesh, self._spec()))(params)
        return state, self.specs()

    def specs(self) -> OwnedTreeState:
        plan = layerwise.state_plan(self.layout, 0, self.whole)
        return OwnedTreeState({d: self._spec() for d, _ in plan.sizes})

    def to_portable(self, state: OwnedTreeState) -> OwnedTreePortable:
        """Global state -> ``{param name: state}`` (traceable; any DP size reads it)."""
        return OwnedTreePortable(
            layerwise.to_portable(self.layout, 0, self.whole, state.packed, self.names)
        )

    def from_portable(self, portable: OwnedTreePortable) -> OwnedTreeState:
        """Inverse of :meth:`to_portable` for this layout (traceable)."""
        return self._from_per_param(dict(portable.per_param))


def owned_tree(fs: Any, tx: optax.GradientTransformation) -> OwnedTree:
    """``tx`` (muon with its own dimension numbers) over ``fs``'s shards, each param
    owned whole by one of ``fs``'s data-parallel ranks (LPT on the muon cost)."""
    whole = WholeMatrices(tx, "muon", tree=True)
    key = BufferKey("float32", fs.axes, owned=whole.owned)
    shapes = jax.tree.unflatten(
        fs.treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in fs.param_shapes]
    )
    layout = build_layout(shapes, num_shards=fs.num_shards, key_fn=lambda _p, _x: key)
    return OwnedTree(fs, tx, whole, layout)

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

Inside the step, the update all-gathers the reduced gradient and the fp32 params of
every unit, each rank keeps the params it owns (its shard of the owned layout),
runs ``tx`` on them, and the owners' updates are all-gathered and cut back into each
rank's FSDP shards. Equal to the optimizer on one device. The transient gradient,
params and update are whole on every rank for the length of the update (what the
replicated version held too); an all-to-all from the FSDP shards to the owners
would move 1/N of those bytes.

The state is ``OwnedTreeState``: one packed vector per dtype, ``[N * length]``
sharded over the data axes (layerwise's packing). Its checkpoint form is per param
(:meth:`OwnedTree.to_portable`, the form of ZeRO's owned state), so a checkpoint
restores at any data-parallel size, ownership recomputed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import rank
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
    def _tree_of(self, shards: Any) -> PyTree:
        """Every unit all-gathered: the whole fp32 param-shaped tree."""
        fs, shards = self.fs, _plain(shards)
        leaves: list[Any] = [None] * len(fs.param_names)
        for u in fs.units:
            x = shards[u].astype(jnp.float32)
            full = jax.lax.all_gather(x, fs.axes, axis=x.ndim - 1, tiled=True)
            named = fs.unit_flat(u).unflatten(full, jnp.float32)
            for i in fs.members(u):
                leaves[i] = named[fs.param_names[i]]
        return jax.tree.unflatten(fs.treedef, leaves)

    def _shards_of(self, tree: PyTree) -> dict[str, jax.Array]:
        """This rank's FSDP shard of every unit of a whole param-shaped tree."""
        fs = self.fs
        leaves, r, out = jax.tree.leaves(tree), rank(fs.axes), {}
        for u in fs.units:
            flat = fs.unit_flat(u)
            named = {fs.param_names[i]: leaves[i] for i in fs.members(u)}
            full = flat.flatten(named, jnp.float32)
            size = flat.shard_size
            out[u] = jax.lax.dynamic_slice_in_dim(full, r * size, size, axis=full.ndim - 1)
        return out

    def _owned(self, tree: PyTree) -> jax.Array:
        """This rank's shard of the owned layout: the params it owns, whole."""
        (flat,) = self.layout.flatten(tree, jnp.float32)
        return self.layout.shard_of(0, flat, rank(self.fs.axes))

    def transform(self) -> optax.GradientTransformation:
        """The optimizer over ``{unit: shard}`` (inside the step's shard_map)."""
        owner = layerwise.owned_transform(self.layout, 0, self.whole)

        def init_fn(shards: Any) -> OwnedTreeState:
            return OwnedTreeState(owner.init(self._owned(self._tree_of(shards))))

        def update_fn(
            grads: Any, state: OwnedTreeState, params: Any = None
        ) -> tuple[dict[str, jax.Array], OwnedTreeState]:
            g = self._owned(self._tree_of(grads))
            # muon reads params for weight decay only; without them, zeros as its own
            m = jnp.zeros_like(g) if params is None else self._owned(self._tree_of(params))
            u, packed = owner.update(g, state.packed, m)
            full = jax.lax.all_gather(u, self.fs.axes, axis=0, tiled=True)  # one bucket
            return self._shards_of(self.layout.unflatten((full,), jnp.float32)), OwnedTreeState(
                packed
            )

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

"""A per-param optimizer that is not elementwise, run as written inside an FSDP step.

FSDP keeps each unit's params as flat shards that cut params apart, and runs the
optimizer on those shards: right for elementwise optimizers only. Muon with its own
dimension numbers (Newton-Schulz on the matrices it names, its Adam elsewhere) needs
each param whole and in the param tree its routing reads. :func:`whole_tree` gives it
that: the update all-gathers the reduced gradient and the fp32 params of every unit,
runs the user's ``tx`` on the whole tree (every rank the same numbers: the optimizer's
compute and state are replicated, as in DDP, while the params stay sharded), and
keeps this rank's shard of the update. Equal to the optimizer on one device.

The state is kept once per rank: every leaf gets a leading axis of the data-parallel
size, sharded over the data axes (each device holds its own copy, ``[1, ...]``), so
the step's shard_map passes it through as a device-varying value. It is held as the
tuple of ``tx``'s state leaves: its param-shaped dicts would otherwise read as FSDP's
``{unit: shard}`` dicts (the default units are the params' top-level names) to the
checkpoint's conversion. A checkpoint of it restores at the same data-parallel size.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import rank

PyTree = Any


def _plain(shards: Any) -> dict[str, jax.Array]:
    return shards.as_dict() if hasattr(shards, "as_dict") else dict(shards)


def whole_tree(fs: Any, tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the whole fp32 param tree, over ``fs``'s ``{unit: shard}`` (inside the step).

    Args:
      fs: the step's :class:`jaxsync.FullyShard`.
      tx: an optimizer that treats each param on its own but needs it whole
        (``optax.contrib.muon`` with its ``muon_weight_dimension_numbers``).
    """
    axes = fs.axes

    def tree_of(shards: Any) -> PyTree:
        shards = _plain(shards)
        leaves: list[Any] = [None] * len(fs.param_names)
        for u in fs.units:
            x = shards[u].astype(jnp.float32)
            full = jax.lax.all_gather(x, axes, axis=x.ndim - 1, tiled=True)
            named = fs.unit_flat(u).unflatten(full, jnp.float32)
            for i in fs.members(u):
                leaves[i] = named[fs.param_names[i]]
        return jax.tree.unflatten(fs.treedef, leaves)

    def shards_of(tree: PyTree) -> dict[str, jax.Array]:
        leaves = jax.tree.leaves(tree)
        r = rank(axes)
        out = {}
        for u in fs.units:
            flat = fs.unit_flat(u)
            named = {fs.param_names[i]: leaves[i] for i in fs.members(u)}
            full = flat.flatten(named, jnp.float32)
            size = flat.shard_size
            out[u] = jax.lax.dynamic_slice_in_dim(full, r * size, size, axis=full.ndim - 1)
        return out

    def init_fn(shards: Any) -> tuple[jax.Array, ...]:
        return tuple(x[None] for x in jax.tree.leaves(tx.init(tree_of(shards))))

    def update_fn(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        g = tree_of(grads)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), g)
        treedef = jax.tree.structure(jax.eval_shape(tx.init, like))
        mine = jax.tree.unflatten(treedef, [x[0] for x in state])
        whole = None if params is None else tree_of(params)
        updates, mine = tx.update(g, mine, whole)
        return shards_of(updates), tuple(x[None] for x in jax.tree.leaves(mine))

    return optax.GradientTransformation(init_fn, update_fn)


def init_whole_tree(
    tx: optax.GradientTransformation, params: PyTree, mesh: Mesh, axes: tuple[str, ...]
) -> tuple[Any, Any]:
    """The state of :func:`whole_tree` from the replicated ``params``: ``tx.init`` of the
    fp32 params, one copy per data-parallel rank; returns (state, specs)."""
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    f32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    spec = P(axes if len(axes) > 1 else axes[0])

    def per_rank(x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x[None], (n, *x.shape))

    state = jax.jit(
        lambda p: tuple(per_rank(x) for x in jax.tree.leaves(tx.init(p))),
        out_shardings=NamedSharding(mesh, spec),
    )(f32)
    return state, jax.tree.map(lambda _: spec, state)

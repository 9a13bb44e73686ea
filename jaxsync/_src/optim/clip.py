"""Global norms and clipping of gradients that are sharded over data-parallel ranks.

One arithmetic for every clip jaxsync makes (:func:`clip_to_norm`, optax's), so each
mode matches ``optax.clip_by_global_norm`` on one device; and the distributed
optimizer's statistics of its reduced shards (:func:`shard_stats`), where every
logical element counts once however the buffers are placed.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ..core.axes import AxisName, bound_axes, normalize_axes, to_varying
from ..core.tree_reduce import count_zeros
from ..core.validate import check_positive
from ..layout.layout import Layout

PyTree = Any


def clip_to_norm(tree: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
    """``tree`` scaled to ``max_norm`` where its global ``norm`` exceeds it: optax's
    arithmetic (``g / norm * max_norm``), so results match it bit for bit."""
    keep = norm < max_norm
    return jax.tree.map(lambda g: jnp.where(keep, g, (g / norm.astype(g.dtype)) * max_norm), tree)


def shard_stats(layout: Layout, shards: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """Global L2 norm and count of exact zeros (padding excluded) of reduced shards.

    One small all-reduce over the whole mesh. Every logical element counts once:
    shards are disjoint over their buffer's axes, pieces over the ``varying`` axes
    are distinct, and copies replicated over the remaining axes are weighted by
    1 / (number of copies).
    """
    mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
    all_axes = tuple(mesh_shape)
    stats, padding = [], 0.0
    for s, buf in zip(shards, layout.buffers, strict=True):
        key = buf.key
        copies = math.prod(
            n for a, n in mesh_shape.items() if a not in key.axes and a not in key.varying
        )
        stat = jnp.stack([jnp.sum(jnp.square(s.astype(jnp.float32))), count_zeros(s)]) / copies
        stats.append(to_varying(stat, all_axes))
        padding += (buf.size - buf.used) * math.prod(mesh_shape[a] for a in key.varying)
    total = jax.lax.psum(sum(stats), all_axes)
    return jnp.sqrt(total[0]), jnp.round(total[1] - padding).astype(jnp.int32)


def clip_by_global_norm(max_norm: float, *, axis_name: AxisName) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for gradients sharded over ``axis_name``.

    The norm is summed over the shards of every rank (one scalar all-reduce),
    so every rank clips by the same, true global norm. Padding is zero and does
    not count.
    """
    axes = normalize_axes(axis_name)
    max_norm = check_positive(max_norm, "max_norm", allow_none=False)

    def init_fn(params: PyTree) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        del params
        bound_axes(axes, "jaxsync.clip_by_global_norm", allow_vmap=True)
        sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(updates))
        norm = jnp.sqrt(jax.lax.psum(sq, axes))
        return clip_to_norm(updates, norm, max_norm), state

    return optax.GradientTransformation(init_fn, update_fn)

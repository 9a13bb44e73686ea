"""Global-norm clipping of gradients that are sharded over data-parallel ranks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ..core.axes import AxisName, bound_axes, normalize_axes
from ..core.validate import check_positive

PyTree = Any


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
        keep = norm < max_norm
        updates = jax.tree.map(
            lambda g: jnp.where(keep, g, (g / norm.astype(g.dtype)) * max_norm), updates
        )
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)

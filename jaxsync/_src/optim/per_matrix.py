"""A whole-matrix optimizer where the optimizer sees whole params: one matrix at a time.

:func:`jaxsync.whole_matrices` promises that ``inner`` runs on each matrix on its own,
and on each *layer* of a stacked ``[L, m, n]`` param. The distributed optimizer keeps
that promise by ownership; a step whose optimizer sees the whole param tree (DDP, and
every mode on a 2-D mesh, through ``optax.multi_transform``) keeps it here: ``inner``
is run leaf by leaf, vmapped over the layer axis of stacked leaves. Without it Muon
would meet a 3-D stack and silently run its Adam fallback on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import optax

from ..core.names import group_of, param_name

PyTree = Any


class PerMatrixState(NamedTuple):
    """``inner``'s state of each leaf (a leading layer axis for stacked leaves)."""

    inner_state: tuple[Any, ...]


def per_matrix(
    inner: optax.GradientTransformation, stacked: Sequence[str] = ()
) -> optax.GradientTransformation:
    """``inner`` on each param alone; on each layer of a param in a ``stacked`` group."""
    stacked = tuple(stacked)

    def layered(tree: PyTree) -> list[bool]:
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [group_of(param_name(p), stacked) is not None for p, _ in paths]

    def init_fn(params: PyTree) -> PerMatrixState:
        leaves = jax.tree.leaves(params)
        return PerMatrixState(
            tuple(
                jax.vmap(inner.init)(x) if lay else inner.init(x)
                for x, lay in zip(leaves, layered(params), strict=True)
            )
        )

    def update_fn(
        updates: PyTree, state: PerMatrixState, params: PyTree | None = None
    ) -> tuple[PyTree, PerMatrixState]:
        leaves, treedef = jax.tree.flatten(updates)
        ps = [None] * len(leaves) if params is None else jax.tree.leaves(params)
        out, states = [], []
        for g, s, p, lay in zip(leaves, state.inner_state, ps, layered(updates), strict=True):
            if lay:
                u, s = jax.vmap(inner.update, in_axes=(0, 0, None if p is None else 0))(g, s, p)
            else:
                u, s = inner.update(g, s, p)
            out.append(u)
            states.append(s)
        return jax.tree.unflatten(treedef, out), PerMatrixState(tuple(states))

    return optax.GradientTransformation(init_fn, update_fn)

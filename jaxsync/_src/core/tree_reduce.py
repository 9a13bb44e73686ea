"""Reductions over every leaf of a gradient tree at once: one kernel, not one per leaf.

A step's guard reads each gradient leaf for its squared norm, its zeros and
whether it holds NaN/Inf. Written leaf by leaf, that is two or three reductions
per leaf; XLA:CPU splits each into three kernels (its tree-reduction rewrite), so
a model of a few dozen leaves compiles a hundred kernels for its statistics, and
the compile of a small model's first step doubled. Here the leaves are read as
one concatenated vector, which XLA fuses into the reduction's input (on GPU the
norm and the zero count come out of one kernel, the concatenation never made).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: Most rows :func:`nonfinite_leaves` reduces to (its chunk grows with the model).
_MAX_ROWS = 1 << 16
_MIN_CHUNK = 1 << 10


def sq_sum_and_zeros(leaves: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(sum of squares, count of exact zeros)`` of all ``leaves``, in fp32."""
    leaves = [g for g in leaves if g.size]
    if not leaves:
        return jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    flat = jnp.concatenate([jnp.ravel(g).astype(jnp.float32) for g in leaves])
    return jnp.sum(jnp.square(flat)), jnp.sum(flat == 0).astype(jnp.float32)


def nonfinite_leaves(leaves: Sequence[jax.Array]) -> jax.Array:
    """``bool[len(leaves)]``: whether each leaf holds a NaN or an Inf.

    Each leaf's finiteness is padded (with True) to whole rows of one chunk and
    all rows reduced at once; a leaf's flag is then any bad row among its own,
    which a ``[leaves, rows]`` mask picks (rows stay few: the chunk grows so
    that there are at most ``2**16`` plus one per leaf).
    """
    sizes = [int(np.prod(g.shape)) for g in leaves]
    if not any(sizes):
        return jnp.zeros((len(leaves),), bool)
    chunk = _MIN_CHUNK
    while sum(sizes) > chunk * _MAX_ROWS:
        chunk *= 2
    rows = np.array([-(-n // chunk) for n in sizes], np.int32)
    parts = [
        jnp.pad(jnp.isfinite(jnp.ravel(g)), (0, int(r) * chunk - n), constant_values=True)
        for g, n, r in zip(leaves, sizes, rows, strict=True)
        if r
    ]
    ok = jnp.all(jnp.concatenate(parts).reshape(-1, chunk), axis=1)
    ends = np.cumsum(rows)
    starts = ends - rows
    row = jax.lax.broadcasted_iota(jnp.int32, (len(leaves), int(ends[-1])), 1)
    mine = (row >= starts[:, None]) & (row < ends[:, None])
    return jnp.any(mine & jnp.logical_not(ok)[None, :], axis=1)

"""PartitionSpec helpers: read a param's spec, its mesh axes, its per-device shape.

The sharded optimizer plans its buffers from *local* shapes and from the mesh
axes each param varies over; outside shard_map both come from the params'
PartitionSpecs, inside from their types.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def param_specs_of(params: PyTree, param_specs: PyTree = None) -> PyTree:
    """The params' PartitionSpecs: given, else read from NamedShardings, else ``P()``."""
    if param_specs is not None:
        return param_specs
    return jax.tree.map(
        lambda x: (
            x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P()
        ),
        params,
    )


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (None, a name or a tuple)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis ``spec`` names, sorted."""
    return tuple(sorted(a for entry in spec for a in entry_axes(entry)))


def full_spec(spec: P | None, ndim: int) -> P:
    """``spec`` written out per dimension (``P()`` of a matrix is ``P(None, None)``)."""
    entries = tuple(spec or ())
    return P(*entries, *(None,) * (ndim - len(entries)))


def keep_axes(spec: P, keep: Any) -> P:
    """``spec`` naming only the axes ``keep(axis)`` accepts."""
    entries = []
    for entry in spec:
        kept = tuple(a for a in entry_axes(entry) if keep(a))
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*entries)


def local_shape(shape: tuple[int, ...], spec: P, mesh: Mesh) -> tuple[int, ...]:
    """Per-device shape of a global array sharded by ``spec`` over ``mesh``."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        n = math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))
        out[dim] //= n
    return tuple(out)

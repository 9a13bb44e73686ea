"""flax linen's boxed params (``nn.with_partitioning``): unboxed, their names a placement.

A linen model initialised under ``nn.with_partitioning`` holds ``nn.Partitioned``
boxes; handed to a step as they are, linen's own unboxing applies a sharding
constraint inside the step's ``shard_map``, which fails with JAX errors that do not
say why (``... only valid for values of rank at least 3``, ``... can only refer to
Auto axes``). So the step unboxes them once, at ``init``: a name that is one of the
mesh's axes other than the data axes places the param over that axis (tensor
parallelism by specs, on a 2-D mesh); data axes (jaxsync shards over them itself)
and logical names the mesh does not have are dropped, so on a 1-D mesh the params
are plain replicated arrays.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def _is_box(x: Any) -> bool:
    from flax.core import meta

    return isinstance(x, meta.AxisMetadata)


def unbox(params: PyTree, mesh: Mesh, data: tuple[str, ...]) -> PyTree:
    """``params`` with every linen box replaced by its value, placed by its names."""
    if not any(_is_box(x) for x in jax.tree.leaves(params, is_leaf=_is_box)):
        return params
    model_axes = set(mesh.axis_names) - set(data)

    def one(x: Any) -> Any:
        if not _is_box(x):
            return x
        names = tuple(getattr(x, "names", ()) or ())
        value = x.unbox(apply_constraint=False) if names else x.unbox()
        spec = P(*(n if n in model_axes else None for n in names))
        if not any(e is not None for e in spec):
            return value
        sharding = NamedSharding(mesh, spec)
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        return jax.device_put(value, sharding)

    return jax.tree.map(one, params, is_leaf=_is_box)

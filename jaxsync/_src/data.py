"""Placing the global batch on the mesh, one process-local part per host."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .axes import AxisName, mesh_axes_size, normalize_axes
from .consistency import check_agree

PyTree = Any

# (mesh devices, axes, batch axis) whose rows the processes compared already: once
# each, on the first call, which every process makes at the same point.
_COMPARED: set[Any] = set()


def shard_batch(
    batch: PyTree, mesh: Mesh, *, axis_name: AxisName = "data", batch_axis: int = 0
) -> PyTree:
    """Shards every leaf's batch axis over ``axis_name`` of ``mesh``.

    ``batch_axis=1`` is for stacked microbatches ``(micro, batch, ...)``, which
    go into shard_map with ``in_specs=P(None, axis_name)``.

    With one process ``batch`` is the global batch. With several processes each
    passes only its own part (the rows its addressable devices hold), as
    ``jax.make_array_from_process_local_data`` expects; the global batch is the
    concatenation over processes in process order.

    Raises:
      ValueError: a leaf is a scalar, its batch size does not divide evenly, the
        leaves disagree on their rows, or (first call) the processes pass
        different numbers of rows.
    """
    from .step_checks import batch_rows

    axes = normalize_axes(axis_name)
    n = mesh_axes_size(mesh, axes, "jaxsync.shard_batch")
    rows = batch_rows(batch, "jaxsync.shard_batch", batch_axis)
    sharding = NamedSharding(mesh, P(*([None] * batch_axis), axes))
    nproc = jax.process_count()
    key = (tuple(d.id for d in mesh.devices.flat), axes, batch_axis) if nproc > 1 else None
    if key is not None and key not in _COMPARED:
        _COMPARED.add(key)
        check_agree([("rows per process", f"{rows} rows")], "jaxsync.shard_batch",
                    "the rows of their part of the global batch")  # fmt: skip

    def put(path: Any, x: Any) -> jax.Array:
        shape = np.shape(x)
        global_rows = shape[batch_axis] * nproc if len(shape) > batch_axis else None
        if global_rows is None or global_rows % n:
            over = f" summed over {nproc} processes" if nproc > 1 else ""
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {shape}; its batch "
                f"axis {batch_axis}{over} must divide evenly over axis {axes} of size {n}. "
                f"Use a global batch size that is a multiple of {n}."
            )
        if nproc == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(put, batch)

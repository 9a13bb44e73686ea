"""Placing the global batch on the mesh, one process-local part per host."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import AxisName, mesh_axes_size, normalize_axes
from ..core.specs import entry_axes, full_spec
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
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x  # placed already (by `TrainStep.place`, or a loader): no put
        if nproc == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(put, batch)


ROWS_OUT_OF_ORDER = (
    "{fn}: batch leaf {leaf} is split over {rows} ({spec}). The step splits the rows over "
    "its data axes {data}, so rows also split over other axes must name the data axes "
    "first: P({want!r}). Place it with that spec, or pass host arrays (placed over {data})."
)


def rows_kept(x: Any, mesh: Mesh, axes: tuple[str, ...], fn: str, path: Any = ()) -> bool:
    """Whether a placed batch leaf keeps its sharding in a step over ``axes``.

    A leaf whose rows are split over the data axes *and then* other axes
    (``P(("data", "expert"))``) stays as it is: each data rank's rows remain
    split over the other axes for the compiler, so devices along an axis the
    model is sharded over (experts) do not all run the same rows. Since every
    data rank still gets its own contiguous rows, the loss (the mean over them)
    and the 1/n of the gradient are those of :func:`shard_batch`'s layout.
    Any other leaf (host arrays, rows over the data axes only) is placed by
    :func:`shard_batch`.

    Raises:
      ValueError: the rows are split over other axes but not data axes first.
    """
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not sharding.spec:
        return False
    spec = sharding.spec
    rows = entry_axes(spec[0])
    if all(a in axes for a in rows):
        return False
    same = sharding.mesh.shape_tuple == mesh.shape_tuple and (
        [d.id for d in sharding.mesh.devices.flat] == [d.id for d in mesh.devices.flat]
    )
    if not same:  # another mesh: placed anew, as host arrays are
        return False
    if rows[: len(axes)] == axes:
        return True
    want = axes + tuple(a for a in rows if a not in axes)
    raise ValueError(
        ROWS_OUT_OF_ORDER.format(
            fn=fn, leaf=jax.tree_util.keystr(path) or "(the batch)", rows=rows, spec=spec,
            data=axes, want=want,
        )
    )  # fmt: skip


EMPTY_BATCH = (
    "TrainStep: the batch has 0 rows (this process's part of the global batch is empty); "
    "a step on it would count as a step with a NaN loss. Skip the step when the data "
    "runs out (e.g. drop the last, empty batch of an epoch)."
)


def place_batch(batch: Any, mesh: Mesh, axes: tuple[str, ...], microbatches: int) -> Any:
    """``batch`` sharded over the data axes ``axes`` for a step with ``microbatches``
    (:meth:`TrainStep.place`): rows per device must split into the microbatches, and a
    leaf :func:`rows_kept` keeps its own sharding. ``ShapeDtypeStruct`` leaves get the
    sharding they would have."""
    n = mesh_axes_size(mesh, axes, "TrainStep")
    if batch_rows(batch, "TrainStep") == 0:
        # A step on no rows would average 0/0: a NaN loss in a step counted as taken.
        raise ValueError(EMPTY_BATCH)
    kept = jax.tree_util.tree_map_with_path(
        lambda path, x: rows_kept(x, mesh, axes, "TrainStep.place", path),
        batch,
    )
    for (path, x), keep in zip(
        jax.tree_util.tree_flatten_with_path(batch)[0], jax.tree.leaves(kept), strict=True
    ):
        rows = np.shape(x)[0] * (1 if keep else jax.process_count()) if np.ndim(x) else None
        if rows is not None and microbatches > 1 and rows % (n * microbatches) == 0:
            continue
        if rows is not None and microbatches > 1 and rows % n == 0:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has {rows} rows: {rows // n} per "
                f"device over axis {axes} (size {n}), which `microbatches="
                f"{microbatches}` does not divide. Use a global batch that is a "
                f"multiple of {n * microbatches}."
            )
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
        return _abstract_batch(batch, mesh, axes, kept)
    if not any(jax.tree.leaves(kept)):
        return shard_batch(batch, mesh, axis_name=axes)
    rest = jax.tree.map(lambda x, keep: None if keep else x, batch, kept)
    placed = shard_batch(rest, mesh, axis_name=axes)
    return jax.tree.map(
        lambda keep, x, p: x if keep else p, kept, batch, placed,
        is_leaf=lambda v: v is None,
    )  # fmt: skip


def _abstract_batch(batch: Any, mesh: Mesh, axes: tuple[str, ...], kept: Any) -> Any:
    """``ShapeDtypeStruct`` batch leaves with the sharding ``place`` would give them."""
    n = mesh_axes_size(mesh, axes, "TrainStep.place")

    def one(path: Any, x: jax.ShapeDtypeStruct, keep: bool) -> jax.ShapeDtypeStruct:
        if keep:
            return x
        if not x.shape or x.shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {x.shape}; its first axis "
                f"must divide evenly over axis {axes} of size {n}."
            )
        spec = full_spec(P(axes if len(axes) > 1 else axes[0]), len(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, batch, kept)


def batch_rows(batch: PyTree, fn: str, axis: int = 0) -> int | None:
    """The rows every leaf of ``batch`` has on ``axis`` (None: no leaf has that axis);
    raises naming the first leaf that disagrees."""
    rows: dict[str, int] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = np.shape(x)
        if len(shape) > axis:
            rows[jax.tree_util.keystr(path) or "(the batch)"] = int(shape[axis])
    if not rows:
        return None
    counts: dict[int, list[str]] = {}
    for name, r in rows.items():
        counts.setdefault(r, []).append(name)
    if len(counts) > 1:
        common = max(counts, key=lambda r: len(counts[r]))
        leaf, r = next((k, v) for k, v in rows.items() if v != common)
        others = "; ".join(
            f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
            f"{'has' if len(names) == 1 else 'have'} {c}"
            for c, names in counts.items()
            if c != r
        )
        raise ValueError(ROWS_DIFFER.format(fn=fn, axis=axis, leaf=leaf, rows=r, others=others))
    return next(iter(counts))


ROWS_DIFFER = (
    "{fn}: the leaves of the batch disagree on their number of rows (axis {axis}): "
    "{leaf} has {rows}, while {others}. Every leaf with a batch axis is split over the "
    "data-parallel devices row by row, so they must all have the same rows; mismatched "
    "leaves would be split differently and broadcast against each other. Give every "
    "leaf the same batch size (or move per-batch constants out of the batch)."
)

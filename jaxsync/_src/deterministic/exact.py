"""Exact reductions of :class:`~jaxsync.UnitGrads` (deterministic mode).

Plain data parallelism gets the mean gradient tree (exact reduce-scatter of the
fixed-point limbs, then an all-gather of the floats: the bytes of a ring
all-reduce, and 1/N of the conversions); the distributed optimizer gets its
shards, and the global norm and zero count summed exactly too, because the
shard boundaries move with the number of ranks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..core.axes import axes_size, bound_axes
from ..core.bits import fingerprint
from ..layout.placement import build_layout, check_bucket_size
from .fixed_point import exact_total, unit_sum
from .units import Deterministic, UnitGrads, check_unit_grads, units_per_device

PyTree = Any

UNIT_GRADS_WITHOUT_MODE = (
    "{fn} got UnitGrads (from `deterministic=` in value_and_grad/accumulate_grads) but "
    "was built without `deterministic=`; pass the same `deterministic=jaxsync.Deterministic"
    "(units={units})` to it, so the units are summed exactly."
)


def exact_all_reduce(
    grads: UnitGrads, axes: tuple[str, ...], bucket_size: int | None, fn: str
) -> PyTree:
    """The mean gradient tree (in the grads' own dtypes), summed exactly over units."""
    k = units_per_device(Deterministic(grads.units), axes, fn)
    check_unit_grads(grads, None, k, fn)
    shapes = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape[1:], jnp.float32), grads.grads)
    n = axes_size(axes)
    layout = build_layout(shapes, num_shards=n, bucket_size=bucket_size)
    packed = jax.vmap(layout.pack)(grads.grads)  # [buffer][bucket]: [k, size]
    inv = 1.0 / grads.count

    def reduce(bucket: jax.Array) -> jax.Array:
        # Reduce-scatter the limbs, convert this rank's piece, gather the floats:
        # the bytes of a ring all-reduce, and 1/N of the conversion work.
        piece = unit_sum(bucket, axes, scatter=True)[0] * inv
        return jax.lax.all_gather(piece, axes, axis=0, tiled=True, to="invarying")

    out = [tuple(reduce(b) for b in buckets) for buckets in packed]
    mean = layout.unpack(out)
    leaves, treedef = jax.tree.flatten(mean)
    return jax.tree.unflatten(
        treedef, [x.astype(d) for x, d in zip(leaves, grads.dtypes, strict=True)]
    )


def exact_reduce_scatter(
    grads: UnitGrads, layout: Any, axes: tuple[str, ...], scale: jax.Array, fn: str
) -> tuple[jax.Array, ...]:
    """This rank's shards of the mean gradient (fp32), summed exactly over units."""
    k = units_per_device(Deterministic(grads.units), axes, fn)
    check_unit_grads(grads, None, k, fn)
    packed = jax.vmap(lambda t: layout.pack(t, jnp.float32))(grads.grads)
    factor = (1.0 / grads.count) * scale
    shards = []
    for buckets in packed:
        pieces = [unit_sum(b, axes, scatter=True)[0] * factor for b in buckets]
        shards.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
    return tuple(shards)


def nonfinite_flags(grads: UnitGrads) -> jax.Array:
    """``[units per device, params]``: where a unit's gradient of a param holds NaN/Inf."""
    leaves = jax.tree.leaves(grads.grads)
    return jnp.stack(
        [jnp.logical_not(jnp.all(jnp.isfinite(g), axis=tuple(range(1, g.ndim)))) for g in leaves],
        axis=1,
    )


def unit_prints(grads: UnitGrads) -> jax.Array:
    """``uint32[units per device, params]``: each unit's gradient of each param reduced
    to a fingerprint of its bits (any flipped bit changes it)."""
    return jnp.stack([jax.vmap(fingerprint)(g) for g in jax.tree.leaves(grads.grads)], axis=1)


class UnitRecord(NamedTuple):
    """What a deterministic step records of this device's units before the sync,
    for the metrics (:func:`jaxsync._src.optim.metrics.next_metrics`) to gather.

    Attributes:
      flags: ``bool[units per device, params]``, NaN/Inf (:func:`nonfinite_flags`).
      prints: ``uint32[units per device, params]`` (:func:`unit_prints`), or None
        (not asked for: ``TrainerMetrics(unit_prints=True)``).
    """

    flags: jax.Array
    prints: jax.Array | None = None


def unit_record(grads: UnitGrads, prints: bool) -> UnitRecord:
    """The flags, and with ``prints`` the fingerprints, of this device's units."""
    return UnitRecord(nonfinite_flags(grads), unit_prints(grads) if prints else None)


def all_reduce_unit_grads(
    grads: Any,
    axis_name: Any,
    bucket_size: int | None,
    average: bool,
    rules: Any,
    det: Deterministic | None,
    fn: str,
) -> PyTree:
    """:func:`jaxsync.all_reduce_grads` / :func:`jaxsync.sync_grads` of UnitGrads."""
    axes = bound_axes(axis_name, fn)
    check_unit_grads(grads, det, None, fn)
    if rules is not None or not average:
        raise NotImplementedError(
            f"{fn}: UnitGrads are summed exactly into the mean over units: `average` must "
            "be True and `rules` None (deterministic mode is plain data parallelism)."
        )
    return exact_all_reduce(grads, axes, check_bucket_size(bucket_size), fn)


def exact_shards(
    cfg: Any,
    layout: Any,
    grads: Any,
    inv_scale: jax.Array | None,
) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array, jax.Array, jax.Array]:
    """The distributed optimizer's reduction in deterministic mode.

    Returns ``(shards, grad_norm, num_zeros, finite, units)``: this rank's shards
    of the mean gradient (unscaled), the statistics the step needs, every one of
    them from exact sums, so no bit depends on the number of ranks, and the
    :class:`UnitRecord` of its units (fingerprints where ``cfg.unit_prints``).
    """
    fn = "distributed_optimizer.update"
    grads = check_unit_grads(grads, cfg.deterministic, None, fn)
    if any(buf.key.varying or buf.key.axes != cfg.axes for buf in layout.buffers):
        raise NotImplementedError(
            f"{fn}: `deterministic=` supports params replicated over the mesh (plain data "
            "parallelism); some params are sharded over other axes."
        )
    mesh_axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
    if set(mesh_axes) != set(cfg.axes):
        raise NotImplementedError(
            f"{fn}: `deterministic=` needs the data axes {cfg.axes} to be the whole mesh "
            f"{mesh_axes}."
        )
    if inv_scale is None:  # no loss scaling (optim.loss_scale.active_scale)
        inv_scale = jnp.float32(1)
    shards = exact_reduce_scatter(grads, layout, cfg.axes, inv_scale, fn)
    # The norm's shard boundaries move with N: its sum of squares is exact too.
    grad_norm = jnp.sqrt(exact_total([jnp.square(s) for s in shards], cfg.axes))
    zeros = sum(jnp.sum(s == 0).astype(jnp.int32) for s in shards)
    padding = sum(buf.size - buf.used for buf in layout.buffers)
    num_zeros = jax.lax.psum(zeros, cfg.axes) - padding
    finite = jnp.isfinite(grad_norm)
    units = unit_record(grads, getattr(cfg, "unit_prints", False))
    return shards, grad_norm, num_zeros, finite, units

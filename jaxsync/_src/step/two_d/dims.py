"""Per-param collectives along one dimension, for params the compiler shards too.

On a mesh such as ``("data", "model")`` a tensor-parallel param carries a
``NamedSharding`` over ``"model"`` and the model code is the single-device code:
GSPMD partitions it. jaxsync's step is then manual over the data axes only
(``jax.shard_map(..., axis_names=data)``), and a param is no longer a buffer
jaxsync may flatten: packing a ``"model"``-sharded matrix into a flat bucket
would make the compiler gather it over ``"model"`` first. So each param keeps
its shape, and its ZeRO/FSDP shard is cut along one *dimension* that no other
axis uses (:class:`DimPlan`): ``psum_scatter``/``all_gather`` with
``scatter_dimension``/``axis`` run over the data axes while the compiler keeps
the other dims partitioned. No bucket is built: XLA's collective combiners
group the per-param collectives (the GPU pipeline does by default).

A dim that does not divide by the data size is padded (zeros, never seen by
the model); a param with no free dim (a scalar, or every dim taken by other
axes) is all-reduced and kept whole on every data rank.

A param the other axes replicate (an embedding, a norm scale: every "model"
device holds the same gradient) is also *spread* over them: its shard is cut
over ``(data, model)`` on its dim, so each device reduce-scatters over the data
axes only its own 1/model of the gradient, and the master and optimizer state
of it are 1/(data x model) per device. Without that, every "model" device ran
the same cross-host reduction of the whole gradient (a 1B GPT's token embedding
on 64 x H100 as data=8 x model=8: a 256 MiB fp32 reduce-scatter, repeated 8
times). Its all-gather goes over the data axes first (1/model of the bytes
across hosts), then over the spread axes (within a host on such meshes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ...core.axes import to_varying
from ...core.specs import full_spec, spec_axes

PyTree = Any


@dataclasses.dataclass(frozen=True)
class DimSync:
    """How a step reduces: ``scatter`` (ZeRO), all-reduce (DDP) or ``gather`` (FSDP).

    ``wide_sums``: all-reduce a sub-fp32 gradient in fp32 and cast back. XLA:CPU
    promotes such all-reduces itself, and its promotion aborts the process on a
    partial-manual step's ``psum``, whose reduction ends in a sharding annotation
    (jaxlib 0.10.2: "Invalid binary instruction opcode copy"); the sums are the
    ones XLA:CPU would compute. GPU meshes all-reduce in the reduction dtype.
    """

    axes: tuple[str, ...]
    reduce_dtype: str
    factor: float
    scatter: bool
    compute_dtype: str | None = None  # FSDP: the dtype the gathered param is used in
    fsdp: bool = False
    wide_sums: bool = False


@dataclasses.dataclass(frozen=True)
class DimPlan:
    """How one param is split over the data axes.

    ``spec`` is the param's own (compiler-axis) spec per dimension; ``dim`` the
    dimension cut over the data axes (None: kept whole), padded to ``padded``;
    ``spread`` the compiler axes (those the param is replicated over) that cut
    ``dim`` too, after the data axes, and ``spread_size`` their product.
    A stacked group's param has ``layered=True``: dim 0 is the layer axis, never cut.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[Any, ...]
    dim: int | None
    padded: int
    layered: bool = False
    spread: tuple[str, ...] = ()
    spread_size: int = 1

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The global shape of the padded array the shards are cut from."""
        if self.dim is None:
            return self.shape
        return tuple(self.padded if i == self.dim else s for i, s in enumerate(self.shape))

    def local_shape(self, data: tuple[str, ...]) -> tuple[int, ...]:
        """This data rank's shard's shape (inside the step's shard_map; the compiler
        splits it further over ``spread``)."""
        if self.dim is None:
            return self.shape
        n = jax.lax.axis_size(data)
        return tuple(self.padded // n if i == self.dim else s for i, s in enumerate(self.shape))

    def shard_spec(self, data: tuple[str, ...]) -> P:
        """The spec of the sharded (padded) array: the data axes (then ``spread``) on ``dim``."""
        entries = list(self.spec)
        if self.dim is not None:
            axes = (*data, *self.spread)
            entries[self.dim] = axes if len(axes) > 1 else axes[0]
        return P(*entries)

    def layer(self) -> DimPlan:
        """The plan of one layer's slice of a stacked param."""
        dim = None if self.dim is None else self.dim - 1
        return dataclasses.replace(
            self, shape=self.shape[1:], spec=self.spec[1:], dim=dim, layered=False
        )

    @property
    def padding(self) -> int:
        """Padding elements in the sharded array."""
        return math.prod(self.shard_shape) - math.prod(self.shape)


def plan_param(
    name: str,
    shape: tuple[int, ...],
    dtype: Any,
    spec: P | None,
    n: int,
    layered: bool,
    compiler: Mapping[str, int] | None = None,
    cut: bool = True,
) -> DimPlan:
    """Cuts the first free dim that ``n`` divides, else the largest free dim (padded).

    ``cut=False`` keeps the param whole over the data axes (all-reduced, updated on
    every data rank): a whole-matrix optimizer's params, which no shard may cut.

    The leading free dim first: a scatter along the major dim needs no transpose.
    ``compiler`` (axis -> size) are the step's other axes: those the param is not
    split over spread its shard. A dim ``n x spread`` divides is preferred (and
    spread); failing that one ``n`` divides (kept unspread: no padding); failing
    both, the largest, padded and spread.
    """
    entries = tuple(full_spec(spec, len(shape)))
    used = set(spec_axes(P(*entries)))
    spread = tuple(a for a, size in (compiler or {}).items() if a not in used and size > 1)
    m = math.prod((compiler or {})[a] for a in spread)
    free = [i for i, e in enumerate(entries) if e is None and (i > 0 or not layered)]
    free = [i for i in free if shape[i] > 1 and cut]
    dim = next((i for i in free if shape[i] % (n * m) == 0), None)
    if dim is None:
        dim = next((i for i in free if shape[i] % n == 0), None)
        if dim is not None:
            spread, m = (), 1
    if dim is None and free:
        dim = max(free, key=lambda i: shape[i])
    if dim is None:
        spread, m = (), 1
    padded = 0 if dim is None else -(-shape[dim] // (n * m)) * n * m
    return DimPlan(
        name, tuple(shape), jnp.dtype(dtype).name, entries, dim, padded, layered, spread, m
    )


def pad(x: jax.Array, plan: DimPlan) -> jax.Array:
    if plan.dim is None or plan.padded == x.shape[plan.dim]:
        return x
    widths = [(0, 0)] * x.ndim
    widths[plan.dim] = (0, plan.padded - x.shape[plan.dim])
    return jnp.pad(x, widths)


def unpad(x: jax.Array, plan: DimPlan) -> jax.Array:
    if plan.dim is None or x.shape[plan.dim] == plan.shape[plan.dim]:
        return x
    return jax.lax.slice_in_dim(x, 0, plan.shape[plan.dim], axis=plan.dim)


def on_blocks(
    fn: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    plan: DimPlan,
    in_cut: bool = False,
    out_cut: bool = False,
) -> jax.Array:
    """``fn`` (a data-axis collective) on each block of the param's own split.

    XLA partitions a reduce-scatter or all-gather of the manual data axes only
    as a whole: given an operand split over "model" it gathered it over "model"
    first (8x the bytes on data=8 x model=8, modeled on H100). Run manual over
    the param's other axes too, the collective sees this device's block. The
    ``spread`` axes are manual too; the input (``in_cut``) and the output
    (``out_cut``) are cut over them on ``dim``, else whole.
    """
    axes = set(spec_axes(P(*plan.spec))) | set(plan.spread)
    if not axes:
        return fn(x)
    spec = P(*plan.spec)
    cut = list(plan.spec)
    if plan.spread:
        cut[plan.dim] = plan.spread if len(plan.spread) > 1 else plan.spread[0]
    in_spec, out_spec = (P(*cut) if in_cut else spec), (P(*cut) if out_cut else spec)
    return jax.shard_map(fn, in_specs=in_spec, out_specs=out_spec, axis_names=axes)(x)


def _split(x: jax.Array, dim: int, parts: tuple[int, ...]) -> jax.Array:
    """``x`` with ``dim`` written as ``parts`` (major first)."""
    return x.reshape(*x.shape[:dim], *parts, *x.shape[dim + 1 :])


def _my_slice(x: jax.Array, plan: DimPlan, data: tuple[str, ...]) -> jax.Array:
    """The elements of each data rank's chunk this spread rank keeps: ``[n, M, s/M]``
    at ``[:, m, :]``, back to one dim of ``n x s/M``."""
    n, m = jax.lax.axis_size(data), plan.spread_size
    d = plan.dim
    parts = _split(x, d, (n, m, x.shape[d] // (n * m)))
    mine = jax.lax.dynamic_index_in_dim(
        parts, jax.lax.axis_index(plan.spread), axis=d + 1, keepdims=False
    )
    return mine.reshape(*x.shape[:d], -1, *x.shape[d + 1 :])


def reduce(g: jax.Array, plan: DimPlan, sync: DimSync, scatter: bool | None = None) -> jax.Array:
    """This device's gradient summed over ``sync.axes`` in ``sync.reduce_dtype`` and scaled
    by ``sync.factor``: reduce-scattered along ``plan.dim`` (``scatter``, by default
    ``sync.scatter``), else all-reduced."""
    axes, dtype, factor = sync.axes, sync.reduce_dtype, sync.factor
    scatter = sync.scatter if scatter is None else scatter
    g = to_varying(g.astype(dtype), axes)
    d = plan.dim

    def psum(x: jax.Array) -> jax.Array:
        if sync.wide_sums and jnp.finfo(x.dtype).bits < 32:
            return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
        return jax.lax.psum(x, axes)

    if scatter and d is not None:

        def rs(b: jax.Array) -> jax.Array:
            b = _my_slice(b, plan, axes) if plan.spread else b
            return jax.lax.psum_scatter(b, axes, scatter_dimension=d, tiled=True)

        out = on_blocks(rs, pad(g, plan), plan, out_cut=True)
    elif plan.spread:
        # Hierarchical all-reduce: this spread rank's slice over the data axes, then
        # the slices gathered over the spread axes (1/M of the bytes across hosts).
        def ar(b: jax.Array) -> jax.Array:
            m = plan.spread_size
            b = jax.lax.dynamic_slice_in_dim(
                b, jax.lax.axis_index(plan.spread) * (b.shape[d] // m), b.shape[d] // m, d
            )
            b = psum(b)
            return jax.lax.all_gather(b, plan.spread, axis=d, tiled=True, to="invarying")

        out = unpad(on_blocks(ar, pad(g, plan), plan), plan)
    else:
        out = psum(g)  # elementwise: XLA keeps the other axes' split
    return out * jnp.asarray(factor, out.dtype) if factor != 1 else out


def gather(shard: jax.Array, plan: DimPlan, axes: tuple[str, ...]) -> jax.Array:
    """The whole param from this device's shard (``all_gather`` along ``plan.dim``)."""
    d = plan.dim
    if d is None:
        return shard
    if not plan.spread:
        fn = lambda b: jax.lax.all_gather(b, axes, axis=d, tiled=True, to="invarying")  # noqa: E731
    else:

        def fn(b: jax.Array) -> jax.Array:
            # Over the data axes first (the small pieces cross hosts), then the spread
            # axes into [n, M, s/M]: the data-major layout, with no transpose.
            b = jax.lax.all_gather(b, axes, axis=d, tiled=False, to="invarying")
            b = jax.lax.all_gather(b, plan.spread, axis=d + 1, tiled=False, to="invarying")
            return b.reshape(*b.shape[:d], -1, *b.shape[d + 3 :])

    return unpad(on_blocks(fn, shard, plan, in_cut=True), plan)

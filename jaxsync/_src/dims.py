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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .axes import to_varying, varying_axes
from .tap_rules import TAP_NAME

PyTree = Any


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def full_spec(spec: P | None, ndim: int) -> tuple[Any, ...]:
    """``spec`` written out per dimension."""
    entries = tuple(spec or ())
    return entries + (None,) * (ndim - len(entries))


@dataclasses.dataclass(frozen=True)
class DimPlan:
    """How one param is split over the data axes.

    ``spec`` is the param's own (compiler-axis) spec per dimension; ``dim`` the
    dimension cut over the data axes (None: kept whole), padded to ``padded``.
    A stacked group's param has ``layered=True``: dim 0 is the layer axis, never cut.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[Any, ...]
    dim: int | None
    padded: int
    layered: bool = False

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The global shape of the padded array the shards are cut from."""
        if self.dim is None:
            return self.shape
        return tuple(self.padded if i == self.dim else s for i, s in enumerate(self.shape))

    def local_shape(self, data: tuple[str, ...]) -> tuple[int, ...]:
        """This data rank's shard's shape (inside the step's shard_map)."""
        if self.dim is None:
            return self.shape
        n = jax.lax.axis_size(data)
        return tuple(self.padded // n if i == self.dim else s for i, s in enumerate(self.shape))

    def shard_spec(self, data: tuple[str, ...]) -> P:
        """The spec of the sharded (padded) array: the data axes on ``dim``."""
        entries = list(self.spec)
        if self.dim is not None:
            entries[self.dim] = data if len(data) > 1 else data[0]
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
    name: str, shape: tuple[int, ...], dtype: Any, spec: P | None, n: int, layered: bool
) -> DimPlan:
    """Cuts the first free dim that ``n`` divides, else the largest free dim (padded).

    The leading free dim first: a scatter along the major dim needs no transpose.
    """
    entries = full_spec(spec, len(shape))
    free = [i for i, e in enumerate(entries) if e is None and (i > 0 or not layered)]
    free = [i for i in free if shape[i] > 1]
    dim = next((i for i in free if shape[i] % n == 0), None)
    if dim is None and free:
        dim = max(free, key=lambda i: shape[i])
    padded = 0 if dim is None else -(-shape[dim] // n) * n
    return DimPlan(name, tuple(shape), jnp.dtype(dtype).name, entries, dim, padded, layered)


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


def on_blocks(fn: Callable[[jax.Array], jax.Array], x: jax.Array, plan: DimPlan) -> jax.Array:
    """``fn`` (a data-axis collective) on each block of the param's own split.

    XLA partitions a reduce-scatter or all-gather of the manual data axes only
    as a whole: given an operand split over "model" it gathered it over "model"
    first (8x the bytes on data=8 x model=8, modeled on H100). Run manual over
    the param's other axes too, the collective sees this device's block.
    """
    axes = {a for e in plan.spec for a in spec_axes(e)}
    if not axes:
        return fn(x)
    spec = P(*plan.spec)
    return jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names=axes)(x)


def reduce(
    g: jax.Array, plan: DimPlan, axes: tuple[str, ...], dtype: Any, factor: float, scatter: bool
) -> jax.Array:
    """This device's gradient summed over ``axes`` in ``dtype`` and scaled by ``factor``:
    reduce-scattered along ``plan.dim`` (``scatter``), else all-reduced."""
    g = to_varying(g.astype(dtype), axes)
    if scatter and plan.dim is not None:
        out = on_blocks(
            lambda b: jax.lax.psum_scatter(b, axes, scatter_dimension=plan.dim, tiled=True),
            pad(g, plan), plan,
        )  # fmt: skip
    else:
        out = jax.lax.psum(g, axes)  # elementwise: XLA keeps the other axes' split
    return out * jnp.asarray(factor, out.dtype) if factor != 1 else out


def gather(shard: jax.Array, plan: DimPlan, axes: tuple[str, ...]) -> jax.Array:
    """The whole param from this device's shard (``all_gather`` along ``plan.dim``)."""
    if plan.dim is None:
        return shard
    whole = on_blocks(
        lambda b: jax.lax.all_gather(b, axes, axis=plan.dim, tiled=True, to="invarying"),
        shard, plan,
    )  # fmt: skip
    return unpad(whole, plan)


# ---------------------------------------------------------------- the views


@dataclasses.dataclass(frozen=True)
class DimSync:
    """How a step reduces: ``scatter`` (ZeRO), all-reduce (DDP) or ``gather`` (FSDP)."""

    axes: tuple[str, ...]
    reduce_dtype: str
    factor: float
    scatter: bool
    compute_dtype: str | None = None  # FSDP: the dtype the gathered param is used in
    fsdp: bool = False


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    return to_varying(x.astype(like.dtype), tuple(sorted(varying_axes(like))))


@functools.cache
def _reduce_tap(group: str) -> Callable[..., Any]:
    """Identity on a layer's params whose backward reduces their gradient into the
    sinks' cotangents (ZeRO/DDP in-loop sync), named for :mod:`tap_rules`."""

    def impl(spec: tuple, params: list, sinks: list) -> list:
        del spec, sinks
        return params

    def fwd(spec: tuple, params: list, sinks: list) -> tuple[list, None]:
        del spec, sinks
        return params, None

    def bwd(spec: tuple, _: None, ct: list) -> tuple[None, list]:
        # The sinks' types match what the reduction returns (spec_step._sink).
        sync, plans = spec
        return None, [
            reduce(g, p, sync.axes, sync.reduce_dtype, sync.factor, sync.scatter)
            for g, p in zip(ct, plans, strict=True)
        ]

    impl.__name__ = impl.__qualname__ = TAP_NAME.format(group=group)
    fn = jax.custom_vjp(impl, nondiff_argnums=(0,))
    fn.defvjp(fwd, bwd)
    return fn


@functools.cache
def _gather_tap(group: str) -> Callable[..., Any]:
    """FSDP: a layer's (or a param's) shard gathered in the forward, its gradient
    reduce-scattered back in the backward (recomputed under remat)."""

    def impl(spec: tuple, shards: list) -> list:
        sync, plans = spec
        # Typed varying over the data axes: the model's use of an invariant value
        # would be transposed into a hidden all-reduce of its gradient.
        return [
            to_varying(gather(s.astype(sync.compute_dtype or s.dtype), p, sync.axes), sync.axes)
            for s, p in zip(shards, plans, strict=True)
        ]

    def fwd(spec: tuple, shards: list) -> tuple[list, list]:
        return impl(spec, shards), [_varying_like(jnp.zeros((0,)), s) for s in shards]

    def bwd(spec: tuple, like: list, ct: list) -> tuple[list]:
        sync, plans = spec
        out = []
        for g, p, s in zip(ct, plans, like, strict=True):
            r = reduce(g, p, sync.axes, sync.reduce_dtype, sync.factor, True)
            out.append(_varying_like(r, s))
        return (out,)

    impl.__name__ = impl.__qualname__ = TAP_NAME.format(group=group)
    fn = jax.custom_vjp(impl, nondiff_argnums=(0,))
    fn.defvjp(fwd, bwd)
    return fn


def gather_params(shards: list, plans: list, sync: DimSync, name: str = "") -> list:
    """FSDP's free params, gathered (and reduce-scattered in the backward)."""
    return _gather_tap(name or "params")((sync, tuple(plans)), list(shards))


@dataclasses.dataclass(frozen=True)
class DimTapSpec:
    group: str
    sync: DimSync
    plans: tuple[DimPlan, ...]  # per leaf of the group, layer plans
    treedef: Any


@jax.tree_util.register_pytree_node_class
class DimStack:
    """A stacked group as the model sees it in a 2-D step (``lax.scan`` slices it).

    ZeRO/DDP: the stacked params and one sink per leaf (``[L, shard]``) whose
    cotangent receives the reduced gradient; FSDP: the stacked shards only.
    :func:`jaxsync.tap` on a layer's slice returns the layer's params.
    """

    def __init__(self, params: Any, sinks: Any, spec: DimTapSpec):
        self.params, self.sinks, self.spec = params, sinks, spec

    def tree_flatten(self) -> tuple[tuple[Any, Any], DimTapSpec]:
        return (self.params, self.sinks), self.spec

    @classmethod
    def tree_unflatten(cls, spec: DimTapSpec, children: Any) -> DimStack:
        return cls(*children, spec)

    @property
    def holds_shards(self) -> bool:
        return self.spec.sync.fsdp

    def jaxsync_tap(self) -> PyTree:
        spec = self.spec
        leaves = jax.tree.leaves(self.params)
        for leaf, plan in zip(leaves, spec.plans, strict=True):
            want = plan.local_shape(spec.sync.axes) if spec.sync.fsdp else plan.shape
            if tuple(leaf.shape) != want:
                raise ValueError(
                    f"jaxsync.tap got param {plan.name} of stacked group {spec.group!r} with "
                    f"shape {tuple(leaf.shape)}; one layer's slice has shape {want}. Call it "
                    "inside the scanned layer body, on the slice `lax.scan` passes in."
                )
        key = (spec.sync, spec.plans)
        if spec.sync.fsdp:
            out = _gather_tap(spec.group)(key, leaves)
        else:
            out = _reduce_tap(spec.group)(key, leaves, jax.tree.leaves(self.sinks))
        return jax.tree.unflatten(spec.treedef, out)

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(_NOT_TAPPED.format(group=self.spec.group))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("params", "sinks", "spec"):
            raise AttributeError(name)
        raise TypeError(_NOT_TAPPED.format(group=self.spec.group))


_NOT_TAPPED = (
    "this is jaxsync's view of the stacked-layer group {group!r}, not its params: call "
    "`p = jaxsync.tap(p)` on the layer's slice first thing in the scanned layer body."
)

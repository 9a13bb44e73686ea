"""The stacked-layer views of a 2-D step: in-loop reduction and FSDP gather taps.

On a mesh where the compiler shards the model too, a stacked group reaches the
model as a :class:`DimStack`; :func:`jaxsync.tap` on a layer's slice runs a
custom_vjp whose backward reduces that layer's gradients over the data axes
(:func:`dims.reduce`) inside the backward scan, or, under FSDP, gathers the
layer's shards in the forward and reduce-scatters their gradients back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ...core.axes import to_varying, varying_axes
from ...sync.tap_rules import TAP_NAME, WHOLE_STACK
from ...sync.views import GATHERED, SCAN_HELPERS
from .dims import DimPlan, DimSync, gather, reduce

PyTree = Any


def defers(plan: DimPlan, sync: DimSync) -> bool:
    """Whether a param's in-loop reduction is left to after the loop.

    ZeRO/FSDP reduce-scatter a layer's gradients in one combined collective; a
    param with no dim to cut (a "model"-split bias) would need an all-reduce of
    its own per layer, a few KiB that cost a cross-host latency each (0.5 ms
    modeled on 64 x H100). Its gradient is summed over the layers unreduced and
    all-reduced once, for every layer together, after the backward.
    """
    return sync.scatter and plan.dim is None


def deferred(g: jax.Array, sync: DimSync) -> jax.Array:
    """A gradient :func:`defers` leaves unreduced: in the reduction dtype, per device."""
    return to_varying(g.astype(sync.reduce_dtype), sync.axes)


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    return to_varying(x.astype(like.dtype), tuple(sorted(varying_axes(like))))


@functools.cache
def _reduce_tap(group: str) -> Callable[..., Any]:
    """Identity on a layer's params whose backward reduces their gradient into the
    sinks' cotangents (ZeRO/DDP in-loop sync), named for :mod:`tap_rules`. With
    ``acc`` (the layer's local gradients of the earlier microbatches, fp32) the
    sum is added first, so a step reduces once however many microbatches it has."""

    def impl(spec: tuple, params: list, sinks: list, acc: list | None) -> list:
        del spec, sinks, acc
        return params

    def fwd(spec: tuple, params: list, sinks: list, acc: list | None) -> tuple[list, Any]:
        del spec, sinks
        return params, acc

    def bwd(spec: tuple, acc: list | None, ct: list) -> tuple[None, list, None]:
        # The sinks' types match what the reduction returns (two_d.body._sink).
        sync, plans = spec
        if acc is not None:
            ct = [g.astype(jnp.float32) + a for g, a in zip(ct, acc, strict=True)]
        return None, [
            deferred(g, sync) if defers(p, sync) else
            reduce(g, p, sync)
            for g, p in zip(ct, plans, strict=True)
        ], None  # fmt: skip

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
            r = deferred(g, sync) if defers(p, sync) else reduce(g, p, sync, scatter=True)
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

    ZeRO/DDP: the stacked params, one sink per leaf (``[L, shard]``) whose
    cotangent receives the reduced gradient, and (the last microbatch of a step
    with several) the earlier microbatches' local gradients; FSDP: the stacked
    shards only. :func:`jaxsync.tap` on a layer's slice returns the layer's params.
    """

    def __init__(self, params: Any, sinks: Any, acc: Any, spec: DimTapSpec):
        self.params, self.sinks, self.acc, self.spec = params, sinks, acc, spec

    def tree_flatten(self) -> tuple[tuple[Any, Any, Any], DimTapSpec]:
        return (self.params, self.sinks, self.acc), self.spec

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
            if leaf.ndim == len(want) + 1 and tuple(leaf.shape[1:]) == tuple(want):
                # [L, ...]: the whole stack
                what = (
                    f"param {plan.name} with shape {tuple(leaf.shape)}; one layer's slice "
                    f"has shape {tuple(want)}"
                )
                raise ValueError(WHOLE_STACK.format(group=spec.group, what=what))
            if tuple(leaf.shape) != want:
                raise ValueError(
                    f"jaxsync.tap got param {plan.name} of stacked group {spec.group!r} with "
                    f"shape {tuple(leaf.shape)}; one layer's slice has shape {want}. Call it "
                    "inside the scanned layer body, on the slice `lax.scan` passes in."
                )
        key = (spec.sync, spec.plans)
        if spec.sync.fsdp:
            # Named as on a 1-D mesh: save_only_these_names(GATHERED) keeps the
            # gathered layer for the backward instead of gathering it again.
            out = [checkpoint_name(x, GATHERED) for x in _gather_tap(spec.group)(key, leaves)]
        else:
            acc = None if self.acc is None else jax.tree.leaves(self.acc)
            out = _reduce_tap(spec.group)(key, leaves, jax.tree.leaves(self.sinks), acc)
        return jax.tree.unflatten(spec.treedef, out)

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(_NOT_TAPPED.format(group=self.spec.group))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("params", "sinks", "acc", "spec"):
            raise AttributeError(name)
        raise TypeError(_NOT_TAPPED.format(group=self.spec.group))


_NOT_TAPPED = (
    "this is jaxsync's view of the stacked-layer group {group!r}, not its params: call "
    "`p = jaxsync.tap(p)` on the layer's slice first thing in the scanned layer body ("
    + SCAN_HELPERS
    + ")."
)

"""The 1-D data-parallel tap: a layer's gradient reduced inside the backward scan.

:class:`LayerStack` is the view a stacked group becomes under
``value_and_grad(sync=...)``; its tap is a custom VJP whose backward packs the
layer's gradient into its buckets and reduce-scatters (or all-reduces) them in the
iteration that computes it, so the collectives overlap the rest of the backward.

A view may also hold the distributed optimizer's master rows instead of the params
(``TapSpec.gathered``): its tap then all-gathers the layer in the forward, in the
params' dtype, where it overlaps the previous layer's compute (Megatron's
``overlap_param_gather``), so the step needs no gather of the stacked params
after its update.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..core.axes import to_varying, varying_axes
from ..layout.layout import Layout
from .collectives import buffer_axes, reduce_bucket, scale_by
from .tap_rules import TAP_NAME, WHOLE_STACK
from .views import GATHERED, NOT_TAPPED

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TapSpec:
    """Static description of one stacked group, carried by its :class:`LayerStack`."""

    group: str
    layout: Layout
    buffers: tuple[int, ...]
    slots: tuple[int, ...]  # layout slot of each synced leaf of the group, in its tree order
    axes: tuple[str, ...]
    scatter: bool
    reduce_dtype: str  # the buckets' (and sinks') dtype; "": each buffer's own
    factor: float
    # Positions (in the group's leaf order) of leaves not synced in the loop: those
    # of whole-matrix optimizers, whose gradient leaves the scan and is reduced after.
    passthrough: tuple[int, ...] = ()
    # The group's treedef when the view holds master rows (one [L, shard] per
    # buffer) and the tap gathers each layer from them; None: it holds the params.
    gathered: Any = None
    # Whether the loop flags each leaf's non-finite local gradient; False where the
    # sinks hand on the local gradient itself (one contribution: the step reads the
    # flags off the sinks after the loop, in the pass that reads them anyway).
    flags: bool = True


@jax.tree_util.register_pytree_node_class
class LayerStack:
    """A stacked-layer group as the model sees it under in-loop sync.

    A pytree whose children are the stacked params, one sink per bucket and
    (for the last microbatch) the gradients accumulated so far, so ``lax.scan``
    over it hands each iteration one layer of each. Pass the layer's slice to
    :func:`tap` to get its params.
    """

    def __init__(self, params: PyTree, sinks: Any, acc: Any, spec: TapSpec):
        self.params, self.sinks, self.acc, self.spec = params, sinks, acc, spec

    def tree_flatten(self) -> tuple[tuple[Any, Any, Any], TapSpec]:
        return (self.params, self.sinks, self.acc), self.spec

    @classmethod
    def tree_unflatten(cls, spec: TapSpec, children: Any) -> LayerStack:
        return cls(*children, spec)

    @property
    def holds_shards(self) -> bool:
        """Whether the model sees placeholders until the tap gathers a layer (master
        rows, as FSDP's views), not the params themselves."""
        return getattr(self.spec, "gathered", None) is not None

    def jaxsync_tap(self) -> PyTree:
        """This layer's params; its gradient reduced in the backward loop (:func:`tap`)."""
        spec = self.spec
        if spec.gathered is not None:
            return _gathered_tap(spec, self.params, self.sinks, self.acc)
        leaves = _synced(spec, jax.tree.leaves(self.params))
        for si, leaf in zip(spec.slots, leaves, strict=True):
            slot = spec.layout.slots[si]
            if leaf.ndim == len(slot.row_shape) + 1 and leaf.shape[1:] == slot.row_shape:
                # [L, ...]: the whole stack
                what = (
                    f"param {slot.path} with shape {tuple(leaf.shape)}; one layer's slice "
                    f"has shape {slot.row_shape}"
                )
                raise ValueError(WHOLE_STACK.format(group=spec.group, what=what))
            if tuple(leaf.shape) != slot.row_shape:
                raise ValueError(
                    f"jaxsync.tap got param {slot.path} of stacked group {spec.group!r} with "
                    f"shape {tuple(leaf.shape)}; one layer's slice has shape {slot.row_shape}. "
                    "Call it inside the scanned layer body, on the slice `lax.scan` passes in."
                )
        return _tap_of(spec.group)(spec, self.params, self.sinks, self.acc)

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(NOT_TAPPED.format(group=self.spec.group))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("params", "sinks", "acc", "spec"):
            raise AttributeError(name)
        raise TypeError(NOT_TAPPED.format(group=self.spec.group))


def _gathered_tap(spec: TapSpec, rows: tuple[jax.Array, ...], sinks: Any, acc: Any) -> PyTree:
    """The tap of a view holding master rows: checks it got one layer's rows."""
    layout = spec.layout
    for bi, row in zip(spec.buffers, rows, strict=True):
        want = (layout.shard_size(bi),)
        if tuple(row.shape) != want:
            what = f"master rows of shape {tuple(row.shape)}; one layer's row has shape {want}"
            raise ValueError(WHOLE_STACK.format(group=spec.group, what=what))
    layer = _tap_of(spec.group, True)(spec, rows, sinks, acc)
    # Named, so a remat policy can keep the gathered layer for the backward (ZeRO
    # with reshard_after_forward=False adds the name to every policy around the tap:
    # remat_keep.keep_gathered).
    return jax.tree.map(lambda x: checkpoint_name(x, GATHERED), layer)


def gather_layer(spec: TapSpec, rows: tuple[jax.Array, ...]) -> PyTree:
    """One layer's params from this rank's master rows: cast to each buffer's
    dtype, all-gathered bucket by bucket, unpacked into the group's subtree.

    Gathered device-varying (no ``to="invarying"``): typed replicated, JAX would
    psum the layer's cotangent before the tap's backward reduces it.
    """
    layout = spec.layout
    by_slot: dict[int, jax.Array] = {}
    for bi, row in zip(spec.buffers, rows, strict=True):
        dtype = jnp.dtype(layout.buffers[bi].key.dtype)
        axes = buffer_axes(layout, bi, spec.axes)
        pieces = [
            jax.lax.all_gather(p.astype(dtype), axes, axis=0, tiled=True)
            for p in layout.split_shard(bi, row)
        ]
        by_slot.update(layout.unpack_leaves([pieces], [bi], rows=True))
    return jax.tree.unflatten(spec.gathered, [by_slot[si] for si in spec.slots])


@functools.cache
def _tap_of(group: str, gathers: bool = False) -> Callable[..., PyTree]:
    """The tap's custom_vjp for ``group``, named so the jaxpr shows which group it taps
    (:mod:`tap_rules` reads the taps from there)."""

    def tap_impl(spec: TapSpec, params: PyTree, sinks: Any, acc: Any) -> PyTree:
        del spec, sinks, acc
        return params

    def gather_impl(spec: TapSpec, rows: Any, sinks: Any, acc: Any) -> PyTree:
        del sinks, acc
        return gather_layer(spec, rows)

    impl = gather_impl if gathers else tap_impl
    impl.__name__ = impl.__qualname__ = TAP_NAME.format(group=group)
    fn = jax.custom_vjp(impl, nondiff_argnums=(0,))
    fn.defvjp(_gather_fwd if gathers else _tap_fwd, _gather_bwd if gathers else _tap_bwd)
    return fn


def _tap_fwd(spec: TapSpec, params: PyTree, sinks: Any, acc: Any) -> tuple[PyTree, Any]:
    del spec
    # Only the sinks' types travel to the backward (empty arrays of their dtype
    # and device-varying axes), never their values.
    like = jax.tree.map(lambda s: _like(jnp.zeros((0,), s.dtype), s), sinks)
    return params, (acc, like)


def _gather_fwd(spec: TapSpec, rows: Any, sinks: Any, acc: Any) -> tuple[PyTree, Any]:
    return _tap_fwd(spec, gather_layer(spec, rows), sinks, acc)


def _gather_bwd(spec: TapSpec, res: Any, ct: PyTree) -> tuple[None, Any, None]:
    # The master rows get no cotangent: the layer's reduced gradient goes to the sinks.
    _, sinks_ct, _ = _tap_bwd(spec, res, ct)
    return None, sinks_ct, None


def _tap_bwd(spec: TapSpec, res: Any, ct: PyTree) -> tuple[None, Any, None]:
    acc, (like, like_flags) = res
    layout = spec.layout
    all_ct, treedef = jax.tree.flatten(ct)
    leaves = _synced(spec, all_ct)
    # Which leaves had a non-finite *local* gradient, before any reduction (for
    # the distributed optimizer's skipped-step report). Not core.tree_reduce's
    # float sums, which compile faster on CPU: inside the layer loop they held
    # 153 MiB more per H100 (ZeRO, 7.2B Llama-style, 64 GPUs; no change at 8).
    if spec.flags:
        flags = jnp.stack([jnp.logical_not(jnp.all(jnp.isfinite(g))) for g in leaves])
    else:
        flags = jnp.zeros((len(leaves),), jnp.bool_)
    by_slot: list[Any] = [None] * len(layout.slots)
    for si, leaf in zip(spec.slots, leaves, strict=True):
        by_slot[si] = leaf
    packed = layout.pack_leaves(by_slot, spec.buffers, spec.reduce_dtype or None, rows=True)
    if acc is not None:
        packed = jax.tree.map(jnp.add, packed, acc)
    out = []
    for bi, buckets, sinks in zip(spec.buffers, packed, like, strict=True):
        key = layout.buffers[bi].key
        baxes = buffer_axes(layout, bi, spec.axes)
        reduced = []
        for bucket, sink in zip(buckets, sinks, strict=True):
            r = reduce_bucket(bucket, key, baxes, scatter=spec.scatter, in_loop=True)
            r = scale_by(r, spec.factor)
            reduced.append(_like(r, sink))
        out.append(tuple(reduced))
    params_ct = None
    if spec.passthrough:  # their gradient flows on, out of the scan
        keep = set(spec.passthrough)
        params_ct = jax.tree.unflatten(
            treedef, [g if j in keep else jnp.zeros_like(g) for j, g in enumerate(all_ct)]
        )
    return params_ct, (tuple(out), _like(flags, like_flags)), None


def _synced(spec: TapSpec, leaves: list[Any]) -> list[Any]:
    return [x for j, x in enumerate(leaves) if j not in spec.passthrough]


def _like(x: jax.Array, sink: jax.Array) -> jax.Array:
    """``x`` in the sink's dtype, typed device-varying over every axis it varies over."""
    return to_varying(x.astype(sink.dtype), tuple(sorted(varying_axes(sink))))

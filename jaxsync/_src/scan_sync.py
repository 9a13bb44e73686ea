"""Gradient sync inside a scanned layer loop: one tap per layer, reduced in the backward scan.

Large JAX models stack each layer's params as ``[L, ...]`` and run them with
``lax.scan``. Plain ``jax.grad`` hands back the stacked gradients only after the
whole backward loop, so a sync placed after it has nothing left to overlap with.
Here the user's layer body calls :func:`tap` on its layer's params; under
:func:`jaxsync.value_and_grad` with ``sync=...`` the stacked group reaches the
model as a :class:`LayerStack` view that carries, besides the params, one
*sink* per bucket (zeros, ``[L, shard]``). ``lax.scan`` slices the view like any
pytree, and the tap is an identity whose custom backward packs the layer's
gradient into its buckets and reduces them (``psum_scatter`` for the
distributed optimizer, ``psum`` for plain data parallelism) into the sink's
cotangent. The collective therefore sits in the loop iteration that produced
the gradient, and the gradients leave the loop already reduced (and, for the
distributed optimizer, sharded: ZeRO-2).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .axes import AxisName, bound_axes, normalize_axes, to_varying, varying_axes
from .collectives import buffer_axes, mean_factor, reduce_bucket, reduce_scatter_packed, scale_by
from .finalize import SyncRules, local_view, sync_keys
from .layout import BufferKey, Layout
from .names import in_group, param_name
from .optimizer_state import ShardedGrads
from .placement import build_layout, check_bucket_size, normalize_stacked
from .tap_rules import TAP_NAME, check_taps

PyTree = Any

NOT_TAPPED = (
    "this is jaxsync's view of the stacked-layer group {group!r}, not its params: call "
    "`p = jaxsync.tap(p)` on the layer's slice first thing in the scanned layer body "
    "(it returns the layer's params and syncs their gradient inside the backward loop)."
)


NEVER_TAPPED = (
    "the stacked-layer group(s) {groups} reached the loss function as jaxsync's view, but "
    "no scanned layer body passed its layer through `jaxsync.tap`, so their gradients would "
    "be lost. Call `p = jaxsync.tap(p)` on each layer's slice in the scanned body (flax "
    "NNX: run the stacked module with `jaxsync.scan_layers`), or drop them from `stacked=`."
)


HAND_MERGE = (
    "jaxsync: the stacked-layer group(s) {groups} reach the loss function as jaxsync's views "
    "({kind}), not as dicts of params, so a hand-written `nnx.replace_by_pure_dict` / "
    "`nnx.merge` cannot take them. Merge the module with "
    "`jaxsync.merge_module(graphdef, *states, params=params)`, which hands each view to "
    "`jaxsync.scan_layers`, or train with `jaxsync.train_step`, which merges for you."
)

# The stacked-layer views of modules merged while a loss function is traced, by the
# id of the submodule that holds the group (see jaxsync.merge_module). Set only for
# the duration of one traced call (a context, like a trace-time argument), so no
# view outlives its trace and no id is ever read for another object.
_VIEWS: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "jaxsync_views", default=None
)


@contextlib.contextmanager
def trace_views() -> Iterator[None]:
    """Scopes the views that module merges register to one traced loss call."""
    token = _VIEWS.set({})
    try:
        yield
    finally:
        _VIEWS.reset(token)


def call_with_views(
    fun: Callable[..., Any], groups: Sequence[str], kind: str
) -> Callable[..., Any]:
    """``fun`` run in a views scope; a flax pure-dict error gets a note on what to do.

    A loss that merges an NNX module by hand from params holding views fails inside
    flax (``key in pure_dict not available in state: ('blocks',)``); the note names
    the groups and the jaxsync call that merges them.
    """

    def scoped(*args: Any) -> Any:
        with trace_views():
            try:
                return fun(*args)
            except ValueError as e:
                if groups and "pure_dict" in str(e):
                    e.add_note(HAND_MERGE.format(groups=sorted(groups), kind=kind))
                raise

    return scoped


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Plain data parallelism (bucketed all-reduce) as a ``sync`` for value_and_grad.

    Every rank keeps the whole optimizer state; use any optax optimizer on the
    reduced gradients that :func:`jaxsync.value_and_grad` returns with
    ``sync=DataParallel(...)``. Stacked groups are all-reduced layer by layer
    inside the backward scan, the other params bucket by bucket after it.

    Attributes:
      axis_name: data-parallel mesh axis (or axes).
      bucket_size: elements per bucket (per layer for stacked groups); None: one.
      reduce_dtype: dtype the gradients are summed in (fp32 for bf16 models).
      rules: :class:`jaxsync.SyncRules` for pipeline / tensor / expert reductions.
      stacked: dotted prefixes of stacked-layer groups (``"blocks"``).
    """

    axis_name: AxisName
    bucket_size: int | None = None
    reduce_dtype: Any = jnp.float32
    rules: SyncRules | None = None
    stacked: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis_name", normalize_axes(self.axis_name))
        object.__setattr__(self, "stacked", normalize_stacked(self.stacked))
        check_bucket_size(self.bucket_size)

    def layout(self, params: PyTree) -> Layout:
        """The all-reduce layout of local ``params`` (inside shard_map)."""
        shape = dict(jax.sharding.get_abstract_mesh().shape)
        syncs = sync_keys(self.rules, params, self.axis_name, shape)
        by_path = {
            jax.tree_util.keystr(p): s
            for (p, _), s in zip(
                jax.tree_util.tree_flatten_with_path(params)[0], syncs, strict=True
            )
        }

        def key_fn(path: str, leaf: Any) -> BufferKey:
            s = by_path[path]
            return BufferKey(jnp.dtype(leaf.dtype).name, s.dp_axes, None, s.sum_axes, s.mean_axes)

        return build_layout(
            params, bucket_size=self.bucket_size, key_fn=key_fn, stacked=self.stacked
        )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one traced sync needs: the layout and how to reduce its buckets."""

    layout: Layout
    axes: tuple[str, ...]
    scatter: bool
    reduce_dtype: str
    rules: SyncRules | None


def _optimizer_plan(sync: Any) -> Any:
    """The distributed optimizer's plan behind ``sync``, or a clear error."""
    config = getattr(sync, "__dict__", {}).get("config")
    if config is None or not hasattr(config, "layout_inside"):
        raise TypeError(
            f"`sync` must be a jaxsync.DataParallel or a jaxsync.distributed_optimizer, got "
            f"{type(sync).__name__}. For FSDP use `FullyShard.value_and_grad`."
        )
    return config


def sync_rules(sync: Any) -> SyncRules | None:
    """The finalize rules a sync reduces with (so local passes use the same ones)."""
    return sync.rules if isinstance(sync, DataParallel) else _optimizer_plan(sync).rules


def _plan(sync: Any, params: PyTree, fn: str) -> _Plan:
    if isinstance(sync, DataParallel):
        axes = bound_axes(sync.axis_name, fn)
        dtype = jnp.dtype(sync.reduce_dtype or jnp.float32).name
        return _Plan(sync.layout(params), axes, False, dtype, sync.rules)
    config = _optimizer_plan(sync)
    axes = bound_axes(config.axes, fn)
    layout = config.layout_inside(params)
    return _Plan(layout, axes, True, jnp.dtype(config.reduce_dtype).name, config.rules)


@dataclasses.dataclass(frozen=True)
class TapSpec:
    """Static description of one stacked group, carried by its :class:`LayerStack`."""

    group: str
    layout: Layout
    buffers: tuple[int, ...]
    slots: tuple[int, ...]  # layout slot of each synced leaf of the group, in its tree order
    axes: tuple[str, ...]
    scatter: bool
    reduce_dtype: str
    factor: float
    # Positions (in the group's leaf order) of leaves not synced in the loop: those
    # of whole-matrix optimizers, whose gradient leaves the scan and is reduced after.
    passthrough: tuple[int, ...] = ()


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

    holds_shards = False  # the model's params are in it (FSDP's views hold shards)

    def jaxsync_tap(self) -> PyTree:
        """This layer's params; its gradient reduced in the backward loop (:func:`tap`)."""
        spec = self.spec
        leaves = _synced(spec, jax.tree.leaves(self.params))
        for si, leaf in zip(spec.slots, leaves, strict=True):
            slot = spec.layout.slots[si]
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


def tap(layer: Any) -> Any:
    """Returns a scanned layer's params; its gradient is synced in the backward loop.

    Call it on the layer's slice at the top of the scanned layer body. Under
    :func:`jaxsync.value_and_grad` with ``sync=`` (or ``FullyShard.value_and_grad``),
    the layer's gradient is reduced (reduce-scattered for the distributed
    optimizer, all-reduced for :class:`DataParallel`; for FSDP the layer's shard
    is also all-gathered here) inside the iteration of the backward scan that
    computes it. Anywhere else (plain ``jax.grad``, evaluation) it returns
    ``layer`` unchanged, so the same model code runs everywhere.

    Rules (checked when the step is traced, see :mod:`jaxsync._src.tap_rules`):
    every stacked group is tapped; the tap is not inside a ``lax.cond``/
    ``lax.switch`` branch whose predicate depends on the data (its collective
    would run on some devices only and deadlock: tap first, outside the branch,
    and pass the tapped params into the branches; FSDP, whose forward gather
    is a collective too, is checked the same way);
    with microbatches each layer is tapped once per step (one tap per scanned
    body, one scan over the stack, not nested in another loop).

    Example:
      >>> def body(x, p):
      ...     p = jaxsync.tap(p)
      ...     return block(p, x), None
      >>> x, _ = jax.lax.scan(body, x, params["blocks"])
    """
    # Every jaxsync view of a stacked group (LayerStack here, FSDP's ShardedLayers,
    # a 2-D step's DimStack) taps itself; anything else is the layer's own params.
    own = getattr(type(layer), "jaxsync_tap", None)
    return layer if own is None else own(layer)


def is_view(x: Any) -> bool:
    """jaxsync's stand-in for a stacked group (LayerStack, FSDP's sharded layers, a
    2-D step's DimStack): each taps itself. The type is asked, not the view, whose
    ``__getattr__`` refuses every name to catch a model reading it untapped."""
    return hasattr(type(x), "jaxsync_tap")


@functools.cache
def _tap_of(group: str) -> Callable[..., PyTree]:
    """The tap's custom_vjp for ``group``, named so the jaxpr shows which group it taps
    (:mod:`tap_rules` reads the taps from there)."""

    def tap_impl(spec: TapSpec, params: PyTree, sinks: Any, acc: Any) -> PyTree:
        del spec, sinks, acc
        return params

    tap_impl.__name__ = tap_impl.__qualname__ = TAP_NAME.format(group=group)
    fn = jax.custom_vjp(tap_impl, nondiff_argnums=(0,))
    fn.defvjp(_tap_fwd, _tap_bwd)
    return fn


def _tap_fwd(spec: TapSpec, params: PyTree, sinks: Any, acc: Any) -> tuple[PyTree, Any]:
    del spec
    # Only the sinks' types travel to the backward (empty arrays of their dtype
    # and device-varying axes), never their values.
    like = jax.tree.map(lambda s: _like(jnp.zeros((0,), s.dtype), s), sinks)
    return params, (acc, like)


def _tap_bwd(spec: TapSpec, res: Any, ct: PyTree) -> tuple[None, Any, None]:
    acc, (like, like_flags) = res
    layout = spec.layout
    all_ct, treedef = jax.tree.flatten(ct)
    leaves = _synced(spec, all_ct)
    # Which leaves had a non-finite *local* gradient, before any reduction (for
    # the distributed optimizer's skipped-step report).
    flags = jnp.stack([jnp.logical_not(jnp.all(jnp.isfinite(g))) for g in leaves])
    by_slot: list[Any] = [None] * len(layout.slots)
    for si, leaf in zip(spec.slots, leaves, strict=True):
        by_slot[si] = leaf
    packed = layout.pack_leaves(by_slot, spec.buffers, spec.reduce_dtype, rows=True)
    if acc is not None:
        packed = jax.tree.map(jnp.add, packed, acc)
    out = []
    for bi, buckets, sinks in zip(spec.buffers, packed, like, strict=True):
        key = layout.buffers[bi].key
        baxes = buffer_axes(layout, bi, spec.axes)
        reduced = []
        for bucket, sink in zip(buckets, sinks, strict=True):
            r = scale_by(reduce_bucket(bucket, key, baxes, scatter=spec.scatter), spec.factor)
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


def _sink_axes(plan: _Plan, bi: int) -> tuple[str, ...]:
    key = plan.layout.buffers[bi].key
    dp = buffer_axes(plan.layout, bi, plan.axes) if plan.scatter else ()
    return tuple(dict.fromkeys(dp + key.varying))


def sync_value_and_grad(
    fun: Callable[..., Any],
    sync: Any,
    params: PyTree,
    args: Sequence[Any],
    *,
    has_aux: bool = False,
    acc: PyTree | None = None,
    microbatches: int = 1,
    fn: str = "jaxsync.value_and_grad",
) -> tuple[Any, Any]:
    """``fun(params, *args)``'s value and gradients, reduced as ``sync`` plans.

    Args:
      acc: local gradients summed over earlier microbatches (fp32, shaped like
        the params), added before the reduction so the step syncs once.
      microbatches: divides the reduced sum, so the result is the mean.

    Returns:
      ``(value, grads)``: grads are :class:`ShardedGrads` for a distributed
      optimizer, else the reduced gradient tree.
    """
    plan = _plan(sync, params, fn)
    layout = plan.layout
    leaves = layout.check_tree(params, "params")
    treedef = layout.treedef
    stacks = layout.stacks()
    stacked_bufs = tuple(bi for bufs in stacks.values() for bi in bufs)
    free_bufs = tuple(bi for bi in range(len(layout.buffers)) if bi not in stacked_bufs)
    in_stack = {si for bi in stacked_bufs for si in layout.buffers[bi].slots}
    free = [i for i in range(len(leaves)) if i not in in_stack]
    varying = jax.tree.leaves(local_view(params, plan.axes, plan.rules))
    factor = mean_factor(plan.axes, True, None) / microbatches
    acc_leaves = None if acc is None else layout.check_tree(acc, "acc")

    specs, sinks, accs = {}, {}, {}
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for group, bufs in stacks.items():
        members = [i for i in range(len(leaves)) if in_group(names[i], group)]
        slots = tuple(i for i in members if i in in_stack and layout.slots[i].buffer in bufs)
        passthrough = tuple(j for j, i in enumerate(members) if i not in slots)
        specs[group] = TapSpec(
            group,
            layout,
            bufs,
            slots,
            plan.axes,
            plan.scatter,
            plan.reduce_dtype,
            factor,
            passthrough,
        )
        flag_sink = to_varying(
            jnp.zeros((layout.buffers[bufs[0]].layers, len(slots)), jnp.float32), plan.axes
        )
        sinks[group] = (
            tuple(
                tuple(
                    to_varying(
                        jnp.zeros(
                            (layout.buffers[bi].layers, b.size // layout.buffers[bi].num_shards)
                            if plan.scatter
                            else (layout.buffers[bi].layers, b.size),
                            plan.reduce_dtype,
                        ),
                        _sink_axes(plan, bi),
                    )
                    for b in layout.buffers[bi].buckets
                )
                for bi in bufs
            ),
            flag_sink,
        )
        accs[group] = (
            None if acc_leaves is None else layout.pack_leaves(acc_leaves, bufs, plan.reduce_dtype)
        )

    def f(free_leaves: list[Any], sinks: dict[str, Any]) -> Any:
        full = list(varying)
        for i, x in zip(free, free_leaves, strict=True):
            full[i] = x
        tree = jax.tree.unflatten(treedef, full)
        view = jax.tree_util.tree_map_with_path(
            lambda path, sub: (
                LayerStack(
                    sub, sinks[param_name(path)], accs[param_name(path)], specs[param_name(path)]
                )
                if param_name(path) in specs
                else sub
            ),
            tree,
            is_leaf=lambda path, _: param_name(path) in specs,
            is_leaf_takes_path=True,
        )
        return call_with_views(fun, tuple(specs), "jaxsync.LayerStack")(view, *args)

    # Traced once into a jaxpr, whose taps are checked (the jaxpr holds them even
    # where JAX reused a cached scan body), then differentiated from that jaxpr.
    free_in = [varying[i] for i in free]
    closed, out_shape = jax.make_jaxpr(f, return_shape=True)(free_in, sinks)
    check_taps(closed.jaxpr, tuple(specs), plan.axes, acc is not None)
    out_tree = jax.tree.structure(out_shape)

    def traced(free_leaves: list[Any], sinks: dict[str, Any]) -> Any:
        flat = jax.tree.leaves((free_leaves, sinks))
        flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
        return jax.tree.unflatten(out_tree, flat)

    out, (g_free, g_sinks) = jax.value_and_grad(traced, argnums=(0, 1), has_aux=has_aux)(
        free_in, sinks
    )
    by_slot: list[Any] = [None] * len(leaves)
    for i, g in zip(free, g_free, strict=True):
        by_slot[i] = g if acc_leaves is None else g.astype(jnp.float32) + acc_leaves[i]
    packed_free = layout.pack_leaves(by_slot, free_bufs, plan.reduce_dtype)
    per_buffer: dict[int, Any] = {}
    nonfinite = [None] * len(leaves)
    for i in free:
        nonfinite[i] = jnp.logical_not(jnp.all(jnp.isfinite(by_slot[i])))
    for group, bufs in stacks.items():
        bucket_grads, flag_grads = g_sinks[group]
        for bi, buckets in zip(bufs, bucket_grads, strict=True):
            per_buffer[bi] = buckets
        for j, si in enumerate(specs[group].slots):
            bad = jnp.max(flag_grads[:, j]) > 0
            if acc_leaves is not None:
                bad = bad | jnp.logical_not(jnp.all(jnp.isfinite(acc_leaves[si])))
            nonfinite[si] = bad
    if plan.scatter:
        shards = dict(
            zip(
                free_bufs,
                reduce_scatter_packed(packed_free, layout, free_bufs, plan.axes, factor),
                strict=True,
            )
        )
        for bi, buckets in per_buffer.items():
            shards[bi] = buckets[0] if len(buckets) == 1 else jnp.concatenate(buckets, axis=-1)
        return out, ShardedGrads(
            tuple(shards[bi] for bi in range(len(layout.buffers))),
            jnp.stack(nonfinite).astype(jnp.int32),
        )
    for bi, buckets in zip(free_bufs, packed_free, strict=True):
        key = layout.buffers[bi].key
        baxes = buffer_axes(layout, bi, plan.axes)
        per_buffer[bi] = tuple(
            scale_by(reduce_bucket(b, key, baxes, scatter=False), factor) for b in buckets
        )
    order = tuple(range(len(layout.buffers)))
    reduced = layout.unpack_leaves([per_buffer[bi] for bi in order], order)
    return out, jax.tree.unflatten(treedef, [reduced[i] for i in range(len(leaves))])

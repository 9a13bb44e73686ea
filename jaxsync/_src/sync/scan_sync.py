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

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..core.axes import axes_size, bound_axes, to_varying
from ..core.names import group_trees, in_group, param_name
from ..layout.layout import Layout
from ..program.grad_program import run_jaxpr
from ..program.grad_program import value_and_grad as program_value_and_grad
from .collectives import buffer_axes, mean_factor, reduce_bucket, reduce_scatter_packed, scale_by
from .data_parallel import DataParallel
from .finalize import ParamSync, SyncRules, local_view
from .layer_tap import LayerStack, TapSpec
from .remat_keep import keep_gathered
from .tap_rules import check_taps
from .views import call_with_views

PyTree = Any


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
        return _Plan(sync.layout(params), axes, sync.shard_grads, dtype, sync.rules)
    config = _optimizer_plan(sync)
    axes = bound_axes(config.axes, fn)
    layout = config.layout_inside(params)
    return _Plan(layout, axes, True, jnp.dtype(config.reduce_dtype).name, config.rules)


def _sink_dtypes(
    plan: _Plan, sync: Any, microbatches: int, first: bool
) -> tuple[dict[int, str], bool]:
    """The dtype each buffer's in-loop gradient is handed out in, and whether it is a
    single contribution: the reduction's dtype, or, on one device with one microbatch
    and no finalize rules (nothing is summed, so nothing is rounded), the dtype it was
    computed in: the params' as the loss reads them. That keeps one GPU's gradient
    stacks at the model's width (a bf16 model's are half the bytes to zero, write and
    read) and the values exact."""
    alone = microbatches == 1 and first and plan.rules is None and axes_size(plan.axes) == 1
    computed = getattr(sync, "param_dtype", None)
    return {
        bi: jnp.dtype(computed or buf.key.dtype).name if alone else plan.reduce_dtype
        for bi, buf in enumerate(plan.layout.buffers)
    }, alone


def _sink_flag(layout: Layout, si: int, buckets: Any, bufs: tuple[int, ...]) -> jax.Array:
    """Whether slot ``si``'s gradient, as its sinks hold it (``[layers, bucket]`` per
    bucket of its buffer), has a non-finite element."""
    slot = layout.slots[si]
    bi = slot.buffer
    for bucket, arr in zip(layout.buffers[bi].buckets, buckets[bufs.index(bi)], strict=True):
        if si in bucket.slots:
            lo = slot.start - bucket.start
            return jnp.logical_not(jnp.all(jnp.isfinite(arr[..., lo : lo + slot.size])))
    raise AssertionError(f"slot {si} lies in no bucket of buffer {bi}")


def _sink_axes(plan: _Plan, bi: int) -> tuple[str, ...]:
    key = plan.layout.buffers[bi].key
    dp = buffer_axes(plan.layout, bi, plan.axes) if plan.scatter else ()
    return tuple(dict.fromkeys(dp + key.varying))


def _flag_axes(plan: _Plan, bufs: tuple[int, ...]) -> tuple[str, ...]:
    """The axes a stacked group's local non-finite flags vary over: the data axes and,
    per buffer, those its local gradients vary over before jaxsync reduces them (a
    tensor-parallel piece's, a sequence-parallel sum's)."""
    axes = plan.axes
    for bi in bufs:
        key = plan.layout.buffers[bi].key
        axes += ParamSync(key.axes, key.sum_axes, key.mean_axes).owned_axes + key.varying
    return tuple(dict.fromkeys(axes))


def sync_value_and_grad(
    fun: Callable[..., Any],
    sync: Any,
    params: PyTree,
    args: Sequence[Any],
    *,
    has_aux: bool = False,
    acc: PyTree | None = None,
    microbatches: int = 1,
    held: Mapping[str, tuple[jax.Array, ...]] | None = None,
    reshard: bool = False,
    fn: str = "jaxsync.value_and_grad",
) -> tuple[Any, Any]:
    """``fun(params, *args)``'s value and gradients, reduced as ``sync`` plans.

    Args:
      acc: local gradients summed over earlier microbatches (fp32, shaped like
        the params), added before the reduction so the step syncs once.
      microbatches: divides the reduced sum, so the result is the mean.
      held: stacked groups whose params a distributed optimizer holds only as its
        master shards: ``{group: this rank's master rows}``, one ``[layers, shard]``
        array per buffer of the group. Their view gathers each layer in the
        forward (:func:`layer_tap.gather_layer`); the group's leaves in ``params``
        only give shapes and dtypes and are never read. Every remat around their
        taps keeps the gathered layers for the backward (:mod:`remat_keep`)
        unless ``reshard``.

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

    sink_dtype, alone = _sink_dtypes(plan, sync, microbatches, acc is None)
    specs, sinks, accs = {}, {}, {}
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    held = dict(held or {})
    subtrees = {g: tree for g, (tree, _) in group_trees(params, tuple(held)).items()}
    missing = sorted(set(held) - set(subtrees))
    if missing:
        raise ValueError(f"`held` names groups {missing} that `params` does not hold.")
    for group, bufs in stacks.items():
        members = [i for i in range(len(leaves)) if in_group(names[i], group)]
        slots = tuple(i for i in members if i in in_stack and layout.slots[i].buffer in bufs)
        passthrough = tuple(j for j, i in enumerate(members) if i not in slots)
        if group in held:
            _check_held(group, held[group], layout, bufs, passthrough, plan.scatter)
        packed_in = {sink_dtype[bi] for bi in bufs}
        # One contribution: the sinks hold each leaf's local gradient, so its
        # non-finite flag is read off them after the loop (_sink_flags).
        off_sinks = alone and not any(layout.slots[si].pieces for si in slots)
        specs[group] = TapSpec(
            group,
            layout,
            bufs,
            slots,
            plan.axes,
            plan.scatter,
            packed_in.pop() if len(packed_in) == 1 else "",
            factor,
            passthrough,
            subtrees.get(group),
            not off_sinks,
        )
        flag_sink = to_varying(
            jnp.zeros((layout.buffers[bufs[0]].layers, len(slots)), jnp.float32),
            _flag_axes(plan, bufs),
        )
        sinks[group] = (
            tuple(
                tuple(
                    to_varying(
                        jnp.zeros(
                            (layout.buffers[bi].layers, b.size // layout.buffers[bi].num_shards)
                            if plan.scatter
                            else (layout.buffers[bi].layers, b.size),
                            sink_dtype[bi],
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
                    held.get(param_name(path), sub),
                    sinks[param_name(path)],
                    accs[param_name(path)],
                    specs[param_name(path)],
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
    if held and not reshard:
        closed = keep_gathered(closed, held)

    def traced(free_leaves: list[Any], sinks: dict[str, Any]) -> Any:
        return run_jaxpr(closed, out_shape, free_leaves, sinks)

    grad_fn = program_value_and_grad(traced, argnums=(0, 1), has_aux=has_aux)
    out, (g_free, g_sinks) = grad_fn(free_in, sinks)
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
            if not specs[group].flags:
                nonfinite[si] = _sink_flag(layout, si, bucket_grads, bufs)
                continue
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
            shard = buckets[0] if len(buckets) == 1 else jnp.concatenate(buckets, axis=-1)
            shards[bi] = shard.astype(plan.reduce_dtype)  # widened where it is read
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


def _check_held(
    group: str, rows: Sequence[jax.Array], layout: Layout, bufs: tuple[int, ...],
    passthrough: tuple[int, ...], scatter: bool,
) -> None:  # fmt: skip
    """A held group: a distributed optimizer's rows, one ``[layers, shard]`` per buffer,
    every leaf reduced in the loop (a whole-matrix leaf needs its params whole)."""
    want = [(layout.buffers[bi].layers, layout.shard_size(bi)) for bi in bufs]
    got = [tuple(r.shape) for r in rows]
    if not scatter or passthrough or got != want:
        raise ValueError(
            f"`held` group {group!r}: needs a distributed optimizer's master rows of shapes "
            f"{want} with every leaf synced in the loop; got shapes {got} (scatter={scatter}, "
            f"{len(passthrough)} leaves of whole-matrix optimizers)."
        )


class ShardedGrads(NamedTuple):
    """Gradients already reduced over the data axes, as this rank's shards.

    What :func:`jaxsync.value_and_grad` returns with ``sync=tx`` for a
    distributed optimizer: one array per buffer of ``tx``'s layout (``[shard]``,
    or ``[layers, shard]`` for a stacked buffer), averaged over ranks and
    microbatches, in the optimizer's reduce dtype. Stacked buffers were
    reduce-scattered inside the backward scan, layer by layer. ``tx.update``
    takes them as they are, without another reduction.

    Attributes:
      shards: the reduced shards, one per buffer.
      nonfinite: per param (tree-leaf order), 1 where this device's *local*
        gradient held NaN/Inf before the reduction (for the skipped-step report).
    """

    shards: tuple[jax.Array, ...]
    nonfinite: jax.Array | None = None

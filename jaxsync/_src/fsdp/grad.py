"""Loss and reduced shard gradients of an FSDP step, with gradient accumulation.

``jax.grad`` with respect to the shards does the work (the gather's VJP
reduce-scatters); here the loss is checked as in every mode, and microbatches
are accumulated either shard by shard (one reduce-scatter per microbatch) or on
gathered units (one reduce-scatter per step, more memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core.axes import axes_size, bound_axes, to_varying
from ..core.validate import check_loss
from ..program.grad_program import run_jaxpr
from ..program.grad_program import value_and_grad as program_value_and_grad
from ..sync.remat_keep import keep_fsdp_gathered
from ..sync.tap_rules import check_no_gather_under_cond
from ..sync.views import NEVER_TAPPED, call_with_views
from .ready_order import ready_orders, reduction_orders

# The jaxsync.FullyShard whose method calls this: passed in, not imported (fsdp.py
# imports this module).
FullyShardT = Any


def value_and_grad(
    fs: FullyShardT,
    loss_fn: Callable[..., Any],
    shards: dict[str, jax.Array],
    batch: Any,
    *,
    microbatches: int,
    sync_grad_accum: bool,
    has_aux: bool,
    all_aux: bool = False,
) -> tuple[Any, dict[str, jax.Array]]:
    """:meth:`FullyShard.value_and_grad`; ``all_aux``: the aux of every microbatch,
    stacked ``[microbatches, ...]`` (``train_step`` combines them), not the last's."""
    check_microbatches(microbatches, batch)
    bound_axes(fs.axes + fs.replicate_axes, "FullyShard.value_and_grad")

    # A views scope: an NNX loss merges fs.view(shards) with jaxsync.merge_module.
    scoped = call_with_views(loss_fn, tuple(fs._layers), "FSDP's sharded layers")
    orders: dict = {}  # filled when the loss is traced, read by the gathers' backward
    loss_fn = _checked_loss(
        scoped,
        has_aux,
        fs.axes,
        keep=not fs.reshard_after_forward,
        stacked=tuple(fs._layers),
        orders=orders,
    )
    with reduction_orders(orders):  # the whole trace: a microbatch scan differentiates in its body
        if microbatches == 1:
            narrow = _alone_dtype(fs, shards)
            if narrow is None:
                out, grads = program_value_and_grad(loss_fn, has_aux=has_aux)(shards, batch)
            else:  # cast once; each shard's gradient comes back at the model's width, exact
                cast = jax.tree.map(lambda s: s.astype(narrow), shards)
                out, grads = program_value_and_grad(loss_fn, has_aux=has_aux)(cast, batch)
                grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grads, shards)
            if all_aux and has_aux:
                out = (out[0], jax.tree.map(lambda a: jnp.asarray(a)[None], out[1]))
            return out, grads
        mbs = split_microbatches(microbatches, batch)
        if sync_grad_accum:
            target, grad_fn = shards, program_value_and_grad(loss_fn, has_aux=has_aux)
        else:
            # Local gradients of the gathered params (varying: no implicit psum).
            target = to_varying(fs.gather_all(shards), fs.axes + fs.replicate_axes)
            grad_fn = program_value_and_grad(loss_fn, has_aux=has_aux)

        def body(acc: Any, mb: Any) -> tuple[Any, Any]:
            loss, g = grad_fn(target, mb)
            return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g), loss

        loss0, g0 = grad_fn(target, jax.tree.map(lambda m: m[0], mbs))
        acc = jax.tree.map(lambda x: x.astype(jnp.float32), g0)
        acc, losses = jax.lax.scan(body, acc, jax.tree.map(lambda m: m[1:], mbs))
        grads = jax.tree.map(lambda a: a / microbatches, acc)
        if has_aux:
            (loss0, aux0), (losses, aux) = loss0, losses
        loss = (loss0 + jnp.sum(losses)) / microbatches
        if not sync_grad_accum:
            grads = fs.reduce_gathered(grads)
        if has_aux and all_aux:
            stack = lambda a0, a: jnp.concatenate([jnp.asarray(a0)[None], a])  # noqa: E731
            return (loss, jax.tree.map(stack, aux0, aux)), grads
        if has_aux:
            return (loss, jax.tree.map(lambda a: a[-1], aux)), grads
        return loss, grads


def _checked_loss(
    loss_fn: Callable[..., Any],
    has_aux: bool,
    axes: Any,
    keep: bool = False,
    stacked: tuple[str, ...] = (),
    orders: dict | None = None,
) -> Callable[..., Any]:
    """``loss_fn`` with the checks every mode makes of its loss (not yet averaged);
    ``keep``: every remat around a unit's gather keeps the gathered params
    (``reshard_after_forward=False``, :func:`remat_keep.keep_fsdp_gathered`);
    ``stacked``: the stacked units, which a model module holds as placeholders;
    ``orders``: filled with the order each unit's gradients become ready in
    (:func:`.ready_order.ready_orders`)."""

    def checked(*args: Any) -> Any:
        # Traced into a jaxpr, checked, and run from it (no second trace of the loss).
        closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
        if stacked and any(isinstance(c, jax.ShapeDtypeStruct) for c in closed.consts):
            # A module's placeholders of a stacked unit read as values (a plain
            # nnx.scan, no tap): JAX would fail only when lowering, with its own words.
            raise ValueError(NEVER_TAPPED.format(groups=sorted(stacked)))
        check_no_gather_under_cond(closed.jaxpr, tuple(axes))
        if orders is not None:
            orders.update(ready_orders(closed.jaxpr))
        if keep:
            closed = keep_fsdp_gathered(closed)
        out = run_jaxpr(closed, shape, *args)
        check_loss(out[0] if has_aux else out, tuple(axes), "fsdp", "FullyShard.value_and_grad")
        return out

    return checked


def split_microbatches(microbatches: int, batch: Any) -> Any:
    """``batch`` checked (:func:`check_microbatches`) and cut into ``microbatches``
    equal slices of its rows: each leaf ``[microbatches, rows / microbatches, ...]``."""
    check_microbatches(microbatches, batch)
    return jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)


def check_microbatches(microbatches: Any, batch: Any) -> None:
    """``microbatches``: a positive int dividing every batch leaf's leading axis."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"`microbatches` must be a positive int, got {microbatches!r}.")
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        rows = x.shape[0] if getattr(x, "ndim", 0) else None
        if microbatches > 1 and (rows is None or rows % microbatches):
            raise ValueError(
                f"`microbatches={microbatches}` must divide the leading (batch) axis of every "
                f"batch leaf; leaf {jax.tree_util.keystr(path)} has shape "
                f"{tuple(getattr(x, 'shape', ()))} on this device."
            )


def _alone_dtype(fs: FullyShardT, shards: dict[str, jax.Array]) -> Any:
    """``param_dtype`` where one device holds every shard whole and it is narrower
    than the shards, else None. There nothing is gathered or summed, so the step
    casts each unit once, before its layer loop, instead of in every layer of the
    forward and again in the backward, and the gradients keep the model's width
    (a single contribution: exact) until the update reads them."""
    if axes_size(fs.axes + fs.replicate_axes) != 1:
        return None
    narrow = jnp.dtype(fs.policy.param_dtype)
    wide = all(jnp.dtype(s.dtype).itemsize > narrow.itemsize for s in jax.tree.leaves(shards))
    return narrow if wide else None

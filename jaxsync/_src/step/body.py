"""The per-device body of :func:`jaxsync.train_step`, one function per mode.

Each runs inside the step's ``jax.shard_map`` and composes the public pieces a
hand-written step would: :func:`jaxsync.value_and_grad` or
:func:`jaxsync.accumulate_grads` (with ``sync=`` for stacked groups), then the
distributed optimizer (``"zero"``), :func:`jaxsync.all_reduce_grads` and a
replicated optax update (``"ddp"``), or ``FullyShard.value_and_grad`` and an
optax update of the shards (``"fsdp"``). ``cfg`` is the :class:`TrainStep`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..core.axes import axes_size, normalize_axes
from ..deterministic.exact import unit_record
from ..fsdp.grad import split_microbatches
from ..fsdp.grad import value_and_grad as fsdp_value_and_grad
from ..fsdp.held import FsdpShards, plain
from ..optim.logged import TreeNorms, rate_of, with_rate
from ..optim.master import MasterState
from ..sync.data_parallel import DataParallel
from ..sync.grad_sync import all_reduce_grads, value_and_grad
from ..sync.reduction import BUCKETED
from ..sync.scan_sync import ShardedGrads, sync_value_and_grad
from .held import gather_held, held_buffers, master_rows, stand_ins, strip
from .modes import deterministic_of
from .parts import Plan, finish, loss_of, one_piece, outputs, scale_of, settle, unscale
from .train_state import TrainState, global_stats, padding_of
from .two_d.body import spec_body
from .unstacked import warn_unstacked


def per_device(cfg: Any, plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
    """One step on this device's rows: ``(new state, loss averaged over devices)``."""
    if plan.dims is not None:
        out = spec_body(cfg, plan, state, batch)
    else:
        body = {"zero": zero_body, "ddp": ddp_body, "fsdp": fsdp_body}[cfg.mode.name]
        out = body(cfg, plan, state, batch)
    warn_unstacked(cfg, plan, state, batch)  # after the step traced: its errors come first
    return out


def grads_of(cfg: Any, plan: Plan, state: TrainState, batch: Any, sync: Any) -> tuple[Any, Any]:
    """``((mean loss, rest), grads)``; ``rest`` the :class:`LossAux` of every piece,
    stacked (deterministic units come stacked already)."""
    loss = loss_of(cfg, plan, state, batch)
    det = deterministic_of(cfg.mode)
    rules = None if sync is not None else getattr(cfg.mode, "rules", None)
    if cfg.microbatches == 1:
        vg = value_and_grad(
            loss, axis_name=cfg.axis_name, rules=rules, sync=sync, has_aux=True,
            deterministic=det,
        )  # fmt: skip
        (out, rest), grads = vg(state.params, batch)
        return (out, rest if det is not None else one_piece(rest)), grads
    mbs = split_microbatches(cfg.microbatches, batch)
    return BUCKETED.accumulate(
        loss, state.params, mbs, cfg.axis_name, True, jnp.float32, rules, sync, all_aux=True
    )


def zero_body(cfg: Any, plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
    tx = plan.tx
    if plan.held:
        (loss, rest), grads, params, held = held_grads(cfg, plan, state, batch)
        new_params, opt_state = tx._apply_held(grads, state.opt_state, params, held)
        new_params = strip(new_params, plan.held)
    else:
        (loss, rest), grads = grads_of(cfg, plan, state, batch, tx if cfg.stacked else None)
        new_params, opt_state = tx.apply_gradients(grads, state.opt_state, state.params)
    finite = jnp.logical_not(opt_state.metrics.skipped)
    if cfg.metrics is not None:  # the norms are the optimizer's; the rate, the step's
        rate = rate_of(cfg.metrics, state.step, opt_state)
        metrics = with_rate(opt_state.metrics, state.opt_state.metrics, rate, finite)
        opt_state = opt_state._replace(metrics=metrics)
    new = state._replace(
        step=state.step + finite.astype(jnp.int32),
        params=new_params,
        opt_state=opt_state,
        model_state=settle(cfg, plan, rest, state, finite),
    )
    return new, outputs(cfg, loss, rest, state, batch)


def held_grads(cfg: Any, plan: Plan, state: TrainState, batch: Any) -> tuple[Any, ...]:
    """ZeRO's gradients with the stacked groups held as master shards (:mod:`held`):
    ``((loss, rest), sharded grads, the full params tree the optimizer reads, the
    held buffers)``.

    One microbatch: each layer is gathered in the forward, by its tap. With several,
    the earlier microbatches need the whole stack, so it is gathered once first.
    """
    tx = plan.tx
    params = stand_ins(state.params, plan.template, plan.held)
    layout = tx._config.layout_inside(params)
    master, held = state.opt_state.master, held_buffers(layout, plan.held)
    if cfg.microbatches == 1:
        rows = master_rows(layout, master, plan.held)
        loss = loss_of(cfg, plan, state, batch)
        (out, rest), grads = sync_value_and_grad(
            loss, tx, params, (batch,), has_aux=True, held=rows,
            reshard=cfg.mode.reshard_after_forward, fn="jaxsync.train_step",
        )  # fmt: skip
        return (out, one_piece(rest)), grads, params, held
    params = gather_held(layout, master, cfg.axis_name, params, plan.held)
    out, grads = grads_of(cfg, plan, state._replace(params=params), batch, tx)
    return out, grads, params, held


def ddp_body(cfg: Any, plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
    mode, sync = cfg.mode, None
    if cfg.stacked:
        sync = DataParallel(
            cfg.axis_name, bucket_size=mode.bucket_size, reduce_dtype=mode.reduce_dtype,
            rules=mode.rules, stacked=cfg.stacked, param_dtype=mode.param_dtype,
            shard_grads=axes_size(normalize_axes(cfg.axis_name)) > 1,
        )  # fmt: skip
    (loss, rest), local = grads_of(cfg, plan, state, batch, sync)
    # With an fp32 master (bf16/fp16 params), keep the reduced gradients in the
    # reduction's dtype, as ZeRO's shards do, instead of rounding them back to the
    # params' dtype (the cast fuses into the bucket's pack or the gather's update).
    widen = isinstance(state.opt_state, MasterState) and mode.deterministic is None
    if isinstance(local, ShardedGrads):
        # Reduce-scattered in the loop (DataParallel.shard_grads): the statistics from
        # the shards (one psum of two floats), so each param's update waits for its own
        # gather only; the per-param flags are each device's local ones, as ZeRO's.
        layout = sync.layout(state.params)
        sq, zeros = global_stats(list(local.shards), cfg.axis_name, padding_of([layout]))
        grads = sync.gather(local.shards, layout, mode.reduce_dtype if widen else None)
    else:
        grads = local
        if sync is None:  # the in-loop sync of stacked groups hands back the params' dtype
            grads = all_reduce_grads(
                widened(local, mode.reduce_dtype) if widen else local,
                axis_name=cfg.axis_name, bucket_size=mode.bucket_size,
                reduce_dtype=mode.reduce_dtype, rules=mode.rules,
                deterministic=mode.deterministic,
            )  # fmt: skip
        # The statistics of the reduced grads before unscaling (read back out of the
        # reduced buckets, which XLA sees through).
        sq, zeros = global_stats(grads)
    scale = scale_of(cfg, state)
    grads = unscale(grads, scale)
    stats = (sq if scale is None else sq / jnp.square(scale.astype(jnp.float32)), zeros)
    # Deterministic: per-device flags would depend on the DP size; flag units, as ZeRO.
    # With TrainerMetrics(unit_prints=True), each unit's gradient fingerprints beside them.
    prints = cfg.metrics is not None and cfg.metrics.unit_prints
    units = unit_record(local, prints) if mode.deterministic is not None else None
    flags = grads if units is not None else local
    norms = TreeNorms(inner=cfg.tx)  # replicated: every leaf whole, no collective
    return finish(cfg, plan, state, grads, flags, stats, loss, rest, batch, units, norms)


def widened(grads: Any, dtype: Any) -> Any:
    """Float leaves narrower than ``dtype`` cast to it (None: as they are)."""
    if dtype is None:
        return grads
    wide = jnp.dtype(dtype)
    return jax.tree.map(
        lambda g: (
            g.astype(wide)
            if jnp.issubdtype(g.dtype, jnp.floating) and g.dtype.itemsize < wide.itemsize
            else g
        ),
        grads,
    )


def fsdp_body(cfg: Any, plan: Plan, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
    fs = plan.fs
    # The optimizer state was built over the plain {unit: shard} dict: step on that,
    # and hand state.params back as the FsdpShards it came in.
    state = state._replace(params=plain(state.params))
    loss = loss_of(cfg, plan, state, batch)
    (loss, rest), grads = fsdp_value_and_grad(
        fs, lambda shards, b: loss(fs.view(shards), b), state.params, batch,
        microbatches=cfg.microbatches, sync_grad_accum=True, has_aux=True, all_aux=True,
    )  # fmt: skip
    grads = unscale(grads, scale_of(cfg, state))
    stats = global_stats(grads, fs.axes, padding_of([fs.layout(u) for u in fs.units]))
    norms = TreeNorms(axes=fs.axes)  # every leaf a shard: one psum of two floats
    new, out = finish(cfg, plan, state, grads, grads, stats, loss, rest, batch, norms=norms)
    return new._replace(params=FsdpShards(new.params, fs.units)), out

"""Data-parallel gradient sync: local gradients, accumulation, bucketed all-reduce.

The one trap in JAX data parallelism is that, inside ``shard_map``, ``jax.grad``
w.r.t. replicated params already returns all-reduced gradients (the transpose
of the implicit ``pvary`` is a ``psum``). Syncing those again reduces twice and
hides a full-model all-reduce from any bucketing. :func:`value_and_grad` owns
that step: it differentiates a device-varying view of the params, so what comes
back is each device's *local* gradient and every reduction is ours to plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.axes import AxisName, axes_size, bound_axes, normalize_axes, rank, to_varying
from ..core.tree_reduce import nonfinite_leaves
from ..core.validate import check_bool, check_float_dtype
from ..deterministic.strategy import ExactSums
from ..deterministic.units import (
    Deterministic,
    UnitGrads,
)
from ..layout.placement import check_bucket_size
from .checks import check_rules
from .collectives import bucket_all_reduce
from .finalize import SyncRules
from .reduction import BUCKETED, reduction_of, sync_layout

PyTree = Any


def value_and_grad(
    fun: Callable[..., Any],
    *,
    axis_name: AxisName,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    rules: SyncRules | None = None,
    sync: Any = None,
    deterministic: Deterministic | bool | None = None,
) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, but returns this device's local gradients.

    Use it inside ``jax.shard_map``. The differentiated arguments are first
    marked device-varying over ``axis_name`` (``jax.lax.pcast``), so no hidden
    all-reduce is inserted; reduce the result with :func:`all_reduce_grads` or
    the distributed optimizer. The returned value is the local (per-device)
    loss; ``jax.lax.pmean`` it for logging.

    With ``rules`` (:class:`SyncRules`), the gradients of matched params are also
    kept local over the rules' pipeline/tensor axes, so that the sync (with the
    same rules) performs those reductions bucket by bucket. Over any other axis
    JAX's own autodiff keeps reducing replicated params, as it always does.

    With ``sync`` (a :func:`jaxsync.distributed_optimizer` or a
    :class:`jaxsync.DataParallel`) the gradients come back *reduced*: stacked
    groups (``stacked=`` of the sync) reach ``fun`` as views that the scanned
    layer body passes through :func:`jaxsync.tap`, which reduces each layer's
    gradient inside the backward scan; the other params are reduced bucket by
    bucket after it. A distributed optimizer gets :class:`jaxsync.ShardedGrads`
    for ``tx.update``; ``DataParallel`` gets the averaged gradient tree for any
    optax optimizer. ``argnums`` must then be one int, and ``rules`` come from
    the sync.

    Example:
      >>> loss, grads = jaxsync.value_and_grad(loss_fn, axis_name="data")(params, batch)
      >>> grads = jaxsync.all_reduce_grads(grads, axis_name="data")
    """
    check_rules(rules)
    normalize_axes(axis_name)
    return reduction_of(deterministic).value_and_grad(fun, axis_name, argnums, has_aux, rules, sync)


def accumulate_grads(
    fun: Callable[..., Any],
    params: PyTree,
    microbatches: PyTree,
    *,
    axis_name: AxisName,
    has_aux: bool = False,
    accum_dtype: Any = jnp.float32,
    rules: SyncRules | None = None,
    sync: Any = None,
    deterministic: Deterministic | bool | None = None,
) -> tuple[Any, PyTree]:
    """Mean loss and mean *local* gradients over microbatches, with no communication.

    This is Megatron's ``no_sync``: gradients of every microbatch are summed
    locally in ``accum_dtype`` (a ``lax.scan``, so memory stays at one
    microbatch), and only the result is synced once, by the caller.

    With ``sync`` (as in :func:`value_and_grad`) the step still syncs once: the
    first microbatches run without communication, and the last one runs with
    in-loop sync, adding the accumulated gradients of each layer before that
    layer's reduction in the backward scan (Megatron's sync in the last
    microbatch). The result is then reduced (:class:`ShardedGrads` for a
    distributed optimizer).

    Args:
      fun: ``fun(params, microbatch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      params: the parameters.
      microbatches: pytree whose leaves have a leading microbatch axis.
      axis_name: the data-parallel axes (see :func:`value_and_grad`).
      has_aux: whether ``fun`` returns ``(loss, aux)``; aux of the last microbatch
        is returned.
      accum_dtype: dtype the gradients are summed in.
      rules: finalize rules, as for :func:`value_and_grad`.
      sync: in-loop sync, as for :func:`value_and_grad`.
      deterministic: a :class:`jaxsync.Deterministic`: each microbatch's global
        batch is cut into ``units`` units; each unit's gradients are summed over
        microbatches in order (fp32), and returned as :class:`jaxsync.UnitGrads`;
        the loss is the exact global mean (see :func:`value_and_grad`).

    Returns:
      ``(loss, grads)`` or ``((loss, aux), grads)``: means over microbatches,
      grads in ``accum_dtype``.
    """
    leaves = jax.tree.leaves(microbatches)
    if not leaves:
        raise ValueError("`microbatches` is empty; pass a pytree of stacked microbatches.")
    counts = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(counts) != 1 or None in counts:
        raise ValueError(
            "every leaf of `microbatches` needs the same leading (microbatch) axis; "
            f"got leading sizes {sorted(str(c) for c in counts)}."
        )
    (n,) = counts
    axes = bound_axes(axis_name, "jaxsync.accumulate_grads")
    del n  # checked: one microbatch count
    return reduction_of(deterministic).accumulate(
        fun, params, microbatches, axes, has_aux, accum_dtype, rules, sync
    )


def all_reduce_grads(
    grads: PyTree,
    *,
    axis_name: AxisName,
    bucket_size: int | None = None,
    reduce_dtype: Any = jnp.float32,
    average: bool = True,
    rules: SyncRules | None = None,
    deterministic: Deterministic | bool | None = None,
) -> PyTree:
    """Bucketed all-reduce of local gradients (data parallelism + finalize rules).

    Args:
      grads: local gradients, e.g. from :func:`value_and_grad`.
      axis_name: data-parallel axis name or tuple of names.
      bucket_size: elements per bucket; ``None`` for one bucket per dtype.
      reduce_dtype: dtype of the reduction (fp32 for bf16/fp16 models, as
        Megatron's ``grad_reduce_in_fp32``); ``None`` keeps the grad dtype.
      average: mean over ranks (``True``) or sum.
      rules: :class:`SyncRules`: the extra tied / sequence-parallel / expert
        reductions of Megatron's ``finalize_model_grads``, per bucket.
      deterministic: a :class:`jaxsync.Deterministic`; ``grads`` are then the
        :class:`jaxsync.UnitGrads` made with it, summed exactly (bitwise the same
        mean at any DP size). :class:`jaxsync.UnitGrads` are summed so even
        without it. Needs ``average=True`` and no ``rules``; ``reduce_dtype`` is
        not used (the sum is exact).

    Returns:
      The reduced gradients, each in its original dtype, typed replicated.
    """
    fn = "jaxsync.all_reduce_grads"
    strategy = reduction_of(deterministic)
    if strategy is BUCKETED and isinstance(grads, UnitGrads):
        strategy = ExactSums(None)  # UnitGrads carry their units: summed exactly even so
    if strategy is BUCKETED:
        check_rules(rules)
        check_float_dtype(reduce_dtype, "reduce_dtype", allow_none=True)
        check_bool(average, "average")
    return strategy.all_reduce(grads, axis_name, bucket_size, reduce_dtype, average, rules, fn)


def nonfinite_grads(grads: PyTree, *, axis_name: AxisName | None = None) -> PyTree:
    """Per-leaf flags: ``True`` where this device's gradient holds NaN or Inf.

    Megatron's ``check_for_nan_in_grad``, as data. Call it on local gradients,
    before communication, so the flags say *which rank* produced the bad value.
    With ``axis_name`` each flag gets a leading axis of size 1, so returning the
    tree from shard_map with ``out_specs=P(axis_name)`` stacks one row per rank;
    feed that to :func:`raise_if_nonfinite`.
    """
    leaves, treedef = jax.tree.flatten(grads)
    flags = jax.tree.unflatten(treedef, list(nonfinite_leaves(leaves)) if leaves else [])
    if axis_name is None:
        return flags
    bound_axes(axis_name, "jaxsync.nonfinite_grads")
    return jax.tree.map(lambda f: f[None], flags)


def raise_if_nonfinite(flags: PyTree) -> None:
    """Raises ``FloatingPointError`` naming every param and rank with NaN/Inf grads.

    Args:
      flags: the tree from :func:`nonfinite_grads` (leaves: bools, or one bool per
        rank as returned through ``out_specs=P(axis_name)``). Runs on the host.
    """
    bad = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(flags)[0]:
        ranks = [int(i) for i in np.flatnonzero(np.ravel(jax.device_get(leaf)))]
        if ranks:
            bad.append(f"  {jax.tree_util.keystr(path)} on rank(s) {ranks}")
    if bad:
        raise FloatingPointError(
            "non-finite gradients (NaN or Inf) before the data-parallel sync:\n"
            + "\n".join(bad)
            + "\nLower the learning rate, use loss scaling for fp16, or check the data "
            "those ranks were fed."
        )


def broadcast_params(
    params: PyTree,
    *,
    axis_name: AxisName,
    src: int = 0,
    bucket_size: int | None = None,
) -> PyTree:
    """Makes every replica's params equal to rank ``src``'s (Megatron's broadcast).

    Bucketed like the gradient sync: one masked ``psum`` per bucket. The result
    is typed replicated. Use it after initialising replicas independently.
    """
    axes = bound_axes(axis_name, "jaxsync.broadcast_params")
    n = axes_size(axes)
    if isinstance(src, bool) or not isinstance(src, int | np.integer) or not 0 <= src < n:
        # An out-of-range rank would match no device and zero every param.
        raise ValueError(
            f"jaxsync.broadcast_params: `src` must be a rank in [0, {n}) of axes {axes} "
            f"(size {n}), got {src!r}."
        )
    layout = sync_layout(params, axes, bucket_size)
    mine = to_varying(params, axes)
    keep = rank(axes) == src
    masked = jax.tree.map(lambda p: jnp.where(keep, p, jnp.zeros_like(p)), mine)
    return bucket_all_reduce(masked, layout, axis_name=axes, reduce_dtype=None, average=False)


class SyncGradsState(NamedTuple):
    """:func:`sync_grads` keeps no state."""


def sync_grads(
    *,
    axis_name: AxisName,
    bucket_size: int | None = None,
    reduce_dtype: Any = jnp.float32,
    average: bool = True,
    rules: SyncRules | None = None,
    deterministic: Deterministic | bool | None = None,
) -> optax.GradientTransformation:
    """Plain data parallelism as an optax transformation: bucketed all-reduce.

    Put it first in an ``optax.chain`` to feed local gradients to a replicated
    optimizer (every rank holds the whole optimizer state):

      >>> tx = optax.chain(jaxsync.sync_grads(axis_name="data"),
      ...                  optax.clip_by_global_norm(1.0), optax.adam(3e-4))

    Reduced gradients keep their dtype; the reduction runs in ``reduce_dtype``.
    With ``deterministic`` (a :class:`jaxsync.Deterministic`) it takes the
    :class:`jaxsync.UnitGrads` made with the same one and sums them exactly,
    as :func:`all_reduce_grads` does.
    """
    axes = normalize_axes(axis_name)
    bucket_size = check_bucket_size(bucket_size)
    check_rules(rules)
    check_float_dtype(reduce_dtype, "reduce_dtype", allow_none=True)
    check_bool(average, "average")
    strategy = reduction_of(deterministic)

    def init_fn(params: PyTree) -> SyncGradsState:
        del params
        return SyncGradsState()

    def update_fn(
        grads: PyTree, state: SyncGradsState, params: PyTree | None = None
    ) -> tuple[PyTree, SyncGradsState]:
        del params
        reduced = strategy.all_reduce(
            grads, axes, bucket_size, reduce_dtype, average, rules, "jaxsync.sync_grads"
        )
        return reduced, state

    return optax.GradientTransformation(init_fn, update_fn)

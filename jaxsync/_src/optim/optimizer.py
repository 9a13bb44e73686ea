"""The distributed (ZeRO-1/2) optimizer: Megatron's DistributedOptimizer for optax.

Every flat gradient buffer is cut into ``N`` equal shards per bucket; rank ``r``
reduce-scatters the gradients into its shard, keeps fp32 master copies of the
params in that shard, runs the inner optax transformation on the
shard only, and all-gathers the new params. Per-device optimizer memory falls
from ``P * (4 + state)`` bytes to ``ceil(P / N) * (4 + state)`` plus padding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import AxisName, bound_axes, mesh_axes_size, normalize_axes, rank
from ..core.specs import param_specs_of
from ..core.validate import check_bool
from ..deterministic.exact import UNIT_GRADS_WITHOUT_MODE, exact_shards
from ..deterministic.units import Deterministic, UnitGrads, check_deterministic
from ..layout.layout import Layout
from ..layout.ownership import WholeMatrices
from ..layout.placement import check_bucket_size, normalize_stacked
from ..sync.collectives import bucket_reduce_scatter, gather_params
from ..sync.finalize import SyncRules
from ..sync.scan_sync import ShardedGrads
from .checks import (
    check_multi_steps_clip,
    check_optimizer_args,
    check_sharded_grads,
    check_update,
)
from .clip import clip_to_norm, shard_stats
from .layerwise import as_written
from .logged import shard_sums, with_norms
from .loss_scale import LossScale, active_scale, check_loss_scale, update_loss_scale
from .metrics import next_metrics
from .plan import Labels, Plan
from .portable import convert, from_portable, portable_fn, signature
from .state import DistributedOptimizerState

PyTree = Any


class DistributedOptimizer(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` with helpers for its sharded state.

    Use ``init`` and ``update`` inside ``jax.shard_map`` over the data-parallel
    axes; use :meth:`state_specs`, :meth:`state_shardings` and
    :meth:`sharded_init` from outside it.
    """

    def apply_gradients(
        self, grads: PyTree, state: DistributedOptimizerState, params: PyTree
    ) -> tuple[PyTree, DistributedOptimizerState]:
        """``update`` and ``optax.apply_updates`` in one: ``(new_params, new_state)``.

        The new params come straight from the all-gather, in their own dtypes, so
        the step holds no params-sized fp32 ``updates`` and makes no second pass
        over the params to add them (``update`` returns ``new - params`` in fp32
        for optax compatibility; both land on the same values).
        """
        if params is None:
            raise ValueError(NEED_PARAMS)
        return self.__dict__["apply_fn"](
            grads, state, params, "DistributedOptimizer.apply_gradients"
        )

    def _apply_held(
        self, grads: PyTree, state: DistributedOptimizerState, params: PyTree, held: frozenset
    ) -> tuple[PyTree, DistributedOptimizerState]:
        """:meth:`apply_gradients` leaving the buffers in ``held`` ungathered (their
        leaves come back as in ``params``): a train step gathers them in the next
        forward (:mod:`jaxsync._src.step.held`)."""
        return self.__dict__["apply_fn"](grads, state, params, "jaxsync.train_step", held)

    def layout(self, params: PyTree, mesh: Mesh, param_specs: PyTree = None) -> Layout:
        """The flat-buffer layout used for (global) ``params`` on ``mesh``.

        ``param_specs`` are the params' PartitionSpecs in the step's shard_map;
        by default they are read from the arrays' ``NamedSharding`` (else ``P()``).
        """
        mesh_axes_size(mesh, self._config.axes, "layout")
        return self._config.layout_outside(params, mesh, param_specs)[0]

    def state_specs(
        self, params: PyTree, mesh: Mesh, param_specs: PyTree = None
    ) -> DistributedOptimizerState:
        """PartitionSpecs of the state (shards over the data axes, scalars ``P()``),
        for the ``in_specs``/``out_specs`` of the shard_map that runs the step."""
        mesh_axes_size(mesh, self._config.axes, "state_specs")
        return self._config.state_specs(params, mesh, param_specs)

    def state_shardings(
        self, params: PyTree, mesh: Mesh, param_specs: PyTree = None
    ) -> DistributedOptimizerState:
        """``NamedSharding``s of the global state arrays, e.g. for checkpoint restore."""
        return jax.tree.map(
            lambda s: NamedSharding(mesh, s),
            self.state_specs(params, mesh, param_specs),
            is_leaf=lambda x: isinstance(x, P),
        )

    def sharded_init(
        self, params: PyTree, mesh: Mesh, param_specs: PyTree = None
    ) -> DistributedOptimizerState:
        """Builds the global, sharded state from global ``params`` (outside shard_map)."""
        specs = self.state_specs(params, mesh, param_specs)
        in_specs = param_specs_of(params, param_specs)
        init = jax.shard_map(self.init, mesh=mesh, in_specs=(in_specs,), out_specs=specs)
        return jax.jit(init)(params)

    def from_portable(
        self, portable: dict[str, Any], params: PyTree, mesh: Mesh
    ) -> DistributedOptimizerState:
        """Inverse of :meth:`to_portable` onto ``mesh``, whose DP size may differ."""
        return from_portable(self._config, portable, params, mesh)

    def to_portable(
        self, state: DistributedOptimizerState, params: PyTree, mesh: Mesh
    ) -> dict[str, Any]:
        """The state as per-parameter arrays, independent of the DP size (for saving).

        Returns a dict ``{"master": {name: array}, "inner_state": {buffer: state},
        "loss_scale": ..., "metrics": ...}`` in which every shard-shaped leaf has
        become ``{param name: array of the param's shape}``.
        """
        fn, out, _ = portable_fn(self._config, params, mesh)
        key = ("to_portable", self._config, signature(params), mesh)
        return convert(fn, (state,), mesh, out, key=key)

    def portable_shapes(self, params: PyTree, mesh: Mesh) -> dict[str, Any]:
        """``ShapeDtypeStruct``s (with shardings) of :meth:`to_portable`'s result."""
        fn, out, glob = portable_fn(self._config, params, mesh)
        shapes = jax.eval_shape(fn, glob)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, out
        )

    @property
    def _config(self) -> Plan:
        return self.__dict__["config"]


NEED_PARAMS = (
    "distributed_optimizer.update needs `params`: it returns updates relative to "
    "them. Call `tx.update(grads, state, params)`."
)


def distributed_optimizer(
    inner: optax.GradientTransformation | Mapping[str, optax.GradientTransformation],
    *,
    axis_name: AxisName,
    labels: Labels = None,
    bucket_size: int | None = None,
    reduce_dtype: Any = jnp.float32,
    clip_grad_norm: float | None = None,
    loss_scale: LossScale = None,
    check_elementwise: bool = True,
    rules: SyncRules | None = None,
    stacked: str | Sequence[str] | None = None,
    deterministic: Deterministic | bool | None = None,
    norms: bool = False,
) -> DistributedOptimizer:
    """Wraps an elementwise optax optimizer into a ZeRO sharded optimizer.

    ``update`` takes each device's *local*, unreduced gradients (from
    :func:`jaxsync.value_and_grad`) and, in order: reduce-scatters them bucket by
    bucket in ``reduce_dtype`` (averaging over ranks) -> unscales by the loss
    scale -> checks for NaN/Inf over all ranks -> skips the step if any (state and
    params unchanged, the loss scale backs off) -> clips by the global L2 norm ->
    runs ``inner`` on this rank's shard -> updates the fp32 master -> all-gathers
    the new params bucket by bucket in the param dtype. The returned updates are
    fp32, so ``optax.apply_updates(params, updates)`` lands exactly on the
    gathered values.

    Args:
      inner: an elementwise optax transformation, or a mapping label ->
        transformation used with ``labels``. A transformation wrapped in
        :func:`jaxsync.whole_matrices` (Muon, Adafactor, Shampoo...) runs on
        whole matrices instead: each of its params, or each layer of a stacked
        param, is owned by one rank (balanced by cost; see
        :func:`jaxsync.ownership_report`).
      axis_name: data-parallel mesh axis name (or tuple of names) to shard over.
      labels: a pytree of label strings shaped like the params, or a function of
        the params returning one (as ``optax.multi_transform``); params with
        different labels go to different buffers, each with its own
        transformation (e.g. weight decay on kernels only).
      bucket_size: elements per bucket (one collective each); ``None``: one
        bucket per buffer. Small buckets (down to ``1``: one per param) skip the
        copy of a bucket into one array, and XLA's collective combiner merges
        small collectives by itself; on 8 simulated CPU devices one bucket per
        param was the fastest setting (see the README's benchmark).
      reduce_dtype: dtype of the gradient reduction and of the optimizer math.
      clip_grad_norm: clip by this global L2 norm (computed across all shards).
      loss_scale: ``None``, a constant float, or a :class:`DynamicLossScale` for
        fp16; multiply your loss by ``state.loss_scale.scale``.
      check_elementwise: probe ``inner`` once to reject transformations that
        are not elementwise (and so would train wrong on flat shards).
      rules: :class:`SyncRules` for params that also need reductions over pipeline,
        tensor or expert axes (compute the gradients with the same rules in
        :func:`jaxsync.value_and_grad`). Expert buffers are sharded over the
        expert-data-parallel axes only.
      stacked: dotted name prefixes of stacked-layer groups (``"blocks"``:
        params with a leading layer axis, run by ``lax.scan``). Their state is
        ``[layers, shard]``: rank ``r`` owns the same range of every layer, so
        :func:`jaxsync.value_and_grad` with ``sync=tx`` can reduce-scatter each
        layer's gradients inside the backward scan (see :func:`jaxsync.tap`).
      deterministic: a :class:`jaxsync.Deterministic`: ``update`` then takes the
        :class:`jaxsync.UnitGrads` made with the same one, reduce-scatters them
        exactly (fixed point, int32 limbs) and sums the global norm exactly, so
        params, master, state, norm and skips are the same bits at any DP size
        dividing its ``units``. Plain data parallelism only (no ``rules``,
        ``stacked`` or params sharded over other axes); ``reduce_dtype`` fp32.
      norms: also record ``state.metrics.update_norm`` (the inner optimizer's
        update) and ``param_norm`` (the fp32 master), summed on the shards with
        one extra all-reduce of two floats (exactly in deterministic mode).

    Returns:
      A :class:`DistributedOptimizer` (an ``optax.GradientTransformationExtraArgs``).

    Example:
      >>> tx = jaxsync.distributed_optimizer(optax.adam(3e-4), axis_name="data",
      ...                                    clip_grad_norm=1.0)
      >>> opt_state = tx.sharded_init(params, mesh)   # outside shard_map
      >>> # inside shard_map over "data":
      >>> loss, grads = jaxsync.value_and_grad(loss_fn, axis_name="data")(params, batch)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> params = optax.apply_updates(params, updates)
    """
    axes = normalize_axes(axis_name)
    if isinstance(inner, Mapping):
        if labels is None:
            raise ValueError(
                "`inner` is a mapping of label -> transformation, so `labels` is required "
                "(a pytree of labels shaped like the params, or a function returning one)."
            )
        for k, v in inner.items():
            if not hasattr(v, "init") or not hasattr(v, "update"):
                raise TypeError(f"`inner[{k!r}]` is not an optax GradientTransformation: {v!r}")
    elif not hasattr(inner, "init") or not hasattr(inner, "update"):
        raise TypeError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
    elif labels is not None:
        raise ValueError(
            "`labels` needs `inner` to be a mapping label -> transformation; got a single "
            "transformation."
        )
    clip_grad_norm = check_optimizer_args(clip_grad_norm, reduce_dtype, check_elementwise, rules)
    check_multi_steps_clip(inner, clip_grad_norm)
    bucket_size = check_bucket_size(bucket_size)
    check_loss_scale(loss_scale)
    stacked = normalize_stacked(stacked)
    det = check_deterministic(deterministic)
    if det is not None and (rules is not None or stacked):
        raise NotImplementedError(
            "distributed_optimizer: `deterministic=` supports plain data parallelism only; "
            f"drop `rules` ({rules!r}) and `stacked` ({stacked!r}), or drop `deterministic`."
        )
    # muon as the user wrote it: each param owned whole, in the tree its routing reads
    inner = {k: as_written(v) for k, v in inner.items()} if labels else as_written(inner)
    owned = [
        k
        for k, v in (inner.items() if isinstance(inner, Mapping) else [(None, inner)])
        if isinstance(v, WholeMatrices)
    ]
    if det is not None and owned:
        raise NotImplementedError(
            "distributed_optimizer: `deterministic=` sums flat shards exactly and does not "
            f"support whole-matrix ownership (`jaxsync.whole_matrices` for labels {owned}); "
            "drop `deterministic`, or use an elementwise optimizer for those params."
        )
    if det is not None and jnp.dtype(reduce_dtype) != jnp.float32:
        raise ValueError(
            "distributed_optimizer: `deterministic=` sums exactly and hands fp32 to the "
            f"optimizer; `reduce_dtype` must be float32, got {reduce_dtype!r}."
        )
    cfg = Plan(
        inner,
        axes,
        labels,
        bucket_size,
        reduce_dtype,
        clip_grad_norm,
        loss_scale,
        check_elementwise,
        rules,
        stacked,
        det,
        norms=check_bool(norms, "norms"),
    )

    def init_fn(params: PyTree) -> DistributedOptimizerState:
        bound_axes(axes, "distributed_optimizer.init")
        layout = cfg.layout_inside(params)
        check_update(None, None, params, layout, cfg, "distributed_optimizer.init")
        cfg.check(params, layout)
        return cfg.init_for_rank(params, layout, lambda bi: rank(layout.buffers[bi].key.axes))

    def update_fn(
        grads: PyTree, state: DistributedOptimizerState, params: PyTree | None = None, **extra
    ) -> tuple[PyTree, DistributedOptimizerState]:
        del extra
        if params is None:
            raise ValueError(NEED_PARAMS)
        new, state = apply_fn(grads, state, params, "distributed_optimizer.update")
        # `new - p` is exact whenever new and p are within a factor of 2 (Sterbenz),
        # so `apply_updates` lands exactly on the gathered values, and params can
        # never drift from the master. Done per leaf: flattening the params to
        # subtract them on flat buffers made the whole step 1.6x slower (CPU).
        updates = jax.tree.map(
            lambda n, p: n.astype(jnp.float32) - p.astype(jnp.float32), new, params
        )
        return updates, state

    def apply_fn(
        grads: PyTree,
        state: DistributedOptimizerState,
        params: PyTree,
        fn: str,
        held: frozenset[int] = frozenset(),
    ) -> tuple[PyTree, DistributedOptimizerState]:
        bound_axes(axes, fn)
        layout = cfg.layout_inside(params)
        check_update(grads, state, params, layout, cfg, fn)
        scale = active_scale(cfg.loss_scale, state.loss_scale)
        inv_scale = None if scale is None else 1.0 / scale
        if det is not None:
            exact = exact_shards(cfg, layout, grads, inv_scale)
            shards, grad_norm, num_zeros, finite, flags = exact
            return apply_shards(
                cfg, layout, shards, state, params, None, grad_norm, num_zeros, finite, flags
            )
        if isinstance(grads, UnitGrads):
            raise TypeError(
                UNIT_GRADS_WITHOUT_MODE.format(fn="distributed_optimizer", units=grads.units)
            )
        if isinstance(grads, ShardedGrads):
            # Reduced already (inside the backward scan): only unscale.
            shards = check_sharded_grads(grads, layout)
            if inv_scale is not None:
                shards = tuple(s * inv_scale.astype(s.dtype) for s in shards)
        else:
            layout.check_tree(grads, "grads")
            shards = bucket_reduce_scatter(
                grads, layout, axis_name=axes, reduce_dtype=reduce_dtype, scale=inv_scale
            )

        grad_norm, num_zeros = shard_stats(layout, shards)
        finite = jnp.isfinite(grad_norm)
        return apply_shards(
            cfg, layout, shards, state, params, grads, grad_norm, num_zeros, finite, held=held
        )

    tx = DistributedOptimizer(init_fn, update_fn)
    tx.__dict__["config"] = cfg
    tx.__dict__["apply_fn"] = apply_fn
    return tx


def apply_shards(
    cfg: Plan,
    layout: Layout,
    shards: tuple[jax.Array, ...],
    state: DistributedOptimizerState,
    params: PyTree,
    grads: Any,
    grad_norm: jax.Array,
    num_zeros: jax.Array,
    finite: jax.Array,
    units: Any = None,
    held: frozenset[int] = frozenset(),
) -> tuple[PyTree, DistributedOptimizerState]:
    """The step after the reduction: clip, inner update on the shard, master, gather.

    Returns the new params (gathered, in their own dtypes) and the new state. The
    buffers in ``held`` are not gathered (their leaves come back as in ``params``):
    the step gathers them layer by layer in the next forward instead.
    """
    if cfg.clip_grad_norm is not None:
        shards = clip_to_norm(shards, grad_norm, cfg.clip_grad_norm)

    new_master, new_inner, out, updates = [], [], [], []
    for bi, buf in enumerate(layout.buffers):
        master = state.master[bi]
        # A skipped step selects every output back to its old value, so a NaN in
        # the grads never leaves it, and no `where(finite, g, 0)` is needed: XLA
        # made that zero a buffer of the whole shard (+473 MiB per H100 on a 1.1B
        # model, its stacked rows' `[layers, shard]`).
        g = shards[bi].astype(jnp.float32)
        upd, inner_state = cfg.inner_for(layout, bi).update(g, state.inner_state[bi], master)
        inner_state = jax.tree.map(
            lambda a, b: jnp.where(finite, a, b), inner_state, state.inner_state[bi]
        )
        new_inner.append(inner_state)
        updates.append(upd)
        # The barrier makes the state and the gathered params one computation:
        # XLA may otherwise duplicate the add into two fusions that round
        # differently (an FMA in one of them), and params drift off the master.
        stepped = jnp.where(finite, master + upd.astype(jnp.float32), master)
        new_master.append(jax.lax.optimization_barrier(stepped))
        # Gather the new params in their own dtype (bf16: half the bytes).
        out.append(new_master[-1].astype(buf.key.dtype))
    gathered = gather_params(tuple(out), layout, cfg.axes, params, skip=held)
    metrics = next_metrics(state.metrics, grads, finite, grad_norm, num_zeros, units)
    if cfg.norms:  # where the update is made: on the shards, one psum of two floats
        metrics = with_norms(metrics, shard_sums(cfg, layout, updates, new_master, finite))
    new_state = DistributedOptimizerState(
        master=tuple(new_master),
        inner_state=tuple(new_inner),
        loss_scale=update_loss_scale(cfg.loss_scale, state.loss_scale, finite),
        metrics=metrics,
    )
    return gathered, new_state

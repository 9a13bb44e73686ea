"""The distributed (ZeRO-1/2) optimizer: Megatron's DistributedOptimizer for optax.

Every flat gradient buffer is cut into ``N`` equal shards per bucket; rank ``r``
reduce-scatters the gradients into its shard, keeps fp32 master copies of the
bf16/fp16 params in that shard, runs the inner optax transformation on the
shard only, and all-gathers the new params. Per-device optimizer memory falls
from ``P * (4 + state)`` bytes to ``ceil(P / N) * (4 + state)`` plus padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .axes import (
    AxisName,
    bound_axes,
    mesh_axes_size,
    normalize_axes,
    rank,
    to_varying,
    varying_axes,
)
from .collectives import bucket_all_gather, bucket_reduce_scatter
from .elementwise import check_elementwise
from .finalize import ExpertParallel, SyncRules, sync_keys
from .grad_sync import all_reduce_grads
from .layout import BufferKey, Layout, build_layout
from .loss_scale import (
    LossScale,
    LossScaleState,
    check_loss_scale,
    init_loss_scale,
    update_loss_scale,
)
from .portable import (
    buffer_name,
    convert,
    param_name,
    param_sharding,
    params_to_shards,
    shards_to_params,
    slot_names,
)

PyTree = Any
Labels = PyTree | Callable[[PyTree], PyTree] | None


class StepMetrics(NamedTuple):
    """Diagnostics of the last update, returned as data (never printed).

    Attributes:
      grad_norm: global L2 norm of the reduced, unscaled gradient (before clipping).
      num_zeros: number of exactly-zero gradient elements (padding excluded).
      skipped: whether the last step was skipped for non-finite gradients.
      skipped_steps: steps skipped so far.
    """

    grad_norm: jax.Array
    num_zeros: jax.Array
    skipped: jax.Array
    skipped_steps: jax.Array


class DistributedOptimizerState(NamedTuple):
    """State of :func:`distributed_optimizer`; arrays only.

    Attributes:
      master: per buffer, this rank's fp32 master shard of the params. Kept for
        fp32 params too (Megatron reads those from the param itself): slicing
        the rank's piece out of the replicated params every step costs a full
        flatten, far more than the 4 bytes per sharded element.
      inner_state: per buffer, the inner transformation's state over the shard.
      loss_scale: the loss scaler (scale 1 when no scaling is used).
      metrics: diagnostics of the last step.
    """

    master: tuple[jax.Array, ...]
    inner_state: tuple[optax.OptState, ...]
    loss_scale: LossScaleState
    metrics: StepMetrics


class DistributedOptimizer(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` with helpers for its sharded state.

    Use ``init`` and ``update`` inside ``jax.shard_map`` over the data-parallel
    axes; use :meth:`state_specs`, :meth:`state_shardings` and
    :meth:`sharded_init` from outside it.
    """

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

    def to_portable(
        self, state: DistributedOptimizerState, params: PyTree, mesh: Mesh
    ) -> dict[str, Any]:
        """The state as per-parameter arrays, independent of the DP size (for saving).

        Returns a dict ``{"master": {name: array}, "inner_state": {buffer: state},
        "loss_scale": ..., "metrics": ...}`` in which every shard-shaped leaf has
        become ``{param name: array of the param's shape}``.
        """
        fn, out, _ = self._portable_fn(params, mesh)
        return convert(fn, (state,), mesh, out)

    def portable_shapes(self, params: PyTree, mesh: Mesh) -> dict[str, Any]:
        """``ShapeDtypeStruct``s (with shardings) of :meth:`to_portable`'s result."""
        fn, out, glob = self._portable_fn(params, mesh)
        shapes = jax.eval_shape(fn, glob)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, out
        )

    def from_portable(
        self, portable: dict[str, Any], params: PyTree, mesh: Mesh
    ) -> DistributedOptimizerState:
        """Inverse of :meth:`to_portable` onto ``mesh``, whose DP size may differ."""
        layout, _, pspecs = self._config.layout_outside(params, mesh)
        pspecs = jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P))
        sizes = dict(mesh.shape)
        names = slot_names(layout, params)
        specs = self.state_specs(params, mesh)
        missing = sorted(set(names) - set(portable.get("master", {})))
        if missing:
            raise ValueError(
                f"the saved optimizer state has no master values for params {missing}; "
                "it was saved for a different model."
            )

        def fn(portable: dict[str, Any]) -> DistributedOptimizerState:
            master, inner = [], []
            for bi in range(len(layout.buffers)):
                master.append(
                    params_to_shards(layout, bi, portable["master"], names, pspecs, sizes)
                )
                saved = portable["inner_state"][buffer_name(layout, bi)]
                inner.append(
                    jax.tree.map(
                        lambda s, x, bi=bi: (
                            params_to_shards(layout, bi, x, names, pspecs, sizes) if s != P() else x
                        ),
                        specs.inner_state[bi],
                        saved,
                        is_leaf=lambda x: isinstance(x, P),
                    )
                )
            return DistributedOptimizerState(
                master=tuple(master),
                inner_state=tuple(inner),
                loss_scale=LossScaleState(*portable["loss_scale"]),
                metrics=StepMetrics(*portable["metrics"]),
            )

        return convert(fn, (portable,), mesh, self.state_shardings(params, mesh))

    def _portable_fn(self, params: PyTree, mesh: Mesh) -> tuple[Any, Any, Any]:
        layout, local, pspecs = self._config.layout_outside(params, mesh)
        pspecs = jax.tree.leaves(pspecs, is_leaf=lambda x: isinstance(x, P))
        sizes = dict(mesh.shape)
        names = slot_names(layout, params)
        specs = self.state_specs(params, mesh)
        axes = self._config.axes
        leaves = jax.tree.leaves(params)
        by_name = {names[i]: (tuple(leaves[i].shape), pspecs[i]) for i in range(len(names))}

        def fn(state: DistributedOptimizerState) -> dict[str, Any]:
            def to_params(bi: int, x: jax.Array) -> dict[str, jax.Array]:
                return shards_to_params(layout, bi, x, names, pspecs, sizes)

            master: dict[str, jax.Array] = {}
            inner = {}
            for bi in range(len(layout.buffers)):
                master.update(to_params(bi, state.master[bi]))
                inner[buffer_name(layout, bi)] = jax.tree.map(
                    lambda s, x, bi=bi: to_params(bi, x) if s != P() else x,
                    specs.inner_state[bi],
                    state.inner_state[bi],
                    is_leaf=lambda x: isinstance(x, P),
                )
            return {
                "master": master,
                "inner_state": inner,
                "loss_scale": tuple(state.loss_scale),
                "metrics": tuple(state.metrics),
            }

        def sharding_for(path: Any, x: Any) -> NamedSharding:
            # Per-param arrays: sharded like the param where it is model-parallel,
            # else over the data axes where the leading dimension divides.
            name = param_name(path[-1:]) if path else ""
            shape = tuple(getattr(x, "shape", ()))
            if name in by_name and shape == by_name[name][0]:
                if by_name[name][1] != P():
                    return NamedSharding(mesh, by_name[name][1])
                return param_sharding(mesh, axes, shape)
            return NamedSharding(mesh, P())

        abstract = jax.eval_shape(
            lambda p: self._config.init_for_rank(p, layout, lambda _: 0), local
        )
        glob = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(
                (x.shape[0] * math.prod(sizes[a] for a in spec_axes(s)), *x.shape[1:])
                if s != P()
                else x.shape,
                x.dtype,
            ),
            abstract,
            specs,
            is_leaf=lambda x: isinstance(x, P) or x is None,
        )
        out = jax.tree_util.tree_map_with_path(sharding_for, jax.eval_shape(fn, glob))
        return fn, out, glob

    @property
    def _config(self) -> _Config:
        return self.__dict__["config"]


class _Config:
    """Everything the transformation closes over; hashable by identity."""

    def __init__(
        self,
        inner: optax.GradientTransformation | Mapping[str, optax.GradientTransformation],
        axes: tuple[str, ...],
        labels: Labels,
        bucket_size: int | None,
        reduce_dtype: Any,
        clip_grad_norm: float | None,
        loss_scale: LossScale,
        check_elementwise: bool,
        rules: SyncRules | None = None,
    ):
        self.rules = rules
        self.inner = inner
        self.axes = axes
        self.labels = labels
        self.bucket_size = bucket_size
        self.reduce_dtype = reduce_dtype
        self.clip_grad_norm = clip_grad_norm
        self.loss_scale = loss_scale
        self.check_elementwise = check_elementwise

    # ------------------------------------------------------------- layout
    def label_tree(self, params: PyTree) -> PyTree | None:
        if self.labels is None:
            return None
        labels = self.labels(params) if callable(self.labels) else self.labels
        try:
            flat = jax.tree.leaves(jax.tree.map(lambda _, lab: lab, params, labels))
        except ValueError as e:
            raise ValueError(
                f"`labels` must have the structure of the params (one string per param); {e}"
            ) from e
        names = sorted(set(flat))
        assert isinstance(self.inner, Mapping)
        missing = [n for n in names if n not in self.inner]
        if missing:
            raise ValueError(
                f"`labels` uses {missing}, which `inner` has no transformation for; "
                f"`inner` has keys {sorted(self.inner)}."
            )
        return labels

    def layout(
        self,
        params: PyTree,
        mesh_shape: Mapping[str, int],
        varying: Sequence[tuple[str, ...]],
    ) -> Layout:
        """The layout for local params, given which non-DP axes each one varies over."""
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        labels = self.label_tree(params)
        labs = [None] * len(leaves)
        if labels is not None:
            labs = jax.tree.leaves(jax.tree.map(lambda _, lab: lab, params, labels))
        syncs = sync_keys(self.rules, params, self.axes, mesh_shape)
        by_path = {}
        for (path, _), lab, sync, var in zip(leaves, labs, syncs, varying, strict=True):
            name = jax.tree_util.keystr(path)
            bad = set(var) & set(sync.dp_axes)
            if bad:
                raise ValueError(
                    f"param {param_name(path)} differs across data-parallel axes {sorted(bad)}; "
                    "params must be replicated over the axes the optimizer shards over. Pass "
                    "it with a PartitionSpec that does not name those axes (or mark an "
                    "expert axis with jaxsync.ExpertParallel)."
                )
            by_path[name] = (lab, sync, tuple(sorted(var)))

        def key_fn(path: str, leaf: Any) -> BufferKey:
            lab, sync, var = by_path[path]
            return BufferKey(
                jnp.dtype(leaf.dtype).name, sync.dp_axes, lab, sync.sum_axes, sync.mean_axes, var
            )

        return build_layout(
            params,
            num_shards=lambda key: math.prod(mesh_shape[a] for a in key.axes),
            bucket_size=self.bucket_size,
            key_fn=key_fn,
        )

    def layout_inside(self, params: PyTree) -> Layout:
        """Layout inside shard_map: local shapes, varying axes from the params' types."""
        mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
        dp = set(self.axes)
        dp_only = dp - self.expert_axes()
        varying = [tuple(varying_axes(x) - dp_only) for x in jax.tree.leaves(params)]
        return self.layout(params, mesh_shape, varying)

    def layout_outside(
        self, params: PyTree, mesh: Mesh, param_specs: PyTree = None
    ) -> tuple[Layout, PyTree, PyTree]:
        """Layout from global params (outside shard_map): (layout, local params, specs)."""
        specs = param_specs_of(params, param_specs)
        local = jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(local_shape(x.shape, spec, mesh), x.dtype),
            params,
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        varying = [spec_axes(spec) for spec in jax.tree.leaves(specs, is_leaf=is_spec)]
        return self.layout(local, dict(mesh.shape), varying), local, specs

    def expert_axes(self) -> set[str]:
        if self.rules is None:
            return set()
        return {r.axis for _, r in self.rules.rules if isinstance(r, ExpertParallel)}

    def inner_for(self, layout: Layout, buffer: int) -> optax.GradientTransformation:
        label = layout.buffers[buffer].key.label
        return self.inner if label is None else self.inner[label]

    # --------------------------------------------------------------- init
    def init_for_rank(
        self, params: PyTree, layout: Layout, rank_of: Callable[[int], Any]
    ) -> DistributedOptimizerState:
        flat = layout.flatten(params, jnp.float32)
        master, inner_state = [], []
        for bi in range(len(layout.buffers)):
            shard = layout.shard_of(bi, flat[bi], rank_of(bi))
            master.append(shard)
            inner_state.append(self.inner_for(layout, bi).init(shard))
        zero_f, zero_i = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        return DistributedOptimizerState(
            master=tuple(master),
            inner_state=tuple(inner_state),
            loss_scale=init_loss_scale(self.loss_scale),
            metrics=StepMetrics(zero_f, zero_i, jnp.zeros((), bool), zero_i),
        )

    def check(self, params: PyTree, layout: Layout) -> None:
        if not self.check_elementwise:
            return
        for bi, buf in enumerate(layout.buffers):
            sub = [jax.ShapeDtypeStruct(layout.slots[i].shape, jnp.float32) for i in buf.slots]
            if buf.key.label is None:
                sub = params  # the whole tree: masks by path or ndim are probed as written
            what = "all params" if buf.key.label is None else f"label {buf.key.label!r}"
            check_elementwise(self.inner_for(layout, bi), sub, what)

    def state_specs(
        self, params: PyTree, mesh: Mesh, param_specs: PyTree = None
    ) -> DistributedOptimizerState:
        layout, local, _ = self.layout_outside(params, mesh, param_specs)
        shapes = jax.eval_shape(lambda p: self.init_for_rank(p, layout, lambda _: 0), local)

        def spec_for(bi: int) -> Callable[[Any], P]:
            size = layout.shard_size(bi)
            key = layout.buffers[bi].key
            sharded = P(key.axes + key.varying)
            return lambda x: sharded if x.ndim >= 1 and x.shape[0] == size else P()

        return DistributedOptimizerState(
            master=tuple(spec_for(bi)(m) for bi, m in enumerate(shapes.master)),
            inner_state=tuple(
                jax.tree.map(spec_for(bi), s) for bi, s in enumerate(shapes.inner_state)
            ),
            loss_scale=jax.tree.map(lambda _: P(), shapes.loss_scale),
            metrics=jax.tree.map(lambda _: P(), shapes.metrics),
        )


def param_specs_of(params: PyTree, param_specs: PyTree = None) -> PyTree:
    """The params' PartitionSpecs: given, else read from NamedShardings, else ``P()``."""
    if param_specs is not None:
        return param_specs
    return jax.tree.map(
        lambda x: (
            x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P()
        ),
        params,
    )


def spec_axes(spec: P) -> tuple[str, ...]:
    out = []
    for entry in spec:
        if entry is None:
            continue
        out.extend((entry,) if isinstance(entry, str) else entry)
    return tuple(sorted(out))


def local_shape(shape: tuple[int, ...], spec: P, mesh: Mesh) -> tuple[int, ...]:
    """Per-device shape of a global array sharded by ``spec`` over ``mesh``."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        n = math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))
        out[dim] //= n
    return tuple(out)


NEED_PARAMS = (
    "distributed_optimizer.update needs `params`: it returns updates relative to "
    "them. Call "
    "`tx.update(grads, state, params)`."
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
        transformation used with ``labels``.
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
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise ValueError(f"`clip_grad_norm` must be positive or None, got {clip_grad_norm!r}.")
    if bucket_size is not None and (not isinstance(bucket_size, int) or bucket_size <= 0):
        raise ValueError(
            f"`bucket_size` must be a positive number of elements or None, got {bucket_size!r}."
        )
    check_loss_scale(loss_scale)
    cfg = _Config(
        inner,
        axes,
        labels,
        bucket_size,
        reduce_dtype,
        clip_grad_norm,
        loss_scale,
        check_elementwise,
        rules,
    )

    def init_fn(params: PyTree) -> DistributedOptimizerState:
        bound_axes(axes, "distributed_optimizer.init")
        layout = cfg.layout_inside(params)
        cfg.check(params, layout)
        return cfg.init_for_rank(params, layout, lambda bi: rank(layout.buffers[bi].key.axes))

    def update_fn(
        grads: PyTree, state: DistributedOptimizerState, params: PyTree | None = None, **extra
    ) -> tuple[PyTree, DistributedOptimizerState]:
        del extra
        if params is None:
            raise ValueError(NEED_PARAMS)
        bound_axes(axes, "distributed_optimizer.update")
        layout = cfg.layout_inside(params)
        layout.check_tree(grads, "grads")
        inv_scale = 1.0 / state.loss_scale.scale
        shards = bucket_reduce_scatter(
            grads, layout, axis_name=axes, reduce_dtype=reduce_dtype, scale=inv_scale
        )

        # One small all-reduce for the norm and the zero count of the whole model.
        # One small all-reduce over the whole mesh for the norm and the zero count.
        # Every logical element counts once: shards are disjoint over their buffer's
        # axes, pieces over the `varying` axes are distinct, and copies replicated
        # over the remaining axes are weighted by 1 / (number of copies).
        mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
        all_axes = tuple(mesh_shape)
        stats, padding = [], 0.0
        for bi, (s, buf) in enumerate(zip(shards, layout.buffers, strict=True)):
            key = buf.key
            copies = math.prod(
                n for a, n in mesh_shape.items() if a not in key.axes and a not in key.varying
            )
            stat = (
                jnp.stack(
                    [
                        jnp.sum(jnp.square(s.astype(jnp.float32))),
                        jnp.sum(s == 0).astype(jnp.float32),
                    ]
                )
                / copies
            )
            stats.append(to_varying(stat, all_axes))
            padding += (buf.size - buf.used) * math.prod(mesh_shape[a] for a in key.varying)
            del bi
        total = jax.lax.psum(sum(stats), all_axes)
        grad_norm = jnp.sqrt(total[0])
        num_zeros = jnp.round(total[1] - padding).astype(jnp.int32)
        finite = jnp.isfinite(grad_norm)

        if clip_grad_norm is not None:
            # Same arithmetic as optax.clip_by_global_norm, so results match it.
            keep = grad_norm < clip_grad_norm
            shards = tuple(
                jnp.where(keep, s, (s / grad_norm.astype(s.dtype)) * clip_grad_norm) for s in shards
            )

        new_master, new_inner, out = [], [], []
        for bi, buf in enumerate(layout.buffers):
            master = state.master[bi]
            g = jnp.where(finite, shards[bi], 0.0).astype(jnp.float32)
            upd, inner_state = cfg.inner_for(layout, bi).update(g, state.inner_state[bi], master)
            upd = jnp.where(finite, upd, 0.0).astype(jnp.float32)
            inner_state = jax.tree.map(
                lambda a, b: jnp.where(finite, a, b), inner_state, state.inner_state[bi]
            )
            new_inner.append(inner_state)
            # The barrier makes the state and the gathered params one computation:
            # XLA may otherwise duplicate the add into two fusions that round
            # differently (an FMA in one of them), and params drift off the master.
            new_master.append(jax.lax.optimization_barrier(master + upd))
            # Gather the new params in their own dtype (bf16: half the bytes).
            out.append(new_master[-1].astype(buf.key.dtype))
        gathered = layout.unflatten(bucket_all_gather(tuple(out), layout, axis_name=axes))
        # `new - p` is exact whenever new and p are within a factor of 2 (Sterbenz),
        # so `apply_updates` lands exactly on the gathered values, and params can
        # never drift from the master. Done per leaf: flattening the params to
        # subtract them on flat buffers made the whole step 1.6x slower (CPU).
        updates = jax.tree.map(
            lambda new, p: new.astype(jnp.float32) - p.astype(jnp.float32), gathered, params
        )

        skipped = jnp.logical_not(finite)
        new_state = DistributedOptimizerState(
            master=tuple(new_master),
            inner_state=tuple(new_inner),
            loss_scale=update_loss_scale(loss_scale, state.loss_scale, finite),
            metrics=StepMetrics(
                grad_norm=grad_norm,
                num_zeros=num_zeros,
                skipped=skipped,
                skipped_steps=state.metrics.skipped_steps + skipped.astype(jnp.int32),
            ),
        )
        return updates, new_state

    tx = DistributedOptimizer(init_fn, update_fn)
    tx.__dict__["config"] = cfg
    return tx


class SyncGradsState(NamedTuple):
    """:func:`sync_grads` keeps no state."""


def sync_grads(
    *,
    axis_name: AxisName,
    bucket_size: int | None = None,
    reduce_dtype: Any = jnp.float32,
    average: bool = True,
    rules: SyncRules | None = None,
) -> optax.GradientTransformation:
    """Plain data parallelism as an optax transformation: bucketed all-reduce.

    Put it first in an ``optax.chain`` to feed local gradients to a replicated
    optimizer (every rank holds the whole optimizer state):

      >>> tx = optax.chain(jaxsync.sync_grads(axis_name="data"),
      ...                  optax.clip_by_global_norm(1.0), optax.adam(3e-4))

    Reduced gradients keep their dtype; the reduction runs in ``reduce_dtype``.
    """
    axes = normalize_axes(axis_name)

    def init_fn(params: PyTree) -> SyncGradsState:
        del params
        return SyncGradsState()

    def update_fn(
        grads: PyTree, state: SyncGradsState, params: PyTree | None = None
    ) -> tuple[PyTree, SyncGradsState]:
        del params
        reduced = all_reduce_grads(
            grads,
            axis_name=axes,
            bucket_size=bucket_size,
            reduce_dtype=reduce_dtype,
            average=average,
            rules=rules,
        )
        return reduced, state

    return optax.GradientTransformation(init_fn, update_fn)

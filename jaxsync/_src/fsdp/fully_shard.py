"""Fully sharded data parallelism (ZeRO-3 / FSDP2) for JAX.

Params, gradients and optimizer state are all sharded: every rank holds only
its slice of each *unit*'s flat fp32 buffer (a unit is a layer or a group of
layers, chosen by name prefix). The forward pass all-gathers a unit's params in
``param_dtype`` just before the unit runs; the backward pass reduce-scatters the
unit's gradient in ``reduce_dtype`` straight into the shard (a ``custom_vjp`` on
the gather), so ``jax.grad`` with respect to the shards returns sharded,
reduced gradients and any elementwise optax optimizer updates the shards in
place. A unit is also the communication bucket: one all-gather and one
reduce-scatter per unit per step (two all-gathers with ``reshard_after_forward``).
With ``labels`` each unit's shard holds one piece per label (:mod:`fsdp.unit`),
and :meth:`FullyShard.multi_transform` runs one optimizer per label on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core.axes import AxisName, bound_axes, mesh_axes_size, normalize_axes
from ..core.names import group_trees, param_name
from ..core.validate import check_bool, check_float_params
from ..layout.layout import Layout
from ..layout.placement import normalize_stacked, stack_layers
from ..layout.records import BufferKey
from .gather import (
    MixedPrecision,
    default_policy,
    gather_pieces,
    gather_shard,
    reduce_shard,
)
from .grad import check_microbatches as check_microbatches
from .grad import value_and_grad as _value_and_grad
from .held import plain
from .optimizer import Labels, ShardMultiTransform, resolve_labels
from .optimizer import init_optimizer as _init_optimizer
from .optimizer import multi_transform as _multi_transform
from .optimizer import state_specs as _state_specs
from .shards import shard as _shard
from .shards import unshard as _unshard
from .unit import UnitFlat, assign_units, check_units, unit_flat
from .view import ShardedLayers as ShardedLayers
from .view import apply as _apply
from .view import gather_layer as _gather_layer
from .view import view as _view

PyTree = Any


class FullyShard:
    """A model's params split into units, each a flat fp32 buffer sharded over ranks.

    Build with :func:`fully_shard`. Use :meth:`shard` (outside shard_map) to make
    the global sharded params, :meth:`specs` for shard_map's specs, and inside the
    step :meth:`apply` to run a unit (gather -> call -> reshard), then
    ``jax.grad`` w.r.t. the shards.
    """

    def __init__(
        self,
        params: PyTree,
        *,
        axis_name: AxisName,
        units: Sequence[str],
        policy: MixedPrecision,
        reshard_after_forward: bool,
        replicate_axis: AxisName | None,
        num_shards: int,
        remat_policy: Callable[..., Any] = jax.checkpoint_policies.dots_saveable,
        stacked: tuple[str, ...] = (),
        mesh: Mesh | None = None,
        labels: Labels = None,
    ):
        self.axes = normalize_axes(axis_name)
        self.mesh = mesh
        self.stacked = stacked
        self.replicate_axes = () if replicate_axis is None else normalize_axes(replicate_axis)
        overlap = set(self.axes) & set(self.replicate_axes)
        if overlap:
            raise ValueError(
                f"`replicate_axis` {self.replicate_axes} and `axis_name` {self.axes} share "
                f"{sorted(overlap)}; hybrid sharding shards over one and replicates over the other."
            )
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward
        self.remat_policy = remat_policy
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        names = [param_name(p) for p, _ in leaves]
        self.units = tuple(units) + tuple(g for g in stacked if g not in units)
        layers = stack_layers(params, stacked) if stacked else {}
        self.treedef = jax.tree.structure(params)
        #: Each param's optimizer label (leaf order), or None without ``labels``.
        self.labels = resolve_labels(params, labels, "jaxsync.fully_shard")
        self._members = assign_units(names, self.units, stacked)
        self._flat = {
            u: unit_flat(
                {names[i]: leaves[i][1].shape for i in idx},
                None if self.labels is None else {names[i]: self.labels[i] for i in idx},
                BufferKey(jnp.dtype(policy.param_dtype).name, self.axes),
                num_shards,
                stacked=u if u in layers else None,
            )
            for u, idx in self._members.items()
        }
        self.param_names = tuple(names)
        self.param_shapes = tuple(tuple(int(d) for d in leaf.shape) for _, leaf in leaves)
        self.num_shards = num_shards
        self._layers = layers
        self.template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self._groups = group_trees(params, stacked)
        #: ``train_step``'s muon as written, each param owned by one rank (an
        #: ``optim.whole_tree.OwnedTree``): the checkpoint conversion reads it.
        self.owned_tree: Any = None

    # --------------------------------------------------------------- layout
    def layout(self, unit: str) -> Layout:
        """The unit's flat-buffer layout: one buffer per label (one without labels),
        one bucket each, padded for sharding."""
        self._check_unit(unit, "FullyShard.layout")
        return self._flat[unit].layout

    def unit_flat(self, unit: str) -> UnitFlat:
        """The unit's :class:`UnitFlat` (its layout and per-label pieces of a shard)."""
        self._check_unit(unit, "FullyShard.unit_flat")
        return self._flat[unit]

    def members(self, unit: str) -> tuple[int, ...]:
        """Leaf indices (in the params' leaf order) of the unit's params."""
        return self._members[unit]

    def pieces(self) -> tuple[tuple[str, str | None, int, int], ...]:
        """``(unit, label, start, end)`` of every label's piece in a rank's unit shards."""
        return tuple((u, *p) for u in self.units for p in self._flat[u].pieces())

    def _check_unit(self, unit: Any, fn: str, shards: Any = None) -> None:
        if unit not in self._flat:
            raise ValueError(
                f"{fn}: unknown unit {unit!r}; this FullyShard has units {list(self.units)}."
            )
        if shards is not None and (not isinstance(shards, Mapping) or unit not in shards):
            have = sorted(shards) if isinstance(shards, Mapping) else type(shards).__name__
            raise ValueError(
                f"{fn}: `shards` has no entry for unit {unit!r} (it has {have}); pass the "
                "dict {unit: shard} from `fs.shard` (inside shard_map: the step's argument)."
            )

    def unit_params(self, params: PyTree, unit: str) -> dict[str, Any]:
        """The unit's params of a tree shaped like the params: ``{param name: leaf}``."""
        leaves = jax.tree.leaves(params)
        return {self.param_names[i]: leaves[i] for i in self._members[unit]}

    def specs(self) -> dict[str, P]:
        """PartitionSpecs of the shards (shard over ``axis_name``, replicated elsewhere).

        A stacked unit's shard is ``[layers, shard]``, sharded on its last axis.
        """
        axes = self.axes if len(self.axes) > 1 else self.axes[0]
        return {u: P(None, axes) if u in self._layers else P(axes) for u in self.units}

    def _mesh(self, mesh: Mesh | None, fn: str) -> Mesh:
        """``mesh`` if given, else the one given to :func:`fully_shard`."""
        mesh = self.mesh if mesh is None else mesh
        if mesh is None:
            raise ValueError(f"{fn}: pass `mesh` (this FullyShard was built without one).")
        return mesh

    def shard(self, params: PyTree, mesh: Mesh | None = None) -> dict[str, jax.Array]:
        """Global fp32 shards of (replicated) ``params``: ``{unit: (N * shard,) array}``.

        ``mesh`` defaults to the one given to :func:`fully_shard`.
        """
        return _shard(self, params, self._mesh(mesh, "FullyShard.shard"))

    def init_optimizer(
        self,
        tx: optax.GradientTransformation,
        shards: dict[str, jax.Array],
        mesh: Mesh | None = None,
        *,
        check_elementwise: bool = True,
    ) -> tuple[Any, Any]:
        """``tx.init`` on the shards, per device; returns (global state, its specs).

        (:func:`jaxsync.train_step` with ``mode="fsdp"`` does this for you and
        keeps the specs with the state; ``mesh`` defaults to the FullyShard's.)

        Shard-shaped state leaves (moments) are sharded like the shards; scalars
        (Adam's count) are replicated. Any elementwise optax transformation works
        on the shards; for clipping use :func:`jaxsync.clip_by_global_norm`; for
        one optimizer per label pass :meth:`multi_transform`'s.
        ``check_elementwise`` probes ``tx`` once (on a tree shaped like the
        params against the same numbers as flat unit shards; per label for
        :meth:`multi_transform`) and rejects what would train differently on
        shards (``optax.clip_by_global_norm``, lamb, lars, adafactor, masks by
        path or shape).
        """
        check = check_bool(check_elementwise, "check_elementwise")
        return _init_optimizer(self, tx, plain(shards), mesh, check)

    def state_specs(self, tx: optax.GradientTransformation) -> Any:
        """PartitionSpecs of ``tx``'s state over the shards: moments sharded like the
        shards, scalars ``P()`` (the same name as the distributed optimizer's)."""
        return _state_specs(self, tx)

    def sharded_init(
        self, tx: optax.GradientTransformation, shards: dict[str, jax.Array], **kwargs: Any
    ) -> Any:
        """The global optimizer state over ``shards`` (as the distributed optimizer's
        ``sharded_init``; :meth:`init_optimizer` without the specs)."""
        return self.init_optimizer(tx, shards, **kwargs)[0]

    def multi_transform(
        self, transforms: dict[str, optax.GradientTransformation]
    ) -> ShardMultiTransform:
        """``optax.multi_transform`` over the shards: one optimizer per label.

        Each label's optimizer runs on its own pieces of the unit shards (the
        ``labels`` given to :func:`jaxsync.fully_shard` decide them), so every
        element's state exists once. Use the result as any optimizer over the
        shards: :meth:`init_optimizer`, then ``opt.update(grads, state, shards)``.

        Example:
          >>> fs = jaxsync.fully_shard(params, axis_name="data", mesh=mesh, units=units,
          ...     labels=lambda p: jax.tree.map(lambda x: "decay" if x.ndim > 1 else "no", p))
          >>> opt = fs.multi_transform({"decay": optax.adamw(1e-3, weight_decay=0.1),
          ...                           "no": optax.adamw(1e-3, weight_decay=0.0)})
          >>> state, specs = fs.init_optimizer(opt, fs.shard(params))
        """
        return _multi_transform(self, transforms)

    def unshard(self, shards: dict[str, jax.Array], mesh: Mesh | None = None) -> PyTree:
        """Full params from global shards (outside shard_map), in fp32.

        ``mesh`` defaults to the one given to :func:`fully_shard`. ``shards`` may be
        an FSDP step's ``state.params`` (a :class:`jaxsync.FsdpShards`).
        """
        shards = plain(shards)
        for unit in self.units:
            self._check_unit(unit, "FullyShard.unshard", shards)
        return _unshard(self, shards, self._mesh(mesh, "FullyShard.unshard"))

    # ---------------------------------------------------------------- gather
    def gather(self, shards: dict[str, jax.Array], unit: str) -> dict[str, jax.Array]:
        """All-gathers one unit (inside shard_map): ``{param name: array}`` in param_dtype.

        The backward pass reduce-scatters the gradient in ``reduce_dtype``
        (averaged over all data-parallel ranks, all-reduced over the replica axes
        under hybrid sharding) into the shard.
        """
        self._check_unit(unit, "FullyShard.gather", shards)
        flat = self._gather_flat(shards[unit], "FullyShard.gather")
        return self._flat[unit].unflatten(flat, self.policy.param_dtype)

    def _gather_flat(self, shard: jax.Array, fn: str, widths: Any = None) -> Any:
        """All-gather of a flat shard in param_dtype (with ``widths``: of each piece,
        :func:`.gather.gather_pieces`); the VJP reduce-scatters into the shard."""
        axes = bound_axes(self.axes, fn)
        rep = bound_axes(self.replicate_axes, fn) if self.replicate_axes else ()
        dtypes = jnp.dtype(self.policy.param_dtype).name, jnp.dtype(self.policy.reduce_dtype).name
        if widths is not None:
            return gather_pieces(shard, tuple(widths), axes, rep, *dtypes)
        return gather_shard(shard, axes, rep, *dtypes)

    def gather_layer(self, shard: jax.Array, unit: str) -> PyTree:
        """One layer of a stacked unit, gathered (inside the scanned layer body):
        :func:`.view.gather_layer`."""
        return _gather_layer(self, shard, unit)

    def layer_bytes(self) -> int:
        """Bytes of the largest stacked layer, gathered (0 without one)."""
        dtype = self.policy.param_dtype
        return max((self._flat[u].layout.layer_bytes([u], dtype) for u in self._layers), default=0)

    def view(self, shards: dict[str, Any]) -> PyTree:
        """The params as the model reads them, from the shards (inside shard_map).

        Unstacked units are gathered here (their gradient is reduce-scattered when
        the backward pass is done with them); each stacked group stays sharded, as
        a pytree that ``lax.scan`` slices per layer and :func:`jaxsync.tap` gathers
        inside the layer body. So the model code is the same as for plain data
        parallelism: ``loss_fn(fs.view(shards), batch)``. With
        ``reshard_after_forward``, remat the scanned layer body
        (``jax.checkpoint``) so that the backward gathers each layer again instead
        of keeping every gathered layer alive.
        """
        gathered: dict[str, Any] = {}
        for u in self.units:
            if u not in self._layers:
                gathered.update(self.gather(shards, u))
        return _view(self, shards, gathered, self._layers)

    def apply(self, shards: dict[str, Any], unit: str, fn: Callable[..., Any], *inputs: Any) -> Any:
        """Runs ``fn(unit_params, *inputs)`` with the unit gathered just before use.

        ``unit_params`` is ``{param name: array}`` for the unit's params. With
        ``reshard_after_forward`` the gathered params are not kept for the
        backward pass: the unit runs under ``jax.checkpoint`` with a policy that
        saves matmul outputs only, so the backward gathers the params again and
        recomputes the cheap elementwise work. If ``shards[unit]`` already holds
        gathered params (a dict), they are used as is.
        """
        self._check_unit(unit, "FullyShard.apply", shards)
        return _apply(self, shards, unit, fn, *inputs)

    def gather_all(self, shards: dict[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
        """Every unit gathered (for accumulation without a sync per microbatch)."""
        return {u: self.gather(shards, u) for u in self.units}

    def reduce_gathered(self, grads: dict[str, dict[str, jax.Array]]) -> dict[str, jax.Array]:
        """Local gradients of gathered units -> reduced shards (one reduce-scatter each)."""
        axes = bound_axes(self.axes, "FullyShard.reduce_gathered")
        out = {}
        for u in self.units:
            flat = self._flat[u].flatten(grads[u], self.policy.reduce_dtype)
            out[u] = reduce_shard(flat, axes, self.replicate_axes)
        return out

    def value_and_grad(
        self,
        loss_fn: Callable[..., Any],
        shards: dict[str, jax.Array],
        batch: Any,
        *,
        microbatches: int = 1,
        sync_grad_accum: bool = True,
        has_aux: bool = False,
    ) -> tuple[Any, dict[str, jax.Array]]:
        """Mean local loss and reduced shard gradients of ``loss_fn(shards, batch)``.

        With ``has_aux`` ``loss_fn`` returns ``(loss, aux)`` and the value is
        ``(loss, aux)``, aux of the last microbatch.

        With ``microbatches > 1`` the batch's leading axis is split and gradients
        accumulated in fp32. ``sync_grad_accum=True`` reduce-scatters after every
        microbatch (memory stays at one shard of gradients);
        ``False`` gathers all units once, accumulates full local gradients and
        reduce-scatters once (less communication, more memory).
        """
        return _value_and_grad(
            self, loss_fn, plain(shards), batch, microbatches=microbatches,
            sync_grad_accum=sync_grad_accum, has_aux=has_aux,
        )  # fmt: skip


def fully_shard(
    params: PyTree,
    *,
    axis_name: AxisName,
    units: Sequence[str],
    mesh: Mesh,
    policy: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    replicate_axis: AxisName | None = None,
    remat_policy: Callable[..., Any] = jax.checkpoint_policies.dots_saveable,
    stacked: str | Sequence[str] | None = None,
    labels: Labels = None,
) -> FullyShard:
    """Splits ``params`` into fully sharded units (ZeRO-3 / FSDP2).

    Args:
      params: the model's params (arrays or ``ShapeDtypeStruct``s).
      axis_name: mesh axis (or axes) each unit is sharded over.
      units: dotted name prefixes (``"embed"``, ``"blocks.0"``...); each param
        goes to the longest prefix of its name (:func:`jaxsync.param_name`).
      mesh: the mesh the step runs on.
      policy: :class:`MixedPrecision` (default: the params' own float dtype when
        they share one, else fp32; gradients reduced in fp32).
      reshard_after_forward: drop gathered params after each unit's forward and
        gather them again in the backward (less memory, one more all-gather).
      remat_policy: what a resharded unit keeps for its backward pass (default:
        matmul outputs; ``jax.checkpoint_policies.nothing_saveable`` recomputes
        the whole unit, as activation checkpointing does).
        The mesh is kept: ``shard``, ``unshard`` and ``init_optimizer`` default to it.
      replicate_axis: hybrid sharding: shard over ``axis_name`` inside each
        group, replicate over this axis (gradients all-reduced across it).
      stacked: dotted prefixes of stacked-layer groups (leading layer axis, run
        by ``lax.scan``). Each is a unit of its own whose shard is
        ``[layers, shard]``, a piece of every param of the layer; the model reads
        it through :meth:`FullyShard.view` and :func:`jaxsync.tap`, which gathers
        one layer in the forward loop body, each param straight into its own
        array, and reduce-scatters its gradient in the backward loop body.
      labels: optimizer labels (a pytree of strings shaped like the params, or a
        function of the params returning one), for one optimizer per label
        (:meth:`FullyShard.multi_transform`: weight decay on matrices only). Each
        unit's shard then holds one piece per label; still one all-gather and one
        reduce-scatter per unit.

    Example:
      >>> fs = jaxsync.fully_shard(params, axis_name="data", mesh=mesh,
      ...                          units=["embed", "blocks.0", "blocks.1", "head"])
      >>> shards = fs.shard(params)   # on the mesh given here
      >>> # inside shard_map:  x = fs.apply(shards, "blocks.0", block_fn, x)
    """

    check_float_params(params, "fsdp", "jaxsync.fully_shard")
    n = mesh_axes_size(mesh, axis_name, "jaxsync.fully_shard")
    if replicate_axis is not None:
        mesh_axes_size(mesh, replicate_axis, "jaxsync.fully_shard")
    stacked = normalize_stacked(stacked)
    check_units(units, stacked)
    if policy is not None and not isinstance(policy, MixedPrecision):
        raise TypeError(f"`policy` must be a jaxsync.MixedPrecision or None, got {policy!r}.")
    check_bool(reshard_after_forward, "reshard_after_forward")
    return FullyShard(
        params,
        axis_name=axis_name,
        units=units,
        policy=policy or default_policy(params),
        reshard_after_forward=reshard_after_forward,
        replicate_axis=replicate_axis,
        num_shards=n,
        remat_policy=remat_policy,
        stacked=stacked,
        mesh=mesh,
        labels=labels,
    )

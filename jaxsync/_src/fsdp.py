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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .axes import AxisName, bound_axes, mesh_axes_size, normalize_axes, to_varying
from .checks import check_bool
from .elementwise import check_elementwise as elementwise
from .fsdp_gather import MixedPrecision, cast_floats, gather_shard, reduce_shard
from .layout import BufferKey, Layout
from .names import group_of, param_name
from .placement import build_layout, normalize_stacked, stack_layers
from .portable import convert

PyTree = Any

#: ``checkpoint_name`` of a gathered stacked layer (for remat policies).
GATHERED = "jaxsync_gathered_layer"


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
        unit_of = []
        for name in names:
            group = group_of(name, stacked)
            if group is not None:
                unit_of.append(group)  # a scanned stack is one unit, never split
                continue
            hits = [u for u in self.units if name == u or name.startswith(u + ".")]
            if not hits:
                raise ValueError(
                    f"param {name} belongs to no unit; `units` are {list(self.units)}. Add a "
                    "unit that is a prefix of its dotted name (or the name itself)."
                )
            unit_of.append(max(hits, key=len))
        empty = [u for u in self.units if u not in unit_of]
        if empty:
            raise ValueError(f"units {empty} hold no params; param names look like {names[:6]}.")
        self._treedef = jax.tree.structure(params)
        self._unit_of = tuple(unit_of)
        self._members = {u: tuple(i for i, x in enumerate(unit_of) if x == u) for u in self.units}
        self._sub = {}
        for u, idx in self._members.items():
            sub = {names[i]: jax.ShapeDtypeStruct(leaves[i][1].shape, jnp.float32) for i in idx}
            self._sub[u] = build_layout(
                sub,
                num_shards=num_shards,
                key_fn=lambda _p, _x: BufferKey(jnp.dtype(policy.param_dtype).name, self.axes),
                stacked=(u,) if u in layers else None,
            )
        self._names = tuple(names)
        self._shapes = tuple(tuple(int(d) for d in leaf.shape) for _, leaf in leaves)
        self.num_shards = num_shards
        self._layers = layers
        self._template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self._groups = _group_trees(params, stacked)

    # --------------------------------------------------------------- layout
    def layout(self, unit: str) -> Layout:
        """The unit's flat-buffer layout (one buffer, one bucket, padded for sharding)."""
        self._check_unit(unit, "FullyShard.layout")
        return self._sub[unit]

    def _check_unit(self, unit: Any, fn: str, shards: Any = None) -> None:
        if unit not in self._sub:
            raise ValueError(
                f"{fn}: unknown unit {unit!r}; this FullyShard has units {list(self.units)}."
            )
        if shards is not None and (not isinstance(shards, dict) or unit not in shards):
            have = sorted(shards) if isinstance(shards, dict) else type(shards).__name__
            raise ValueError(
                f"{fn}: `shards` has no entry for unit {unit!r} (it has {have}); pass the "
                "dict {unit: shard} from `fs.shard` (inside shard_map: the step's argument)."
            )

    def _unit_params(self, params: PyTree, unit: str) -> dict[str, Any]:
        leaves = jax.tree.leaves(params)
        return {self._names[i]: leaves[i] for i in self._members[unit]}

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
        mesh = self._mesh(mesh, "FullyShard.shard")
        n = mesh_axes_size(mesh, self.axes, "FullyShard.shard")
        if n != self.num_shards:
            raise ValueError(
                f"this FullyShard was built for {self.num_shards} shards; "
                f"axis {self.axes} of the mesh has {n}."
            )
        # Units pick their params by leaf position: another tree with as many
        # leaves of the same shapes would be sharded under the wrong names.
        treedef = jax.tree.structure(params)
        if treedef != self._treedef:
            raise ValueError(
                "FullyShard.shard: `params` does not have the structure this FullyShard "
                f"was built for.\n  expected: {self._treedef}\n  received: {treedef}\n"
                "Pass the params given to `jaxsync.fully_shard`."
            )

        def build(params: PyTree) -> dict[str, jax.Array]:
            out = {}
            for u in self.units:
                layout = self._sub[u]
                (flat,) = layout.flatten(self._unit_params(params, u), jnp.float32)
                ranks = jnp.stack([layout.shard_of(0, flat, r) for r in range(n)], axis=-2)
                out[u] = ranks.reshape(*ranks.shape[:-2], -1)  # [(layers,) n * shard]
            return out

        shardings = {u: NamedSharding(mesh, s) for u, s in self.specs().items()}
        return convert(build, (params,), mesh, shardings, key=("fsdp.shard", self, mesh))

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
        on the shards; for clipping use :func:`jaxsync.clip_by_global_norm`.
        ``check_elementwise`` probes ``tx`` once (on a tree shaped like the
        params against the same numbers as flat unit shards) and rejects what
        would train differently on shards (``optax.clip_by_global_norm``, lamb,
        lars, adafactor, masks by path or shape).
        """
        if not hasattr(tx, "init") or not hasattr(tx, "update"):
            raise TypeError(f"`tx` must be an optax GradientTransformation, got {tx!r}.")
        if check_bool(check_elementwise, "check_elementwise"):
            probe = jax.tree.unflatten(
                self._treedef, [jax.ShapeDtypeStruct(s, jnp.float32) for s in self._shapes]
            )
            members = tuple((u, self._members[u]) for u in self.units)
            elementwise(
                tx,
                probe,
                "FullyShard.init_optimizer",
                units=members,
                axes=self.axes + self.replicate_axes,
            )
        missing = sorted(set(self.units) - set(shards)) if isinstance(shards, dict) else None
        if missing is None or missing:
            raise ValueError(
                "`shards` must be the dict {unit: shard} from `fs.shard(params, mesh)`"
                + (f"; it lacks units {missing}." if missing else f", got {type(shards).__name__}.")
            )
        mesh = self._mesh(mesh, "FullyShard.init_optimizer")
        state_specs = self.state_specs(tx)
        init = jax.shard_map(tx.init, mesh=mesh, in_specs=(self.specs(),), out_specs=state_specs)
        return jax.jit(init)(shards), state_specs

    def state_specs(self, tx: optax.GradientTransformation) -> Any:
        """PartitionSpecs of ``tx``'s state over the shards: moments sharded like the
        shards, scalars ``P()`` (the same name as the distributed optimizer's)."""
        specs = self.specs()
        local = {
            u: jax.ShapeDtypeStruct(
                (*self._sub[u].buffers[0].lead, self._sub[u].shard_size(0)), jnp.float32
            )
            for u in self.units
        }
        abstract = jax.eval_shape(tx.init, local)
        spec_of = {local[u].shape: specs[u] for u in self.units}
        return jax.tree.map(lambda x: spec_of.get(x.shape, P()), abstract)

    def sharded_init(
        self, tx: optax.GradientTransformation, shards: dict[str, jax.Array], **kwargs: Any
    ) -> Any:
        """The global optimizer state over ``shards`` (as the distributed optimizer's
        ``sharded_init``; :meth:`init_optimizer` without the specs)."""
        return self.init_optimizer(tx, shards, **kwargs)[0]

    def unshard(self, shards: dict[str, jax.Array], mesh: Mesh | None = None) -> PyTree:
        """Full params from global shards (outside shard_map), in fp32.

        ``mesh`` defaults to the one given to :func:`fully_shard`.
        """
        mesh = self._mesh(mesh, "FullyShard.unshard")
        leaves: list[Any] = [None] * len(self._names)

        def build(shards: dict[str, jax.Array]) -> PyTree:
            for u in self.units:
                layout = self._sub[u]
                x = shards[u].reshape(*layout.buffers[0].lead, self.num_shards, -1)
                flat = layout.gather_shards(0, jnp.moveaxis(x, -2, 0))
                tree = layout.unflatten((flat,), jnp.float32)
                for i in self._members[u]:
                    leaves[i] = tree[self._names[i]]
            return jax.tree.unflatten(self._treedef, leaves)

        out = jax.tree.map(
            lambda _: NamedSharding(mesh, P()), jax.tree.unflatten(self._treedef, list(self._names))
        )
        return convert(build, (shards,), mesh, out, key=("fsdp.unshard", self, mesh))

    # ---------------------------------------------------------------- gather
    def gather(self, shards: dict[str, jax.Array], unit: str) -> dict[str, jax.Array]:
        """All-gathers one unit (inside shard_map): ``{param name: array}`` in param_dtype.

        The backward pass reduce-scatters the gradient in ``reduce_dtype``
        (averaged over all data-parallel ranks, all-reduced over the replica axes
        under hybrid sharding) into the shard.
        """
        self._check_unit(unit, "FullyShard.gather", shards)
        flat = self._gather_flat(shards[unit], "FullyShard.gather")
        return self._sub[unit].unflatten((flat,), self.policy.param_dtype)

    def _gather_flat(self, shard: jax.Array, fn: str) -> jax.Array:
        """All-gather of a flat shard in param_dtype; its VJP reduce-scatters into it."""
        axes = bound_axes(self.axes, fn)
        rep = bound_axes(self.replicate_axes, fn) if self.replicate_axes else ()
        return gather_shard(
            shard, axes, rep, jnp.dtype(self.policy.param_dtype).name,
            jnp.dtype(self.policy.reduce_dtype).name,
        )  # fmt: skip

    def gather_layer(self, shard: jax.Array, unit: str) -> PyTree:
        """One layer of a stacked unit, gathered (inside the scanned layer body).

        Returns the layer's params shaped like the stacked group's subtree; the
        backward reduce-scatters the layer's gradient inside the backward scan.
        """
        layout = self._sub[unit]
        flat = self._gather_flat(shard, "FullyShard.gather_layer")
        # Named, so a remat policy can keep gathered layers (save_only_these_names)
        # when memory allows, instead of gathering them again in the backward.
        flat = checkpoint_name(flat, GATHERED)
        by_slot = layout.unpack_leaves([[flat]], [0], self.policy.param_dtype, rows=True)
        named = jax.tree.unflatten(layout.treedef, [by_slot[i] for i in range(len(by_slot))])
        treedef, names = self._groups[unit]
        return jax.tree.unflatten(treedef, [named[n] for n in names])

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

        def place(path: Any, x: Any) -> Any:
            name = param_name(path)
            return (
                ShardedLayers(shards[name], self, name) if name in self._layers else gathered[name]
            )

        return jax.tree_util.tree_map_with_path(
            place,
            self._template,
            is_leaf=lambda path, _: param_name(path) in self._layers,
            is_leaf_takes_path=True,
        )

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
        if self.policy.cast_forward_inputs:
            inputs = cast_floats(inputs, self.policy.param_dtype)

        def run(shard: Any, *inputs: Any) -> Any:
            full = shard if isinstance(shard, dict) else self.gather({unit: shard}, unit)
            return fn(full, *inputs)

        if self.reshard_after_forward and not isinstance(shards[unit], dict):
            # Gathered params are never a dot's output, so this policy re-gathers
            # them. jax.checkpoint's optimization barriers are JAX's documented way
            # to keep XLA from merging the backward gather into the forward one; on
            # XLA:CPU we saw the pair merged anyway (not checked on GPU here).
            run = jax.checkpoint(run, policy=self.remat_policy)
        out = run(shards[unit], *inputs)
        return cast_floats(out, self.policy.output_dtype)

    def gather_all(self, shards: dict[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
        """Every unit gathered (for accumulation without a sync per microbatch)."""
        return {u: self.gather(shards, u) for u in self.units}

    def reduce_gathered(self, grads: dict[str, dict[str, jax.Array]]) -> dict[str, jax.Array]:
        """Local gradients of gathered units -> reduced shards (one reduce-scatter each)."""
        axes = bound_axes(self.axes, "FullyShard.reduce_gathered")
        out = {}
        for u in self.units:
            layout = self._sub[u]
            (flat,) = layout.flatten(grads[u], self.policy.reduce_dtype)
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
        check_microbatches(microbatches, batch)
        from .scan_sync import call_with_views

        # A views scope: an NNX loss merges fs.view(shards) with jaxsync.merge_module.
        scoped = call_with_views(loss_fn, tuple(self._layers), "FSDP's sharded layers")
        loss_fn = _checked_loss(scoped, has_aux, self.axes)
        if microbatches == 1:
            return jax.value_and_grad(loss_fn, has_aux=has_aux)(shards, batch)
        mbs = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
        if sync_grad_accum:
            target, grad_fn = shards, jax.value_and_grad(loss_fn, has_aux=has_aux)
        else:
            # Local gradients of the gathered params (varying: no implicit psum).
            target = to_varying(self.gather_all(shards), self.axes + self.replicate_axes)
            grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

        def body(acc: Any, mb: Any) -> tuple[Any, Any]:
            loss, g = grad_fn(target, mb)
            return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g), loss

        loss0, g0 = grad_fn(target, jax.tree.map(lambda m: m[0], mbs))
        acc = jax.tree.map(lambda x: x.astype(jnp.float32), g0)
        acc, losses = jax.lax.scan(body, acc, jax.tree.map(lambda m: m[1:], mbs))
        grads = jax.tree.map(lambda a: a / microbatches, acc)
        if has_aux:
            (loss0, _), (losses, aux) = loss0, losses
        loss = (loss0 + jnp.sum(losses)) / microbatches
        if not sync_grad_accum:
            grads = self.reduce_gathered(grads)
        if has_aux:
            return (loss, jax.tree.map(lambda a: a[-1], aux)), grads
        return loss, grads


@jax.tree_util.register_pytree_node_class
class ShardedLayers:
    """A stacked FSDP unit's ``[layers, shard]`` shard as the model sees it.

    ``lax.scan`` slices it like any pytree; :func:`jaxsync.tap` on the slice
    gathers that one layer (see :meth:`FullyShard.view`).
    """

    def __init__(self, shard: Any, fs: FullyShard, unit: str):
        self.shard, self.fs, self.unit = shard, fs, unit

    def tree_flatten(self) -> tuple[tuple[Any], tuple[FullyShard, str]]:
        return (self.shard,), (self.fs, self.unit)

    @classmethod
    def tree_unflatten(cls, aux: tuple[FullyShard, str], children: Any) -> ShardedLayers:
        return cls(children[0], *aux)

    def jaxsync_gather(self) -> PyTree:
        return self.fs.gather_layer(self.shard, self.unit)

    def __getitem__(self, key: Any) -> Any:
        from .scan_sync import NOT_TAPPED

        raise TypeError(NOT_TAPPED.format(group=self.unit))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("shard", "fs", "unit"):
            raise AttributeError(name)
        from .scan_sync import NOT_TAPPED

        raise TypeError(NOT_TAPPED.format(group=self.unit))


def _checked_loss(loss_fn: Callable[..., Any], has_aux: bool, axes: Any) -> Callable[..., Any]:
    """``loss_fn`` with the checks every mode makes of its loss (not yet averaged)."""
    from .step_checks import check_loss
    from .tap_rules import check_no_gather_under_cond

    def checked(*args: Any) -> Any:
        # Traced into a jaxpr, checked, and run from it (no second trace of the loss).
        closed, shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
        check_no_gather_under_cond(closed.jaxpr, tuple(axes))
        flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        out = jax.tree.unflatten(jax.tree.structure(shape), flat)
        check_loss(out[0] if has_aux else out, tuple(axes), "fsdp", "FullyShard.value_and_grad")
        return out

    return checked


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


def _group_trees(params: PyTree, stacked: Sequence[str]) -> dict[str, tuple[Any, list[str]]]:
    """Per stacked group: the treedef of its subtree and its leaves' full names."""
    out: dict[str, tuple[Any, list[str]]] = {}

    def grab(path: Any, sub: Any) -> Any:
        name = param_name(path)
        if name in stacked:
            rel = jax.tree_util.tree_flatten_with_path(sub)[0]
            names = [f"{name}.{param_name(p)}" if p else name for p, _ in rel]
            out[name] = (jax.tree.structure(sub), names)
        return sub

    jax.tree_util.tree_map_with_path(
        grab, params, is_leaf=lambda path, _: param_name(path) in stacked, is_leaf_takes_path=True
    )
    return out


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
) -> FullyShard:
    """Splits ``params`` into fully sharded units (ZeRO-3 / FSDP2).

    Args:
      params: the model's params (arrays or ``ShapeDtypeStruct``s).
      axis_name: mesh axis (or axes) each unit is sharded over.
      units: dotted name prefixes (``"embed"``, ``"blocks.0"``...); each param
        goes to the longest prefix of its name (:func:`jaxsync.param_name`).
      mesh: the mesh the step runs on.
      policy: :class:`MixedPrecision` (default: fp32 everywhere).
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
        ``[layers, shard]``; the model reads it through :meth:`FullyShard.view`
        and :func:`jaxsync.tap`, which gathers one layer in the forward loop body
        and reduce-scatters its gradient in the backward loop body.

    Example:
      >>> fs = jaxsync.fully_shard(params, axis_name="data", mesh=mesh,
      ...                          units=["embed", "blocks.0", "blocks.1", "head"])
      >>> shards = fs.shard(params)   # on the mesh given here
      >>> # inside shard_map:  x = fs.apply(shards, "blocks.0", block_fn, x)
    """
    from .step_checks import check_float_params

    check_float_params(params, "fsdp", "jaxsync.fully_shard")
    n = mesh_axes_size(mesh, axis_name, "jaxsync.fully_shard")
    if replicate_axis is not None:
        mesh_axes_size(mesh, replicate_axis, "jaxsync.fully_shard")
    stacked = normalize_stacked(stacked)
    if isinstance(units, str):
        raise TypeError(f"`units` must be a list of name prefixes, got the string {units!r}.")
    if not units and not stacked:
        raise ValueError("`units` is empty; name at least one unit (a param-name prefix).")
    bad = [u for u in units if not isinstance(u, str)]
    dup = sorted({u for u in units if list(units).count(u) > 1})
    if bad or dup:
        raise ValueError(
            f"`units` must be distinct param-name prefixes (strings); got non-strings {bad}"
            if bad
            else f"`units` must be distinct param-name prefixes; {dup} appear more than once."
        )
    if policy is not None and not isinstance(policy, MixedPrecision):
        raise TypeError(f"`policy` must be a jaxsync.MixedPrecision or None, got {policy!r}.")
    check_bool(reshard_after_forward, "reshard_after_forward")
    return FullyShard(
        params,
        axis_name=axis_name,
        units=units,
        policy=policy or MixedPrecision(),
        reshard_after_forward=reshard_after_forward,
        replicate_axis=replicate_axis,
        num_shards=n,
        remat_policy=remat_policy,
        stacked=stacked,
        mesh=mesh,
    )

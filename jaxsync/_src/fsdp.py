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

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .axes import AxisName, axes_size, bound_axes, mesh_axes_size, normalize_axes, to_varying
from .checks import check_bool, check_float_dtype, check_positive
from .elementwise import check_elementwise as elementwise
from .layout import BufferKey, Layout, build_layout
from .portable import convert, param_name

PyTree = Any


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's mixed-precision policy.

    Attributes:
      param_dtype: dtype the params are gathered in and computed with.
      reduce_dtype: dtype gradients are reduce-scattered (and all-reduced) in.
      output_dtype: cast each unit's floating outputs to this (None: leave).
      cast_forward_inputs: cast each unit's floating inputs to ``param_dtype``.
    """

    param_dtype: Any = jnp.float32
    reduce_dtype: Any = jnp.float32
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        # An integer dtype here would truncate params or gradients silently.
        check_float_dtype(self.param_dtype, "MixedPrecision.param_dtype")
        check_float_dtype(self.reduce_dtype, "MixedPrecision.reduce_dtype")
        check_float_dtype(self.output_dtype, "MixedPrecision.output_dtype", allow_none=True)
        check_bool(self.cast_forward_inputs, "MixedPrecision.cast_forward_inputs")


def _cast_floats(tree: PyTree, dtype: Any) -> PyTree:
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: (
            x.astype(dtype)
            if isinstance(x, jax.Array | jnp.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        tree,
    )


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
    ):
        self.axes = normalize_axes(axis_name)
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
        self.units = tuple(units)
        unit_of = []
        for name in names:
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
            )
        self._names = tuple(names)
        self._shapes = tuple(tuple(int(d) for d in leaf.shape) for _, leaf in leaves)
        self.num_shards = num_shards

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
        """PartitionSpecs of the shards (shard over ``axis_name``, replicated elsewhere)."""
        spec = P(self.axes if len(self.axes) > 1 else self.axes[0])
        return dict.fromkeys(self.units, spec)

    def shard(self, params: PyTree, mesh: Mesh) -> dict[str, jax.Array]:
        """Global fp32 shards of (replicated) ``params``: ``{unit: (N * shard,) array}``."""
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
                out[u] = jnp.stack([layout.shard_of(0, flat, r) for r in range(n)]).reshape(-1)
            return out

        shardings = {u: NamedSharding(mesh, s) for u, s in self.specs().items()}
        return convert(build, (params,), mesh, shardings, key=("fsdp.shard", self, mesh))

    def init_optimizer(
        self,
        tx: optax.GradientTransformation,
        shards: dict[str, jax.Array],
        mesh: Mesh,
        *,
        check_elementwise: bool = True,
    ) -> tuple[Any, Any]:
        """``tx.init`` on the shards, per device; returns (global state, its specs).

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
        specs = self.specs()
        local = {
            u: jax.ShapeDtypeStruct((self._sub[u].shard_size(0),), jnp.float32) for u in self.units
        }
        abstract = jax.eval_shape(tx.init, local)
        sizes = {s.shape for s in local.values()}
        spec = specs[self.units[0]]
        state_specs = jax.tree.map(lambda x: spec if x.shape in sizes else P(), abstract)
        init = jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs)
        return jax.jit(init)(shards), state_specs

    def unshard(self, shards: dict[str, jax.Array], mesh: Mesh) -> PyTree:
        """Full params from global shards (outside shard_map), in fp32."""
        leaves: list[Any] = [None] * len(self._names)

        def build(shards: dict[str, jax.Array]) -> PyTree:
            for u in self.units:
                layout = self._sub[u]
                flat = layout.gather_shards(0, shards[u].reshape(self.num_shards, -1))
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
        axes = bound_axes(self.axes, "FullyShard.gather")
        rep = bound_axes(self.replicate_axes, "FullyShard.gather") if self.replicate_axes else ()
        layout = self._sub[unit]
        flat = _gather(
            shards[unit],
            axes,
            rep,
            jnp.dtype(self.policy.param_dtype).name,
            jnp.dtype(self.policy.reduce_dtype).name,
        )
        return layout.unflatten((flat,), self.policy.param_dtype)

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
            inputs = _cast_floats(inputs, self.policy.param_dtype)

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
        return _cast_floats(out, self.policy.output_dtype)

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
            out[u] = _reduce(flat, axes, self.replicate_axes)
        return out

    def value_and_grad(
        self,
        loss_fn: Callable[..., Any],
        shards: dict[str, jax.Array],
        batch: Any,
        *,
        microbatches: int = 1,
        sync_grad_accum: bool = True,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean local loss and reduced shard gradients of ``loss_fn(shards, batch)``.

        With ``microbatches > 1`` the batch's leading axis is split and gradients
        accumulated in fp32. ``sync_grad_accum=True`` reduce-scatters after every
        microbatch (memory stays at one shard of gradients);
        ``False`` gathers all units once, accumulates full local gradients and
        reduce-scatters once (less communication, more memory).
        """
        check_microbatches(microbatches, batch)
        if microbatches == 1:
            return jax.value_and_grad(loss_fn)(shards, batch)
        mbs = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
        if sync_grad_accum:
            target, grad_fn = shards, jax.value_and_grad(loss_fn)
        else:
            # Local gradients of the gathered params (varying: no implicit psum).
            target = to_varying(self.gather_all(shards), self.axes + self.replicate_axes)
            grad_fn = jax.value_and_grad(loss_fn)

        def body(acc: Any, mb: Any) -> tuple[Any, Any]:
            loss, g = grad_fn(target, mb)
            return jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g), loss

        loss0, g0 = grad_fn(target, jax.tree.map(lambda m: m[0], mbs))
        acc = jax.tree.map(lambda x: x.astype(jnp.float32), g0)
        acc, losses = jax.lax.scan(body, acc, jax.tree.map(lambda m: m[1:], mbs))
        grads = jax.tree.map(lambda a: a / microbatches, acc)
        loss = (loss0 + jnp.sum(losses)) / microbatches
        if not sync_grad_accum:
            grads = self.reduce_gathered(grads)
        return loss, grads


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


def _reduce(flat: jax.Array, axes: tuple[str, ...], replicate: tuple[str, ...]) -> jax.Array:
    out = jax.lax.psum_scatter(flat, axes, scatter_dimension=0, tiled=True)
    if replicate:
        out = jax.lax.psum(out, replicate)
    return out * (1.0 / axes_size(axes + replicate))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(shard: jax.Array, axes, replicate, param_dtype: str, reduce_dtype: str) -> jax.Array:
    # Gathered as device-varying (over the replica axes too): typed replicated,
    # JAX would psum its cotangent before our backward ever saw it (the implicit
    # all-reduce), and the replica all-reduce would happen twice.
    full = jax.lax.all_gather(shard.astype(param_dtype), axes, axis=0, tiled=True)
    return to_varying(full, replicate) if replicate else full


def _gather_fwd(shard, axes, replicate, param_dtype, reduce_dtype):
    # The residual only carries the shard's dtype (an empty array of it).
    return _gather(shard, axes, replicate, param_dtype, reduce_dtype), jnp.zeros((0,), shard.dtype)


def _gather_bwd(axes, replicate, param_dtype, reduce_dtype, like, ct):
    return (_reduce(ct.astype(reduce_dtype), axes, replicate).astype(like.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


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
      replicate_axis: hybrid sharding: shard over ``axis_name`` inside each
        group, replicate over this axis (gradients all-reduced across it).

    Example:
      >>> fs = jaxsync.fully_shard(params, axis_name="data", mesh=mesh,
      ...                          units=["embed", "blocks.0", "blocks.1", "head"])
      >>> shards = fs.shard(params, mesh)
      >>> # inside shard_map:  x = fs.apply(shards, "blocks.0", block_fn, x)
    """
    n = mesh_axes_size(mesh, axis_name, "jaxsync.fully_shard")
    if replicate_axis is not None:
        mesh_axes_size(mesh, replicate_axis, "jaxsync.fully_shard")
    if isinstance(units, str):
        raise TypeError(f"`units` must be a list of name prefixes, got the string {units!r}.")
    if not units:
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
    )


def clip_by_global_norm(max_norm: float, *, axis_name: AxisName) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` for gradients sharded over ``axis_name``.

    The norm is summed over the shards of every rank (one scalar all-reduce),
    so every rank clips by the same, true global norm. Padding is zero and does
    not count.
    """
    axes = normalize_axes(axis_name)
    max_norm = check_positive(max_norm, "max_norm", allow_none=False)

    def init_fn(params: PyTree) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: PyTree, state: Any, params: PyTree = None) -> tuple[PyTree, Any]:
        del params
        bound_axes(axes, "jaxsync.clip_by_global_norm", allow_vmap=True)
        sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(updates))
        norm = jnp.sqrt(jax.lax.psum(sq, axes))
        keep = norm < max_norm
        updates = jax.tree.map(
            lambda g: jnp.where(keep, g, (g / norm.astype(g.dtype)) * max_norm), updates
        )
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def host_offload_supported(mesh: Mesh) -> bool:
    """Whether every device of ``mesh`` has pinned host memory (for offloading)."""
    return all(
        "pinned_host" in {m.kind for m in d.addressable_memories()}
        for d in mesh.devices.flat
        if d.process_index == jax.process_index()
    )


def _require_host_memory(mesh: Mesh) -> None:
    if not host_offload_supported(mesh):
        kinds = sorted({m.kind for m in mesh.devices.flat[0].addressable_memories()})
        raise ValueError(
            f"host offload needs 'pinned_host' memory, but {mesh.devices.flat[0].platform} "
            f"devices offer {kinds}. Run without offload on this backend."
        )


def _shardings(mesh: Mesh, specs: PyTree, kind: str) -> PyTree:
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=kind),
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def offload(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """Moves ``tree`` (e.g. optimizer state) to pinned host memory, keeping its sharding.

    Raises:
      ValueError: the backend has no pinned host memory (not a silent no-op).
    """
    _require_host_memory(mesh)
    return jax.device_put(tree, _shardings(mesh, specs, "pinned_host"))


def with_offloaded_state(
    step: Callable[..., Any], *, mesh: Mesh, specs: PyTree, argnum: int = 1, out_index: int = 1
) -> Callable[..., Any]:
    """Jits ``step`` so that its state lives in pinned host memory between steps.

    ``step`` (typically a ``jax.shard_map``-ed function, not yet jitted) takes the
    state as argument ``argnum`` and returns it as output ``out_index``. The
    wrapped step copies the state to device memory on entry and back to the
    host on exit, inside one program, so XLA can overlap the copies with compute.
    Pass state placed with :func:`offload`.

    Raises:
      ValueError: the backend has no pinned host memory.
    """
    _require_host_memory(mesh)
    on_device = _shardings(mesh, specs, "device")
    on_host = _shardings(mesh, specs, "pinned_host")

    def wrapped(*args: Any) -> Any:
        args = list(args)
        args[argnum] = jax.device_put(args[argnum], on_device)
        out = list(step(*args))
        out[out_index] = jax.device_put(out[out_index], on_host)
        return tuple(out)

    return jax.jit(wrapped)

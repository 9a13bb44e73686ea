"""One :func:`jaxsync.train_step` step when the compiler shards the model too.

Runs on one data rank's rows inside the step's ``shard_map`` (manual over the
data axes; :mod:`two_d.plan` holds the plans and the state). The model sees its
free params as they are (FSDP: gathered where used) and each stacked group as a
:class:`DimStack`, whose taps reduce each layer's gradient in the backward scan.

Microbatches: ``ddp`` and ``zero`` reduce once per step, as on a 1-D mesh. The
first ``k - 1`` microbatches run the plain model (the taps are the identity)
and sum local gradients in fp32; the last one runs with the taps, which add
each layer's sum before that layer's reduction. That holds a local fp32
gradient the size of the params for the step, and sends ``1/k`` of the bytes.
FSDP reduces each microbatch's gradients (its point is never holding them
whole), as ``fully_shard``'s default does.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ...core.axes import to_varying, varying_axes
from ...core.cpu_order import on_cpu
from ...core.names import group_of
from ...fsdp.grad import split_microbatches
from ...optim.logged import TreeNorms
from ...program.grad_program import run_jaxpr
from ...program.grad_program import value_and_grad as program_value_and_grad
from ...sync.reduction import BUCKETED
from ...sync.tap_rules import check_taps
from ..parts import finish, loss_of, one_piece, scale_of, unscale
from ..train_state import TrainState, global_stats
from .dims import DimPlan, DimSync, gather, reduce
from .plan import SpecLayout, SpecZeroState
from .views import DimStack, DimTapSpec, defers, gather_params

PyTree = Any


def spec_body(cfg: Any, plan: Any, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
    """One 2-D step on this data rank's rows (inside the data-manual shard_map)."""

    layout: SpecLayout = plan.dims
    data, mode, k = layout.data, cfg.mode.name, cfg.microbatches
    n = jax.lax.axis_size(data)
    fsdp, scatter = mode == "fsdp", mode != "ddp"
    once = k > 1 and not fsdp
    policy = cfg.mode.policy if fsdp else None
    sync = DimSync(
        axes=data,
        reduce_dtype=jnp.dtype(
            (policy.reduce_dtype if policy is not None else getattr(cfg.mode, "reduce_dtype", None))
            or jnp.float32
        ).name,
        factor=1.0 / (n * k),
        scatter=scatter,
        compute_dtype=None if not (fsdp and policy is not None and policy.param_dtype)
        else jnp.dtype(policy.param_dtype).name,
        fsdp=fsdp,
        wide_sums=on_cpu(cfg.mesh),
    )  # fmt: skip
    loss = loss_of(cfg, plan, state, batch)
    plans = layout.leaves()
    treedef = jax.tree.structure(layout.plans, is_leaf=lambda x: isinstance(x, DimPlan))
    names = [p.name for p in plans]
    groups = {g: [i for i, nm in enumerate(names) if group_of(nm, (g,))] for g in cfg.stacked}
    in_group = {i for idx in groups.values() for i in idx}
    free = [i for i in range(len(plans)) if i not in in_group]
    leaves = treedef.flatten_up_to(state.params)
    # Per-device values (a param kept whole too): each gradient is this rank's own.
    varying = [to_varying(x, data) for x in leaves]

    if fsdp:  # its gradient leaves the gather's backward unreduced when dims.defers
        diff = {"leaves": varying}
    else:
        sinks = {g: [_sink(plans[i], varying[i], sync) for i in idx] for g, idx in groups.items()}
        diff = {"free": [varying[i] for i in free], "sinks": sinks}

    def view(diff: dict, acc: list | None) -> PyTree:
        out: list[Any] = [None] * len(plans)
        if fsdp:
            shards = [_early_cast(diff["leaves"][i], sync) for i in free]
            got = gather_params(shards, [plans[i] for i in free], sync)
            for i, x in zip(free, got, strict=True):
                out[i] = x
        else:
            for i, x in zip(free, diff["free"], strict=True):
                out[i] = x
        tree = jax.tree.unflatten(treedef, out)
        for g, idx in groups.items():
            sub = _group_subtree(layout.plans, g)
            spec = DimTapSpec(
                g, sync, tuple(plans[i].layer() for i in idx), jax.tree.structure(
                    sub, is_leaf=lambda x: isinstance(x, DimPlan))
            )  # fmt: skip
            params_g = [_early_cast(diff["leaves"][i], sync) if fsdp else varying[i] for i in idx]
            sinks_g = None if fsdp else diff["sinks"][g]
            acc_g = None if acc is None else [acc[i] for i in idx]
            stack = DimStack(jax.tree.unflatten(spec.treedef, params_g), sinks_g, acc_g, spec)
            tree = _put_group(tree, g, stack)
        return tree

    def f(diff: dict, acc: list | None, b: Any) -> Any:
        return loss(view(diff, acc), b)

    mbs, last, acc, head, heads = None, batch, None, None, None
    if k > 1:
        mbs = split_microbatches(k, batch)
        last = jax.tree.map(lambda m: m[-1], mbs)
    if once:
        acc, head, heads = _local_sum(
            loss, treedef, varying, jax.tree.map(lambda m: m[:-1], mbs), data
        )

    # Traced once, the taps checked on that jaxpr, then differentiated from it
    # (as sync_value_and_grad does on a 1-D mesh).
    closed, shape = jax.make_jaxpr(f, return_shape=True)(diff, acc, last)
    if cfg.stacked:
        check_taps(closed.jaxpr, tuple(groups), data, once)

    def traced(diff: dict, acc: list | None, b: Any) -> Any:
        return run_jaxpr(closed, shape, diff, acc, b)

    grad_fn = program_value_and_grad(traced, has_aux=True)
    if k == 1 or once:
        (out, rest), g = grad_fn(diff, acc, last)
        rest = one_piece(rest)
        if once:  # the first k - 1 microbatches' pieces, then the last's
            out = (head * (k - 1) + out) / k
            rest = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), heads, rest)
    else:  # FSDP: each microbatch reduces its own gradients

        def one(total: Any, mb: Any) -> Any:
            (o, r), gi = grad_fn(diff, None, mb)
            return jax.tree.map(jnp.add, total, gi), (o, r)

        zero = jax.tree.map(lambda x: _zeros_like_grad(x, _grad_dtype(x)), diff)
        g, (outs, rests) = jax.lax.scan(one, zero, mbs)
        out, rest = jnp.mean(outs), rests
    grads: list[Any] = [None] * len(plans)
    if fsdp:
        grads = [
            reduce(gi, p, sync, scatter=False) if defers(p, sync) else gi
            for gi, p in zip(g["leaves"], plans, strict=True)
        ]
    else:
        for i, gi in zip(free, g["free"], strict=True):
            if acc is not None:
                gi = gi.astype(jnp.float32) + acc[i]
            grads[i] = reduce(gi, plans[i], sync)
        for grp, idx in groups.items():
            for i, gi in zip(idx, g["sinks"][grp], strict=True):
                if defers(plans[i], sync):  # all-reduced once for all layers
                    gi = reduce(gi, plans[i], sync, scatter=False)
                grads[i] = gi
    dtypes = [jnp.float32 if scatter else jnp.dtype(p.dtype) for p in plans]
    grads = [x.astype(d) for x, d in zip(grads, dtypes, strict=True)]
    grads = unscale(jax.tree.unflatten(treedef, grads), scale_of(cfg, state))
    stats = _stats(jax.tree.leaves(grads), plans, data, scatter)
    # The trainer's norms: cut leaves summed over the data axes, whole ones counted once.
    cut = tuple(scatter and p.dim is not None for p in plans)
    norms = TreeNorms(axes=data, cut=cut, inner=cfg.tx if mode == "ddp" else None)
    if mode != "zero":
        return finish(cfg, plan, state, grads, grads, stats, out, rest, batch, norms=norms)
    inner_state = state._replace(params=state.opt_state.master, opt_state=state.opt_state.inner)
    new, mean = finish(cfg, plan, inner_state, grads, grads, stats, out, rest, batch, norms=norms)
    # Cast, then gather: a bf16 model's params travel in bf16, not as fp32 masters.
    params = layout.map(
        lambda p, m, old: gather(m.astype(old.dtype), p, data), new.params, state.params
    )
    return new._replace(params=params, opt_state=SpecZeroState(new.params, new.opt_state)), mean


def _local_sum(
    loss: Any, treedef: Any, params: list, mbs: Any, axes: tuple[str, ...]
) -> tuple[list, Any, Any]:
    """Each param's local gradient summed over ``mbs`` in fp32, the mean loss and every
    microbatch's aux, stacked: :func:`jaxsync.accumulate_grads` (no communication; the
    model gets plain arrays, on which :func:`jaxsync.tap` is the identity), its mean
    gradient times the count."""

    k = jax.tree.leaves(mbs)[0].shape[0]
    (out, rests), g = BUCKETED.accumulate(
        lambda ps, b: loss(jax.tree.unflatten(treedef, ps), b), params, mbs, axes, True,
        jnp.float32, None, None, all_aux=True,
    )  # fmt: skip
    return [x * k for x in g], out, rests


def _early_cast(shard: jax.Array, sync: DimSync) -> jax.Array:
    """An FSDP shard in the compute dtype before its gather tap, where the gradient is
    reduced in that dtype too: the backward scan then stacks the layers' reduced
    gradients in bf16, not fp32 (half the bytes, GSPMD's figure), and the forward
    transposes bf16 shards for its gathers. Nothing is lost: the reduction's result is
    bf16 already. With an fp32 reduction the cotangent stays fp32."""
    if sync.compute_dtype is None or sync.reduce_dtype != sync.compute_dtype:
        return shard
    return shard.astype(sync.compute_dtype)


def _zeros_like_grad(x: jax.Array, dtype: Any) -> jax.Array:
    """A gradient accumulator's zeros: typed varying over ``x``'s axes, as its gradient
    is (a scan's carry must keep one type)."""
    return to_varying(jnp.zeros(x.shape, dtype), varying_axes(x))


def _grad_dtype(x: Any) -> Any:
    return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def _sink(plan: DimPlan, x: jax.Array, sync: DimSync) -> jax.Array:
    """Zeros shaped like the stacked gradient after the reduction (local over data;
    a gradient :func:`dims.defers` is unreduced, per device)."""
    shape = list(x.shape)
    if sync.scatter and plan.dim is not None:
        shape[plan.dim] = plan.padded // jax.lax.axis_size(sync.axes)
    zeros = jnp.zeros(shape, sync.reduce_dtype)
    return to_varying(zeros, sync.axes) if sync.scatter else zeros


def _stats(grads: list, plans: list[DimPlan], data: tuple[str, ...], scatter: bool) -> Any:
    """Global squared norm and zero count: shards summed over the data axes, whole
    (all-reduced) gradients counted once; padding zeros left out."""
    cut = [g for g, p in zip(grads, plans, strict=True) if scatter and p.dim is not None]
    whole = [g for g, p in zip(grads, plans, strict=True) if not (scatter and p.dim is not None)]
    padding = sum(p.padding for p in plans if scatter and p.dim is not None)
    sq, zeros = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
    if cut:
        s, z = global_stats(cut, data, padding)
        sq, zeros = sq + s, zeros + z
    if whole:
        s, z = global_stats(whole)
        sq, zeros = sq + s, zeros + z
    return sq, zeros


def _group_subtree(tree: PyTree, group: str) -> PyTree:
    for key in group.split("."):
        tree = tree[key]
    return tree


def _put_group(tree: PyTree, group: str, value: Any) -> PyTree:
    keys = group.split(".")

    def put(node: Any, i: int) -> Any:
        node = dict(node)
        node[keys[i]] = value if i == len(keys) - 1 else put(node[keys[i]], i + 1)
        return node

    return put(tree, 0)

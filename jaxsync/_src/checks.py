"""Checks that turn silently wrong training into early, named errors.

Everything here runs at trace time (from types, shapes and the layout), except
:func:`nonfinite_report`, which reads the metrics the step recorded as data.
Each check names the argument or the param at fault, shows what was received
against what was expected, and says what to do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .axes import to_varying, varying_axes
from .finalize import SyncRules
from .layout import Layout
from .names import param_name
from .optimizer_state import DistributedOptimizerState, ShardedGrads, StepMetrics

PyTree = Any

ALREADY_REDUCED = (
    "{fn}: the gradients of {detail}: they are typed invariant (the same on every "
    "device) over those axes, while local gradients vary per device. Plain "
    "`jax.grad`/`jax.value_and_grad` inside shard_map with respect to params passed "
    "replicated (`P()`) returns such gradients: JAX's autodiff already sums them over "
    "the mesh (the transpose of the implicit `pvary` is a `psum`), so reducing them "
    "again would make those updates that many times too large. Compute local "
    "gradients with `jaxsync.value_and_grad(loss_fn, axis_name={axis_name!r}{rules})`."
)
RULES_NOT_GIVEN = (
    "{fn}: the gradient of {param} varies over {axes}, over which the param itself is "
    "replicated, and the optimizer was given no rule that reduces it there, so it would "
    "leave the step unreduced. The gradients were computed with `rules` this optimizer "
    "does not have: pass the same `rules=` to `{target}` as to `jaxsync.value_and_grad`."
)
PARAMS_SHARDED_OVER_DP = (
    "{fn}: param {param} differs across the data-parallel axes {axes} (its type varies "
    "over them), but the optimizer shards its state over those axes and needs every "
    "rank to hold the same, whole param. Pass it into shard_map with a PartitionSpec "
    "that does not name {axes} (e.g. `P()`, or `P(None, 'tensor')` for a "
    "tensor-parallel weight), or mark an expert axis with `jaxsync.ExpertParallel`."
)
LOSS_REDUCED = (
    "jaxsync.value_and_grad: the loss returned by `fun` is already reduced over {axes} "
    "(typed invariant over them: a `jax.lax.pmean`/`psum` inside the loss function). "
    "Its gradients are then divided by the number of ranks once in the loss and again "
    "by the sync, which averages the local gradients. Return this device's local "
    "loss from `fun` and `jax.lax.pmean(loss, {axis_name!r})` it outside, for logging."
)
STATE_MISMATCH = (
    "{fn}: `state` does not match the layout of these params: {detail}. Was the state "
    "built with another `bucket_size`, other `param_specs`, another mesh or another "
    "inner optimizer? Build it with this optimizer's `tx.sharded_init(params, mesh)` "
    "(or `tx.init` inside the same shard_map)."
)
NOT_SYNC_RULES = (
    "`rules` must be a jaxsync.SyncRules or None, got a {kind}. Build it with "
    "`jaxsync.SyncRules.of({{pattern: rule, ...}})`."
)


def _names(slots: Sequence[int], layout: Layout, limit: int = 4) -> str:
    names = [layout.slots[i].path for i in slots]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _reduced_axes(key: Any) -> tuple[str, ...]:
    return tuple(key.axes) + tuple(a for a, _ in key.sum_axes) + tuple(key.mean_axes)


def check_local_grads(
    grads: PyTree, layout: Layout, fn: str, *, axis_name: Any = None, rules: Any = None
) -> None:
    """Rejects gradients that are already reduced over an axis jaxsync reduces over.

    Local gradients (from :func:`jaxsync.value_and_grad`) are typed device-varying
    over every axis of their buffer's reduction: the data-parallel axes of that
    buffer (expert params: fewer) and the axes of its finalize rules.
    """
    leaves = jax.tree.leaves(grads)
    bad: dict[tuple[str, ...], list[int]] = {}
    for i, (slot, g) in enumerate(zip(layout.slots, leaves, strict=True)):
        key = layout.buffers[slot.buffer].key
        missing = tuple(a for a in _reduced_axes(key) if a not in varying_axes(g))
        if missing:
            bad.setdefault(missing, []).append(i)
    if not bad:
        return
    mesh = dict(jax.sharding.get_abstract_mesh().shape)
    detail = " and of ".join(
        f"{_names(slots, layout)} are already reduced over {list(axes)} "
        f"({math.prod(mesh.get(a, 1) for a in axes)}x)"
        for axes, slots in bad.items()
    )
    keys = [layout.buffers[s.buffer].key for s in layout.slots]
    uses_rules = rules is not None or any(k.sum_axes or k.mean_axes for k in keys)
    raise TypeError(
        ALREADY_REDUCED.format(
            fn=fn,
            detail=detail,
            axis_name=axis_name if axis_name is not None else keys[0].axes,
            rules=", rules=rules" if uses_rules else "",
        )
    )


def check_grads_match_rules(grads: PyTree, params: PyTree, layout: Layout, fn: str) -> None:
    """Rejects gradients varying over an axis that neither the param nor its
    reduction covers: computed with rules the optimizer was not given."""
    for slot, g, p in zip(
        layout.slots, jax.tree.leaves(grads), jax.tree.leaves(params), strict=True
    ):
        key = layout.buffers[slot.buffer].key
        extra = varying_axes(g) - varying_axes(p) - set(_reduced_axes(key)) - set(key.varying)
        if extra:
            raise TypeError(
                RULES_NOT_GIVEN.format(
                    fn=fn,
                    param=slot.path,
                    axes=sorted(extra),
                    target="jaxsync.distributed_optimizer",
                )
            )


def check_params_replicated(params: PyTree, layout: Layout, fn: str) -> None:
    """Params must be the same on every rank of the axes their buffer is sharded over."""
    for slot, p in zip(layout.slots, jax.tree.leaves(params), strict=True):
        key = layout.buffers[slot.buffer].key
        over = sorted(set(key.axes) & varying_axes(p))
        if over:
            raise TypeError(PARAMS_SHARDED_OVER_DP.format(fn=fn, param=slot.path, axes=over))


def check_local_loss(out: Any, axes: tuple[str, ...], has_aux: bool, axis_name: Any) -> None:
    """The loss :func:`jaxsync.value_and_grad` returns must vary over the data axes."""
    loss = out[0] if has_aux else out
    reduced = [a for a in axes if a not in varying_axes(loss)]
    if reduced:
        raise TypeError(LOSS_REDUCED.format(axes=reduced, axis_name=axis_name))


def check_state(state: Any, layout: Layout, expected: Any, fn: str) -> None:
    """Compares the optimizer state with the one ``layout`` gives (shapes and trees).

    Args:
      state: what the user passed.
      layout: the layout of the params passed with it.
      expected: ``jax.eval_shape`` of the state this layout gives.
      fn: names the caller in the message.
    """
    if not isinstance(state, DistributedOptimizerState):
        raise TypeError(
            f"{fn}: `state` must be the DistributedOptimizerState from this optimizer's "
            f"`init`/`sharded_init`, got {type(state).__name__}."
        )

    def fail(detail: str) -> None:
        raise ValueError(STATE_MISMATCH.format(fn=fn, detail=detail))

    if len(state.master) != len(expected.master):
        fail(
            f"state.master has {len(state.master)} buffers, the layout has "
            f"{len(expected.master)} ({', '.join(_key_text(b.key) for b in layout.buffers)})"
        )
    for bi, (m, e) in enumerate(zip(state.master, expected.master, strict=True)):
        if tuple(np.shape(m)) != e.shape:
            fail(
                f"state.master[{bi}] has {int(np.prod(np.shape(m)))} elements per rank, the "
                f"layout for these params and bucket_size={layout.bucket_size} has "
                f"{e.shape[0]} ({_key_text(layout.buffers[bi].key)})"
            )
    if len(state.inner_state) != len(expected.inner_state):
        fail(
            f"state.inner_state has {len(state.inner_state)} buffers, the layout has "
            f"{len(expected.inner_state)}"
        )
    for bi, (s, e) in enumerate(zip(state.inner_state, expected.inner_state, strict=True)):
        got, want = jax.tree.structure(s), jax.tree.structure(e)
        if got != want:
            fail(
                f"state.inner_state[{bi}] has structure {got}, but the inner optimizer makes {want}"
            )
        for (path, a), b in zip(
            jax.tree_util.tree_flatten_with_path(s)[0], jax.tree.leaves(e), strict=True
        ):
            if tuple(np.shape(a)) != b.shape:
                fail(
                    f"state.inner_state[{bi}]{jax.tree_util.keystr(path)} has shape "
                    f"{tuple(np.shape(a))}, expected {b.shape}"
                )
    for name, a, b in zip(state.metrics._fields, state.metrics, expected.metrics, strict=True):
        if tuple(np.shape(a)) != b.shape:
            fail(f"state.metrics.{name} has shape {tuple(np.shape(a))}, expected {b.shape}")


def _key_text(key: Any) -> str:
    parts = [key.dtype, f"axes={key.axes}"]
    if key.label is not None:
        parts.append(f"label={key.label!r}")
    return " ".join(parts)


# ----------------------------------------------------------- argument checks
def check_rules(rules: Any) -> None:
    if rules is not None and not isinstance(rules, SyncRules):
        raise TypeError(NOT_SYNC_RULES.format(kind=type(rules).__name__))


def check_positive(value: Any, name: str, *, allow_none: bool = True) -> float | None:
    """A finite, positive real number (not a bool, not a string)."""
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if not ok or not math.isfinite(float(value)) or not float(value) > 0:
        allowed = "a finite positive number" + (" or None" if allow_none else "")
        raise ValueError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")
    return float(value)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"`{name}` must be True or False, got {value!r}.")
    return bool(value)


def check_float_dtype(dtype: Any, name: str, *, allow_none: bool = False) -> None:
    """Reductions and master weights in an integer dtype would truncate silently."""
    if dtype is None and allow_none:
        return
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"`{name}` must be a floating dtype, got {dtype!r}.") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"`{name}` must be a floating dtype (float32, bfloat16, ...), got {dt.name}: "
            "gradients reduced or stored in it would be truncated."
            + (" Pass None to keep the gradients' dtype." if allow_none else "")
        )


def check_param_leaves(params: PyTree, fn: str) -> None:
    """Global params must be arrays or ShapeDtypeStructs (shapes and dtypes are read)."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(
                f"{fn}: param {jax.tree_util.keystr(path)} is a {type(x).__name__} ({x!r}), "
                "not an array: the optimizer lays out arrays by shape and dtype. Make it "
                f"one, e.g. `jnp.asarray({x!r}, jnp.float32)`."
            )


def check_param_specs(params: PyTree, specs: PyTree, mesh: Any) -> None:
    """``param_specs``: one PartitionSpec per param, naming mesh axes, dividing shapes."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    want = jax.tree.structure(params)
    got = jax.tree.structure(specs, is_leaf=is_spec)
    if want != got:
        raise ValueError(
            "`param_specs` must have the structure of the params, one PartitionSpec per "
            f"param.\n  params:      {want}\n  param_specs: {got}"
        )
    names = dict(mesh.shape)
    for (path, x), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(specs, is_leaf=is_spec),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        if not isinstance(spec, P):
            raise TypeError(
                f"`param_specs` for param {name} must be a PartitionSpec, got {spec!r}."
            )
        shape = tuple(np.shape(x))
        if len(spec) > len(shape):
            raise ValueError(
                f"`param_specs` for param {name} is {spec}, which names {len(spec)} dimensions; "
                f"the param has shape {shape}."
            )
        for dim, entry in enumerate(spec):
            if entry is None:
                continue
            axes = (entry,) if isinstance(entry, str) else tuple(entry)
            unknown = [a for a in axes if a not in names]
            if unknown:
                raise ValueError(
                    f"`param_specs` for param {name} is {spec}: {unknown} is not an axis of "
                    f"the mesh, which has axes {tuple(names)} with sizes {tuple(names.values())}."
                )
            n = math.prod(names[a] for a in axes)
            if shape[dim] % n:
                raise ValueError(
                    f"`param_specs` for param {name} is {spec}: dimension {dim} of shape {shape} "
                    f"({shape[dim]}) is not divisible by the {n} devices of mesh axes {axes}."
                )


# ------------------------------------------------------- skipped-step metrics
def next_metrics(
    prev: Any,
    grads: PyTree,
    finite: jax.Array,
    grad_norm: jax.Array,
    num_zeros: jax.Array,
    unit_flags: jax.Array | None = None,
) -> Any:
    """The step's :class:`~jaxsync.StepMetrics`, with no host sync.

    On the first step of a run of skipped steps it records which params had
    non-finite *local* gradients and on which devices: a ``psum`` and a ``pmin`` of
    one int per param over the mesh (run every step, kept only then).
    With ``unit_flags`` (``[units per device, params]``, deterministic mode) it
    counts and names *units* instead of devices, so the metrics do not depend
    on the data-parallel size either.
    """
    skipped = jnp.logical_not(finite)
    record = skipped & (prev.consecutive_skips == 0)
    # One small reduction per leaf, computed where the grads are made; the
    # conditional then holds only these flags, not the grads (holding the grads
    # for it kept them all alive to the end of the step: +40% temporaries).
    if unit_flags is not None:
        flags = unit_flags.astype(jnp.int32)
    elif isinstance(grads, ShardedGrads):
        flags = grads.nonfinite.astype(jnp.int32)  # recorded before the in-loop reduction
    else:
        flags = jnp.stack(
            [jnp.logical_not(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads)]
        ).astype(jnp.int32)

    def locate(flags: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The manual axes: on a 2-D step the compiler's axes hold no per-device flags.
        mesh = jax.sharding.get_abstract_mesh()
        mesh_axes = tuple(a for a in mesh.axis_names if a in mesh.manual_axes)
        flags = to_varying(flags, mesh_axes)
        device = jax.lax.axis_index(mesh_axes)
        if unit_flags is not None:  # global unit index of each row, then per param
            k = flags.shape[0]
            unit = (device * k + jnp.arange(k, dtype=jnp.int32))[:, None]
            none = jnp.iinfo(jnp.int32).max
            count = jax.lax.psum(jnp.sum(flags, axis=0), mesh_axes)
            first = jax.lax.pmin(jnp.min(jnp.where(flags > 0, unit, none), axis=0), mesh_axes)
            return count, jnp.where(count > 0, first, -1).astype(jnp.int32)
        count = jax.lax.psum(flags, mesh_axes)
        none = jnp.iinfo(jnp.int32).max
        first = jax.lax.pmin(jnp.where(flags > 0, device, none), mesh_axes)
        return count, jnp.where(count > 0, first, -1).astype(jnp.int32)

    # Run every step and selected, not under a `lax.cond`: XLA:CPU runs a conditional
    # concurrently with the collectives it does not depend on (the params' all-gather),
    # so devices could enter its psum and another collective in different orders and
    # deadlock (seen with whole-matrix owners, whose switch makes ranks finish apart).
    # Two all-reduces of one int per param: no measurable cost.
    count, first = locate(flags)
    count = jnp.where(record, count, prev.nonfinite_devices)
    first = jnp.where(record, first, prev.first_nonfinite_device)
    return StepMetrics(
        grad_norm=grad_norm,
        num_zeros=num_zeros,
        skipped=skipped,
        skipped_steps=prev.skipped_steps + skipped.astype(jnp.int32),
        consecutive_skips=jnp.where(finite, 0, prev.consecutive_skips + 1).astype(jnp.int32),
        nonfinite_devices=count,
        first_nonfinite_device=first,
    )


def nonfinite_report(state: Any, params: PyTree, mesh: Any = None) -> str:
    """A message about skipped steps and the params and devices at fault ("" if none).

    Runs on the host, from the metrics the step recorded (see
    :class:`jaxsync.StepMetrics`); call it every few hundred steps or when
    ``metrics.skipped`` is set.

    Args:
      state: a :class:`jaxsync.DistributedOptimizerState` (or its ``metrics``).
      params: the params pytree (for names; arrays or ShapeDtypeStructs).
      mesh: the step's mesh, to name each device by its mesh coordinates.

    Example:
      >>> if msg := jaxsync.nonfinite_report(opt_state, params, mesh):
      ...     print(msg)
    """
    metrics = getattr(state, "metrics", state)
    m = jax.device_get(metrics)
    if int(m.skipped_steps) == 0:
        return ""
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    count = np.asarray(m.nonfinite_devices).ravel()
    first = np.asarray(m.first_nonfinite_device).ravel()
    if count.size != len(names):
        raise ValueError(
            f"`params` has {len(names)} leaves, but the metrics were recorded for "
            f"{count.size} params; pass the params the optimizer was built for."
        )

    def where(d: int) -> str:
        if mesh is None:
            return f"device {d}"
        coords = np.unravel_index(d, mesh.devices.shape)
        at = ", ".join(f"{a}={int(c)}" for a, c in zip(mesh.axis_names, coords, strict=True))
        return f"device {d} ({at})"

    run = int(m.consecutive_skips)
    lines = [
        f"the optimizer skipped {int(m.skipped_steps)} step(s) for non-finite gradients"
        + (f"; the last {run} step(s) in a row" if run else "; the last step was applied")
        + "."
    ]
    bad = [i for i in range(len(names)) if count[i] > 0]
    lines.append(
        "On the first step of the latest run of skipped steps, local gradients held NaN/Inf:"
        if bad
        else "On the first step of the latest run of skipped steps, every device's local "
        "gradients were finite: the overflow came from the reduction (an fp16/bf16 "
        "`reduce_dtype`?) or from the loss scale."
    )
    lines += [
        f"  {names[i]} on {int(count[i])} device(s), first on {where(int(first[i]))}"
        for i in bad[:20]
    ]
    if len(bad) > 20:
        lines.append(f"  ... and {len(bad) - 20} more params")
    if bad:
        lines.append(
            "Lower the learning rate, use loss scaling for fp16, or check the data those "
            "devices were fed."
        )
    return "\n".join(lines)


# ------------------------------------------------------ distributed optimizer
def check_optimizer_args(
    clip_grad_norm: Any, reduce_dtype: Any, check_elementwise: Any, rules: Any
) -> float | None:
    """Arguments of :func:`jaxsync.distributed_optimizer`; returns ``clip_grad_norm``."""
    check_rules(rules)
    check_float_dtype(reduce_dtype, "reduce_dtype")
    check_bool(check_elementwise, "check_elementwise")
    return check_positive(clip_grad_norm, "clip_grad_norm")


def check_update(
    grads: PyTree | None, state: Any, params: PyTree, layout: Layout, plan: Any, fn: str
) -> None:
    """Trace-time checks of the distributed optimizer's ``init`` (grads and state
    None) and ``update``: params replicated over their buffer's data axes, grads
    local and reduced by the rules this optimizer has, the state built for this
    layout."""
    check_params_replicated(params, layout, fn)
    if grads is None:
        return
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    expected = jax.eval_shape(lambda p: plan.init_for_rank(p, layout, lambda _: 0), local)
    check_state(state, layout, expected, fn)
    from .deterministic import UnitGrads  # a cycle at import time

    if isinstance(grads, ShardedGrads | UnitGrads):
        # ShardedGrads: reduced inside the step by value_and_grad(sync=tx), shapes
        # checked there; UnitGrads: checked by the deterministic update.
        return
    layout.check_tree(grads, "grads")
    check_local_grads(
        grads,
        layout,
        fn,
        axis_name=plan.axes if len(plan.axes) > 1 else plan.axes[0],
        rules=plan.rules,
    )
    check_grads_match_rules(grads, params, layout, fn)


def check_labels(params: PyTree, labels: PyTree, inner: Any) -> None:
    """``labels``: one label string per param, each a key of ``inner``."""
    is_none = lambda x: x is None  # noqa: E731
    want = jax.tree.structure(params)
    got = jax.tree.structure(labels, is_leaf=is_none)
    if want != got:
        raise ValueError(
            "`labels` must have the structure of the params (one label string per "
            f"param).\n  params: {want}\n  labels: {got}"
        )
    names = set()
    for (path, _), lab in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(labels, is_leaf=is_none),
        strict=True,
    ):
        if not isinstance(lab, str):
            raise TypeError(
                f"the label of param {jax.tree_util.keystr(path)} is {lab!r}; every param "
                f"needs a label string, one of the keys of `inner`: {sorted(inner)}."
            )
        names.add(lab)
    missing = sorted(names - set(inner))
    if missing:
        raise ValueError(
            f"`labels` uses {missing}, which `inner` has no transformation for; "
            f"`inner` has keys {sorted(inner)}."
        )

"""Checks of what the distributed optimizer is given: its arguments, grads and state.

A state from another optimizer or layout, or gradients already reduced, would train
silently wrong; these raise at trace time instead, naming the param or the buffer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ..core.introspect import multi_steps_of
from ..core.validate import check_bool, check_float_dtype, check_positive
from ..deterministic.units import UnitGrads
from ..layout.layout import Layout
from ..sync.checks import (
    check_grads_match_rules,
    check_local_grads,
    check_params_replicated,
    check_rules,
)
from ..sync.scan_sync import ShardedGrads
from .state import DistributedOptimizerState

PyTree = Any


STATE_MISMATCH = (
    "{fn}: `state` does not match the layout of these params: {detail}. Was the state "
    "built with another `bucket_size`, other `param_specs`, another mesh or another "
    "inner optimizer? Build it with this optimizer's `tx.sharded_init(params, mesh)` "
    "(or `tx.init` inside the same shard_map)."
)
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
        if (a is None) != (b is None):  # the optional metrics (optim.logged)
            fail(f"state.metrics.{name} is {'None' if a is None else 'set'}, expected "
                 f"{'None' if b is None else 'an array'}: the step's `metrics=` differs")
        elif a is not None and tuple(np.shape(a)) != b.shape:
            fail(f"state.metrics.{name} has shape {tuple(np.shape(a))}, expected {b.shape}")


def _key_text(key: Any) -> str:
    parts = [key.dtype, f"axes={key.axes}"]
    if key.label is not None:
        parts.append(f"label={key.label!r}")
    return " ".join(parts)


# ------------------------------------------------------ distributed optimizer
MULTI_STEPS_CLIP = (
    "jaxsync.distributed_optimizer: `inner` holds optax.MultiSteps and `clip_grad_norm` is "
    "given: the optimizer clips each call's reduced gradient, one microbatch's, before "
    "MultiSteps accumulates it, which is not what optax.MultiSteps(optax.chain("
    "optax.clip_by_global_norm(c), opt), k) trains (the clip of the accumulated mean). "
    "Drop MultiSteps: accumulate in the step with `jaxsync.accumulate_grads(loss_fn, "
    "params, microbatches, axis_name=...)` (each device's rows as [k, rows / k, ...]) and "
    "pass `inner=opt, clip_grad_norm=c`; with `jaxsync.train_step`, `microbatches=k`."
)


def check_multi_steps_clip(inner: Any, clip_grad_norm: Any) -> None:
    """``clip_grad_norm`` beside an ``optax.MultiSteps`` would clip every microbatch."""
    txs = inner.values() if isinstance(inner, Mapping) else (inner,)
    if clip_grad_norm is not None and any(multi_steps_of(t) is not None for t in txs):
        raise ValueError(MULTI_STEPS_CLIP)


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


def check_sharded_grads(grads: ShardedGrads, layout: Layout) -> tuple[jax.Array, ...]:
    """The shards of ``grads``, after checking they fit ``layout``'s buffers."""
    expected = [(*b.lead, layout.shard_size(i)) for i, b in enumerate(layout.buffers)]
    got = [tuple(s.shape) for s in grads.shards]
    if got != expected:
        raise ValueError(
            f"`grads` are ShardedGrads with shard shapes {got}, but this optimizer's layout "
            f"for these params has {expected}. Compute them with "
            "`jaxsync.value_and_grad(..., sync=tx)` using this same `tx` and params."
        )
    return grads.shards

"""Checks of the gradients handed to a sync: local, matching the rules, from a local loss.

Everything here runs at trace time, from types, shapes and the layout. Each check
names the argument or the param at fault, shows what was received against what was
expected, and says what to do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax

from ..core.axes import varying_axes
from ..layout.layout import Layout
from .finalize import SyncRules

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




# ----------------------------------------------------------- argument checks
def check_rules(rules: Any) -> None:
    if rules is not None and not isinstance(rules, SyncRules):
        raise TypeError(NOT_SYNC_RULES.format(kind=type(rules).__name__))



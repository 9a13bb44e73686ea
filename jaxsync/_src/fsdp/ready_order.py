"""The order a unit's gradients become ready in, read off the traced loss.

FSDP's backward reduces a stacked layer's gradient in two halves, one packed and
reduce-scattered while the other is still being computed (:func:`.gather.halves`).
That overlap needs the first half to hold the gradients the backward finishes
first. In the layout's order it rarely does: a Llama block's leaves sort as
``attn_norm, mlp_norm, w_down, ...``, and ``attn_norm``'s gradient is the block's
last, so the first half waited for the whole block and its reduce-scatter ran
exposed (8 x H100, a Gemma-2B-like model with a 256k vocabulary: 842 us of each
layer's 880).

A param's gradient is complete when the backward of its *first* use in the
forward is done, and the backward runs the forward in reverse; so the pieces
ready first are those the forward first uses last. :func:`ready_orders` reads
those uses from the loss's jaxpr, before it is differentiated, and
:func:`reduction_orders` hands them to the gather's backward for the trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from typing import Any

from jax.extend import core as jcore

from ..core.scoped import scoped
from ..sync.tap_rules import FSDP_GATHER, custom_name, subjaxprs

#: Ops that only re-type, re-shape or name a value: a use through them is not yet a use.
_PASS = frozenset(
    {"name", "reshape", "convert_element_type", "squeeze", "expand_dims", "slice",
     "copy", "copy_p", "pvary", "transpose"}
)  # fmt: skip

Order = tuple[int, ...]
_ORDERS: contextvars.ContextVar[Mapping[Order, Order] | None] = contextvars.ContextVar(
    "jaxsync_fsdp_ready_orders", default=None
)


def ready_orders(jaxpr: Any) -> dict[Order, Order]:
    """``{sizes of a gather's outputs: their indices, first ready first}`` for every
    unit gather in ``jaxpr`` and the programs it calls (ties keep the layout's
    order). Gathers of the same sizes read in different orders are left out: their
    backward keeps the layout's order."""
    found: dict[Order, Order] = {}
    clash: set[Order] = set()
    for eqns, k in _gathers(jaxpr):
        e = eqns[k]
        sizes = tuple(math.prod(v.aval.shape) for v in e.outvars)
        firsts = [_first_use(eqns, k + 1, v) for v in e.outvars]
        # Used last in the forward: differentiated first. Unused: zero, ready at once.
        order = tuple(sorted(range(len(firsts)), key=lambda i: _desc(firsts[i])))
        if found.get(sizes, order) != order:
            clash.add(sizes)
        found[sizes] = order
    return {s: o for s, o in found.items() if s not in clash}


def reduction_orders(orders: Mapping[Order, Order]) -> contextlib.AbstractContextManager[None]:
    """While differentiating: the gathers' backward reads :func:`order_of` from ``orders``."""
    return scoped(_ORDERS, orders)


def order_of(sizes: Order) -> Order | None:
    """The ready order of a gather with outputs of ``sizes`` (None: unknown)."""
    return (_ORDERS.get() or {}).get(tuple(sizes))


def _gathers(jaxpr: Any) -> Iterator[tuple[list, int]]:
    for k, e in enumerate(jaxpr.eqns):
        if custom_name(e) == FSDP_GATHER and e.outvars:
            yield jaxpr.eqns, k
            continue
        for sub in subjaxprs(e):
            yield from _gathers(sub)


def _first_use(eqns: list, start: int, var: Any) -> tuple[float, ...]:
    """Where ``var`` is first read, from ``eqns[start]`` on, by an op that is not
    :data:`_PASS`: its equation's index, and inside a called program that
    program's own position; ``(inf,)`` when nothing reads it."""
    seen = {var}
    for j in range(start, len(eqns)):
        e = eqns[j]
        hit = [i for i, v in enumerate(e.invars) if isinstance(v, jcore.Var) and v in seen]
        if not hit:
            continue
        if e.primitive.name in _PASS:
            seen.update(e.outvars)
            continue
        subs = list(subjaxprs(e))
        if len(subs) == 1 and len(subs[0].invars) == len(e.invars):
            inner = min(_first_use(subs[0].eqns, 0, subs[0].invars[i]) for i in hit)
            return (j, *inner)
        return (j,)
    return (math.inf,)


def _desc(pos: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(-x for x in pos)

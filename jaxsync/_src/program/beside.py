"""Reductions ready before the backward loop run beside its first layer.

A gradient made before the backward loop, the LM head's, is reduced where XLA's
scheduler puts it: after the loop, beside the last layer's reduction, where nothing
is left to hide it behind. Across hosts (where :mod:`ready` ties only the head's
matmul to the loop, since its reduction before the loop ran exposed) that keeps the
bf16 gradient live across the whole loop and leaves its reduce-scatter exposed at
the end: 64 x H100, ``bench_gpu``'s Llama-style 7.2B under FSDP, 250 MiB held at the
loop's peak and 3.5 ms exposed.

Once :mod:`grad_rows` has peeled the backward's first layer out of the loop, that
layer is a place for them: no reduction of the loop's runs there yet. The chains
that :func:`ready_reductions` finds (each reduction over the loop's axes that does
not wait for the loop, and what packs its input after the loop) move before the
loop, and the rewritten loop starts only once they are reduced, so they run beside
its first layer.
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jcore

from ..core.axes import normalize_axes
from .reach import downstream, upstream

#: Collectives that reduce a gradient.
REDUCTIONS = {"reduce_scatter", "psum", "all_to_all"}
#: Ops XLA fuses into their reader, so their operand is what waits.
_FUSED = {"pad", "reshape", "convert_element_type", "transpose", "broadcast_in_dim",
          "squeeze", "expand_dims"}  # fmt: skip


def ready_reductions(jaxpr: Any, at: int, axes: set, room: int) -> tuple[list, list]:
    """Of what follows ``jaxpr``'s backward loop (its equation ``at``): the equations
    to run before it, in order, and the reduced values the loop's first layer is to
    wait for.

    A reduction is taken with the chain that packs its input (the equations after the
    loop it is computed from) when it runs over ``axes`` alone, does not wait for the
    loop, and no equation of its chain has an effect to keep in order; and when its
    chain makes no value larger than what the loop holds for it: ``room`` bytes (what
    each layer of the loop holds for its own reduction) and the chain's inputs, which
    the loop no longer holds once the chain has run.
    """
    eqns = jaxpr.eqns[at + 1 :]
    late = downstream(eqns, jaxpr.eqns[at].outvars)
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    args = {*jaxpr.invars, *jaxpr.constvars}
    moved: set = set()
    tied: list = []
    for e in eqns:
        if e.primitive.name not in REDUCTIONS or not set(collective_axes(e)) <= axes:
            continue
        if any(v in late for v in e.outvars):
            continue
        feeds = upstream(made, e.invars)
        chain = [f for f in eqns if f is e or any(v in feeds for v in f.outvars)]
        if any(f.effects and any(type(x).__name__ != "NamedAxisEffect" for x in f.effects)
               for f in chain):  # fmt: skip
            continue
        outs = {v for f in chain for v in f.outvars}
        inputs = {v for f in chain for v in f.invars if isinstance(v, jcore.Var)} - outs
        held = sum(_held(v, made, args) for v in inputs)
        if max(_nbytes(v.aval) for v in outs) > room + held:
            continue
        moved |= {id(f) for f in chain}
        tied.extend(e.outvars)
    return [e for e in eqns if id(e) in moved], tied


def _held(v: Any, made: dict, args: set) -> int:
    """The bytes value ``v`` holds while it waits: none for an argument (held anyway),
    the narrowest value on its way from a layout change, type change or pad (XLA fuses
    them into their reader: a small gradient padded into a unit's pack is held small)."""
    held = _nbytes(v.aval)
    while v in made and made[v].primitive.name in _FUSED:
        v = made[v].invars[0]
        if not isinstance(v, jcore.Var):
            return 0
        held = min(held, _nbytes(v.aval))
    return 0 if v in args else held


def collective_axes(e: Any) -> tuple:
    """The mesh axes collective ``e`` runs over (its ``axes`` or ``axis_name``)."""
    return tuple(normalize_axes(e.params.get("axes", e.params.get("axis_name", ()))))


def _nbytes(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ())) * aval.dtype.itemsize

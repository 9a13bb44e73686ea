"""Gradients ready before the backward layer loop are computed before it.

The LM head's weight gradient needs only the logits' cotangent and the last hidden
state, both ready before the backward loop runs; so does a final norm's. XLA's
scheduler is free to compute them anywhere, and it places them late, next to what
reads them (the reduction after the loop), which keeps their inputs live across the
whole loop: the logits' cotangent ``bf16[4,2048,32000]`` (500 MiB on the Llama-style
1.1B model of ``bench_gpu``, 4 x 2048 tokens per GPU) where the gradient itself is a
quarter of that. :func:`ready_first` ties each such gradient to the loop's input
with an ``optimization_barrier``, so the loop cannot start before it is computed;
its inputs then die before the loop. Only a gradient made by a matmul whose inputs
(those not already held as the program's arguments) are larger than it is tied: one
that would hold more than it frees is left where XLA puts it. No value changes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.extend import core as jcore

from .axes import aval_varying_axes
from .jaxpr_compat import scan_num_consts
from .sink import RETYPES

_SCAN = jcore.primitives.scan_p
#: Ops a gradient may pass through between its matmul and the program's output: the
#: conversions a broadcast may pass through (:data:`sink.RETYPES`) and layout changes.
_RESHAPES = RETYPES | {"transpose", "reshape", "squeeze", "expand_dims"}


def ready_first(closed: Any) -> Any:
    """``closed`` (a differentiated program's ``ClosedJaxpr``) with the gradients that
    are ready before its first backward loop (a reverse scan in its own jaxpr) tied to
    that loop's input; ``closed`` itself where there is nothing to tie, or where an
    equation has an effect other than naming a mesh axis (their order is kept)."""
    jaxpr = closed.jaxpr
    if any(type(f).__name__ != "NamedAxisEffect" for e in jaxpr.eqns for f in e.effects):
        return closed
    loop = next((e for e in jaxpr.eqns if e.primitive is _SCAN and e.params["reverse"]), None)
    if loop is None:
        return closed
    after = _depend_on(jaxpr, loop)
    invars, barriers, swap = list(loop.invars), [], {}
    for k, group in _ties(loop, _ready_gradients(jaxpr, after)):
        held = [*group, invars[k]]
        tied = [jcore.Var(v.aval) for v in held]
        barriers.append(
            jcore.new_jaxpr_eqn(held, tied, _barrier(), {}, jcore.no_effects, loop.source_info)
        )
        invars[k] = tied[-1]
        swap.update(zip(group, tied[:-1], strict=True))
    if not barriers:
        return closed
    late = [e is loop or any(isinstance(v, jcore.Var) and v in after for v in e.invars)
            for e in jaxpr.eqns]  # fmt: skip
    before = [e for e, x in zip(jaxpr.eqns, late, strict=True) if not x]
    rest = [e.replace(invars=invars) if e is loop else e
            for e, x in zip(jaxpr.eqns, late, strict=True) if x]  # fmt: skip
    outvars = [swap.get(v, v) if isinstance(v, jcore.Var) else v for v in jaxpr.outvars]
    return jcore.ClosedJaxpr(
        jaxpr.replace(eqns=[*before, *barriers, *rest], outvars=outvars), closed.consts
    )


def _ties(loop: Any, ready: list) -> list[tuple[int, list]]:
    """Each group of ``ready`` with the loop operand it is tied to: a carried or scanned
    value (not a literal) of the same device-varying axes (``shard_map``'s types: an
    optimization barrier's operands must agree on them)."""
    operands = {}
    for k in range(scan_num_consts(loop), len(loop.invars)):
        v = loop.invars[k]
        if isinstance(v, jcore.Var):
            operands.setdefault(_vma(v), k)
    groups: dict[Any, list] = {}
    for v in ready:
        if _vma(v) in operands:
            groups.setdefault(_vma(v), []).append(v)
    return [(operands[g], vs) for g, vs in groups.items()]


def _vma(v: Any) -> frozenset:
    return aval_varying_axes(v.aval)


def _depend_on(jaxpr: Any, loop: Any) -> set:
    """Every value the loop's results flow into (the loop's own included)."""
    after = set(loop.outvars)
    for e in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and v in after for v in e.invars):
            after.update(e.outvars)
    return after


def _ready_gradients(jaxpr: Any, after: set) -> list:
    """The program's results that do not wait for the loop, each made by a matmul
    whose inputs (other than the program's arguments) outweigh it."""
    args = set(jaxpr.invars) | set(jaxpr.constvars)
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    ready: list = []
    for out in jaxpr.outvars:
        if not isinstance(out, jcore.Var) or out in after or out in args or out in ready:
            continue
        v = out
        while v in made and made[v].primitive.name in _RESHAPES:
            if not isinstance(made[v].invars[0], jcore.Var):
                break
            v = made[v].invars[0]
        dot = made.get(v)
        if dot is None or dot.primitive.name != "dot_general":
            continue
        inputs = [x for x in dot.invars if isinstance(x, jcore.Var) and x not in args]
        if sum(_nbytes(x.aval) for x in inputs) > _nbytes(out.aval):
            ready.append(out)
    return ready


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


@functools.cache
def _barrier() -> Any:
    """``optimization_barrier``'s primitive (not exported by ``jax.extend``)."""
    return jax.make_jaxpr(jax.lax.optimization_barrier)(0.0).eqns[0].primitive

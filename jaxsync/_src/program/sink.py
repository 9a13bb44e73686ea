"""Loop-invariant broadcasts sunk back into the scans that read them.

When JAX differentiates a ``lax.scan`` it evaluates, once and outside the loop,
whatever in the forward body depends on no loop input (``_scan_known_hoisting``),
and feeds the results to the loop as constants. A causal mask is such a value:
``jnp.where(tril, scores, -1e30)`` broadcasts the ``[S, S]`` mask and the scalar to
the scores' ``[B, H, S, S]`` shape, so the forward loop receives both broadcasts
whole: on the Llama-style 1.1B model of ``bench_gpu`` (4 x 2048 tokens per GPU),
1024 MiB of fp32 and 256 MiB of bools per GPU, held for the whole forward, where
inside the loop each would have been fused into the kernel that reads it. A
``jax.jit`` step holds them too. Worse, where XLA peels a loop iteration into the
surrounding program (its pipelined collectives and double-buffered loops do), it
merges the peeled iteration's own broadcast with the hoisted one, and the buffer
then lives from the forward into the backward, at the step's memory peak.

:func:`sink_broadcasts` rewrites a traced, differentiated program so that each scan
receives the broadcast's small operand instead and broadcasts it inside its body.
Nothing is computed differently (a broadcast copies values), so the rewrite is
exact; only what is materialized changes. :mod:`grad_program` applies it to every
gradient the library takes.

Boolean broadcasts stay where JAX put them. Fed a mask broadcast inside the loop,
XLA tiles the softmax fusion that reads it differently (``[1, 8, 1, 2048]`` rows
of the scores per program instead of ``[1, 1, 4, 2048]``, on jax 0.10.2 and 0.11.2
alike), and on one H200 that kernel ran 22% slower: 3.4 ms of the 1.1B model's
216 ms step, where holding the bools costs a quarter of what the fp32 fill did
(8 x H100: 128 MiB more for ZeRO, 214 MiB for FSDP).

The backward loop recomputes the mask from its ``[S, S]`` operand inside its own
fusions; but in the iterations XLA peels out of that loop, the same broadcast of the
same operand sits beside the forward's hoisted one, XLA merges the two, and the
forward's whole mask stays live until the backward's last peeled iteration, through
the backward loop's peak. So the hoisted broadcast reads its operand through an
optimization barrier (:func:`_fenced`), which no other broadcast shares: the peeled
iterations then recompute the mask as the loop does, and the forward keeps its own
(8 x H100, Llama-style 1.1B, FSDP: 5955 -> 5703 MiB, XLA's timeline unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from ..core.jaxpr_compat import (
    barrier_eqn,
    closes_over_values,
    program,
    scan_keeping,
    scan_num_consts,
    with_program,
)

_SCAN = jcore.primitives.scan_p
_JIT = jcore.primitives.jit_p
_BROADCAST = jcore.primitives.broadcast_in_dim_p
#: Elementwise ops that change a value's type, not its values, and may follow the
#: broadcast: ``jnp.full`` converts after it broadcasts; inside ``shard_map`` a value
#: the loop reads as device-varying is marked so (``pvary``).
RETYPES = frozenset({"convert_element_type", "pvary", "copy", "copy_p"})


def sink_broadcasts(closed: Any) -> Any:
    """``closed`` (a ``ClosedJaxpr``) with every size-inflating ``broadcast_in_dim``
    that feeds a scan as a loop constant moved into the scan's body; in the
    program's own jaxpr and in those of the jits and scans it calls."""
    jaxpr, changed = _sink(closed.jaxpr)
    return jcore.ClosedJaxpr(jaxpr, closed.consts) if changed else closed


def _sink(jaxpr: Any) -> tuple[Any, bool]:
    wanted = {
        v
        for e in jaxpr.eqns
        if e.primitive is _SCAN
        for v in e.invars[: scan_num_consts(e)]
        if isinstance(v, jcore.Var)
    }
    eqns, rename = _inline_producers(jaxpr.eqns, wanted)
    made = broadcasts(eqns)
    masks = _hoisted_masks(eqns, made)
    out, changed = [], False  # an inlined jit alone is no change: the original is kept
    for e in eqns:
        if id(e) in masks:
            barrier, e = _fenced(e)
            out.append(barrier)
            changed = True
        if e.primitive is _SCAN:
            e, sunk = _sink_into_scan(e, made)
            changed |= sunk
        if e.primitive in (_SCAN, _JIT):
            body, inner = _sink(program(e))
            if inner:
                e = e.replace(params=with_program(e, body))
                changed = True
        out.append(e)
    if not changed:
        return jaxpr, False
    outvars = [_read(rename, v) for v in jaxpr.outvars]
    return jaxpr.replace(eqns=out, outvars=outvars), True


def _inline_producers(eqns: Sequence[Any], wanted: set) -> tuple[list, dict]:
    """``eqns`` with each jit that computes a scan constant inlined (its equations in
    its place, under fresh names), so a broadcast made inside it is seen; and the
    renaming of the jits' results that the rest of the program must read."""
    rename: dict[Any, Any] = {}
    out: list[Any] = []
    pending = list(eqns)[::-1]
    while pending:
        e = pending.pop()
        invars = [_read(rename, v) for v in e.invars]
        if invars != list(e.invars):
            e = e.replace(invars=invars)
        if (
            e.primitive is _JIT
            and not e.effects
            and not closes_over_values(e)
            and any(v in wanted for v in e.outvars)
        ):
            inner = program(e)
            env: dict[Any, Any] = dict(zip(inner.invars, e.invars, strict=True))
            body = []
            for ie in inner.eqns:
                new_out = [v if isinstance(v, jcore.DropVar) else jcore.Var(v.aval)
                           for v in ie.outvars]  # fmt: skip
                body.append(ie.replace(invars=[_read(env, v) for v in ie.invars],
                                       outvars=new_out))  # fmt: skip
                env.update(zip(ie.outvars, new_out, strict=True))
            for outer, inner_out in zip(e.outvars, inner.outvars, strict=True):
                atom = _read(env, inner_out)
                rename[outer] = atom
                if outer in wanted and isinstance(atom, jcore.Var):
                    wanted.add(atom)
            pending.extend(body[::-1])
            continue
        out.append(e)
    return out, rename


def broadcasts(eqns: Sequence[Any]) -> dict[Any, list]:
    """Each value made by a size-inflating broadcast, or by conversions of one
    (:data:`RETYPES`), with the equations that made it."""
    made: dict[Any, list] = {}
    for e in eqns:
        if e.primitive is _BROADCAST and _inflates(e):
            made[e.outvars[0]] = [e]
        elif (
            e.primitive.name in RETYPES
            and len(e.invars) == len(e.outvars) == 1
            and isinstance(e.invars[0], jcore.Var)
            and e.invars[0] in made
        ):
            made[e.outvars[0]] = [*made[e.invars[0]], e]
    return made


def _hoisted_masks(eqns: Sequence[Any], made: dict[Any, list]) -> set[int]:
    """The ids of the broadcasts that make a boolean loop constant of a scan (a mask,
    left hoisted: see the module's note) from a variable operand."""
    out = set()
    for e in eqns:
        if e.primitive is not _SCAN:
            continue
        for v in e.invars[: scan_num_consts(e)]:
            chain = made.get(v) if isinstance(v, jcore.Var) else None
            if chain and v.aval.dtype == bool and isinstance(chain[0].invars[0], jcore.Var):
                out.add(id(chain[0]))
    return out


def _fenced(e: Any) -> tuple[Any, Any]:
    """``(barrier, broadcast)``: the broadcast ``e`` reading its operand through an
    optimization barrier of its own, so XLA merges no other broadcast with it."""
    barrier, (fenced,) = barrier_eqn([e.invars[0]], e.source_info)
    return barrier, e.replace(invars=[fenced, *e.invars[1:]])


def _sink_into_scan(e: Any, made: dict) -> tuple[Any, bool]:
    """The scan ``e`` with its broadcast constants (those ``made`` holds) read as their
    operands and broadcast at the top of its body."""
    n = scan_num_consts(e)
    body = program(e)
    invars, binders = list(e.invars), list(body.invars)
    front, drop = [], []
    for k in range(n):
        chain = made.get(invars[k]) if isinstance(invars[k], jcore.Var) else None
        if chain is None or invars[k].aval.dtype == bool:  # a mask: see the module's note
            continue
        operand, target = chain[0].invars[0], binders[k]
        if isinstance(operand, jcore.Literal):
            drop.append(k)
            x = operand
        else:
            x = jcore.Var(operand.aval)
            invars[k], binders[k] = operand, x
        for i, c in enumerate(chain):  # the same equations, inside, under new names
            out = target if i == len(chain) - 1 else jcore.Var(c.outvars[0].aval)
            front.append(c.replace(invars=[x], outvars=[out]))
            x = out
    if not front:
        return e, False
    keep = [i not in drop for i in range(len(invars))]
    inner = body.replace(
        invars=[b for b, k in zip(binders, keep, strict=True) if k],
        eqns=[*front, *body.eqns],
        debug_info=_without_args(body.debug_info, drop),
    )
    kept = [v for v, k in zip(invars, keep, strict=True) if k]
    return e.replace(invars=kept, params=scan_keeping(e, inner, keep)), True


def _inflates(e: Any) -> bool:
    """Whether a broadcast's result is larger than its operand (else nothing is saved)."""
    operand = e.invars[0].aval
    return math.prod(e.outvars[0].aval.shape) > math.prod(operand.shape)


def _without_args(info: Any, drop: Sequence[int]) -> Any:
    """A body's debug info without the names of the binders ``drop`` removed."""
    names = getattr(info, "arg_names", None)
    if not drop or names is None or not hasattr(info, "_replace"):
        return info
    return info._replace(arg_names=tuple(n for i, n in enumerate(names) if i not in drop))


def _read(env: dict, v: Any) -> Any:
    """What ``v`` is now called: a jit inlined inside an inlined jit renames twice."""
    while isinstance(v, jcore.Var) and v in env:
        v = env[v]
    return v

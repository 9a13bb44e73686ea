"""What a value is computed from, and what is computed from it, in a jaxpr; and the
evaluator the rewrites re-trace parts of a program with.

The rewrites decide what may move by these two walks: a value tied to a loop must not
feed that loop (the barrier would wait for itself), and a reduction that another waits
for must stay where it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from jax.extend import core as jcore

from ..core.axes import normalize_axes
from ..core.jaxpr_compat import REMAT

#: Ops that change only a value's shape: a bitcast in XLA's default layout.
SHAPE_ONLY = frozenset({"reshape", "squeeze", "expand_dims"})
#: Calls :func:`run_eqns` inlines (a remat's only where it keeps no CSE barrier).
_CALLS = {"closed_call", "pjit", "jit", "core_call"}


def upstream(made: dict, seeds: Iterable[Any]) -> set:
    """The seeds and every value they are computed from, by ``made`` (the equation
    that makes each value)."""
    seen: set = set()
    todo = [v for v in seeds if isinstance(v, jcore.Var)]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            if v in made:
                todo.extend(x for x in made[v].invars if isinstance(x, jcore.Var))
    return seen


def back_through(v: Any, made: dict, ops: set) -> list:
    """``v`` and the values it is made from through ``ops`` (each one's first operand),
    nearest first: the way back from a gradient to what it was before its casts, pads
    and layout changes."""
    way = [v]
    while v in made and made[v].primitive.name in ops and isinstance(made[v].invars[0], jcore.Var):
        v = made[v].invars[0]
        way.append(v)
    return way


def collective_axes(e: Any) -> tuple:
    """The mesh axes collective ``e`` runs over (its ``axes`` or ``axis_name``)."""
    return tuple(normalize_axes(e.params.get("axes", e.params.get("axis_name", ()))))


def nbytes(aval: Any) -> int:
    """The bytes of an abstract value."""
    return math.prod(aval.shape) * aval.dtype.itemsize


def downstream(eqns: Iterable[Any], seeds: Iterable[Any], strict: bool = False) -> set:
    """Every value ``eqns`` (in program order) compute from ``seeds``; the seeds too,
    unless ``strict``."""
    seeds = set(seeds)
    found = set() if strict else set(seeds)
    for e in eqns:
        if any(isinstance(v, jcore.Var) and (v in found or v in seeds) for v in e.invars):
            found.update(e.outvars)
    return found


def run_eqns(eqns: list, env: dict, outvars: list) -> list:
    """``outvars``' values, evaluating ``eqns`` on ``env`` (values by variable), calls
    inlined (a remat's only where it keeps no CSE barrier): how a rewrite re-traces
    part of a program in a new arrangement."""

    def read(v: Any) -> Any:
        return env[v] if isinstance(v, jcore.Var) else v.val

    for e in eqns:
        ins = [read(v) for v in e.invars]
        name = e.primitive.name
        if name in _CALLS or (name in REMAT and not e.params.get("prevent_cse")):
            sub = e.params.get("call_jaxpr", e.params.get("jaxpr"))
            closed = isinstance(sub, jcore.ClosedJaxpr)
            sub_jaxpr = sub.jaxpr if closed else sub
            inner_env = dict(zip(sub_jaxpr.constvars, sub.consts if closed else (), strict=True))
            inner_env.update(zip(sub_jaxpr.invars, ins, strict=True))
            outs = run_eqns(sub_jaxpr.eqns, inner_env, sub_jaxpr.outvars)
        else:
            params = e.primitive.get_bind_params(e.params)
            if isinstance(params, tuple):  # older JAX: (subfuns, params)
                outs = e.primitive.bind(*params[0], *ins, **params[1])
            else:
                outs = e.primitive.bind(*ins, **params)
            outs = outs if e.primitive.multiple_results else [outs]
        for v, x in zip(e.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in outvars]

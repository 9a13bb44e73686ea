"""How a scan's and a jit's equations hold their programs, across JAX versions.

The program rewrites (:mod:`sink`, :mod:`ready`) edit traced jaxprs, whose
higher-order equations changed form between JAX releases:

- JAX 0.10 keeps a scan's body as a ``ClosedJaxpr`` and counts its operands with
  ``num_consts`` / ``num_carry`` (and, before that, one ``linear`` flag each);
- JAX 0.11 keeps an open ``Jaxpr`` and a ``FlatTree`` of the operands (``ft_in``)
  whose first group is the loop constants; a jit's program is an open ``Jaxpr`` too.

The rewrites read and write these equations through the helpers here alone, so a
new form is taught in one place (``tests/test_sink.py`` runs the rewrites on
whichever JAX is installed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore


def program(e: Any) -> Any:
    """The open jaxpr a scan or jit equation runs."""
    inner = e.params["jaxpr"]
    return inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner


def closes_over_values(e: Any) -> bool:
    """Whether the equation's program holds constants of its own (not operands)."""
    inner = e.params["jaxpr"]
    if isinstance(inner, jcore.ClosedJaxpr):
        return bool(inner.consts)
    return bool(inner.constvars)


def with_program(e: Any, jaxpr: Any) -> dict:
    """The equation's params with its program replaced by ``jaxpr`` (same form)."""
    inner = e.params["jaxpr"]
    if isinstance(inner, jcore.ClosedJaxpr):
        jaxpr = jcore.ClosedJaxpr(jaxpr, inner.consts)
    return {**e.params, "jaxpr": jaxpr}


def scan_num_consts(e: Any) -> int:
    """How many of a scan's leading operands are loop constants."""
    if "num_consts" in e.params:
        return e.params["num_consts"]
    consts, _, _ = e.params["ft_in"].unpack()
    return len(consts)


def scan_num_carry(e: Any) -> int:
    """How many of a scan's operands, after its loop constants, are carried."""
    if "num_carry" in e.params:
        return e.params["num_carry"]
    _, carry, _ = e.params["ft_in"].unpack()
    return len(carry)


def scan_keeping(e: Any, jaxpr: Any, keep: Sequence[bool]) -> dict:
    """A scan's params for the body ``jaxpr`` that binds only the operands ``keep``
    marks (one flag per operand; only loop constants may be dropped)."""
    n = scan_num_consts(e)
    if not all(keep[n:]):
        raise ValueError("only a scan's loop constants can be dropped")
    params = with_program(e, jaxpr)
    if "ft_in" in params:  # as JAX's own dead-code elimination drops operands
        params["ft_in"] = params["ft_in"].filter_with_mask(list(keep))
    else:
        params["num_consts"] = n - (len(keep) - sum(keep))
    if "linear" in params:
        params["linear"] = tuple(f for f, k in zip(params["linear"], keep, strict=True) if k)
    return params


#: ``jax.checkpoint``'s primitive, by the names JAX versions give it.
REMAT = ("remat2", "checkpoint")


def rewrite_programs(e: Any, rewrite: Callable[[Any], tuple[Any, bool]]) -> tuple[dict, bool]:
    """The equation's params with every program it holds (a jaxpr, closed or open, alone
    or in a tuple: a scan's body, a cond's branches, a remat's) passed through
    ``rewrite`` (open jaxpr -> ``(jaxpr, changed)``), and whether any changed."""
    params, changed = {}, False
    for key, value in e.params.items():
        params[key], hit = _rewrite_value(value, rewrite)
        changed |= hit
    return params, changed


def _rewrite_value(value: Any, rewrite: Callable[[Any], tuple[Any, bool]]) -> tuple[Any, bool]:
    if isinstance(value, jcore.ClosedJaxpr):
        jaxpr, hit = rewrite(value.jaxpr)
        return (jcore.ClosedJaxpr(jaxpr, value.consts) if hit else value), hit
    if isinstance(value, jcore.Jaxpr):
        return rewrite(value)
    if isinstance(value, tuple | list) and any(
        isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr) for v in value
    ):
        subs = [_rewrite_value(v, rewrite) for v in value]
        if not any(hit for _, hit in subs):
            return value, False
        return type(value)(v for v, _ in subs), True
    return value, False


def barrier_eqn(values: Sequence[Any], source_info: Any) -> tuple[Any, list]:
    """An ``optimization_barrier`` equation over ``values`` (a jaxpr's variables) and
    the variables it gives back, which XLA can neither compute early nor merge."""
    out = [jcore.Var(v.aval) for v in values]
    eqn = jcore.new_jaxpr_eqn(list(values), out, _barrier(), {}, jcore.no_effects, source_info)
    return eqn, out


@functools.cache
def _barrier() -> Any:
    """``optimization_barrier``'s primitive (not exported by ``jax.extend``)."""
    return jax.make_jaxpr(jax.lax.optimization_barrier)(0.0).eqns[0].primitive

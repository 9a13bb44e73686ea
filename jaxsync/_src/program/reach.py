"""What a value is computed from, and what is computed from it, in a jaxpr.

The rewrites decide what may move by these two walks: a value tied to a loop must not
feed that loop (the barrier would wait for itself), and a reduction that another waits
for must stay where it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.extend import core as jcore


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


def downstream(eqns: Iterable[Any], seeds: Iterable[Any], strict: bool = False) -> set:
    """Every value ``eqns`` (in program order) compute from ``seeds``; the seeds too,
    unless ``strict``."""
    seeds = set(seeds)
    found = set() if strict else set(seeds)
    for e in eqns:
        if any(isinstance(v, jcore.Var) and (v in found or v in seeds) for v in e.invars):
            found.update(e.outvars)
    return found

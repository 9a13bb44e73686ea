"""Which model each state was made from, so that another step of the same settings
takes it.

A step compiles for the states its own ``init`` (or ``abstract_state``) made: the
plan it builds there needs the model's params (a ZeRO or FSDP state holds them only
as flat shards). A step rebuilt mid-run (other ``microbatches``, a fresh object in a
notebook) has made none, and would refuse a state it could run. So each state's
signature (structure, shapes, shardings) is noted with the model it was made from,
abstract (shapes, dtypes and shardings only), and a step handed a state it did not
make builds its plan from that model, as ``abstract_state`` would; the state is then
taken only where that plan's state has the same signature, and its layout tag is
checked as any other.
"""

from __future__ import annotations

from typing import Any

import jax

from ..fsdp.held import FsdpShards

#: How many states' models are kept (the most recent).
KEPT = 16

_MADE: dict[Any, tuple[Any, Any, Any]] = {}


def _abstract(tree: Any) -> Any:
    def one(x: Any) -> Any:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def note_made(signature: Any, model: Any, params: Any, rest: Any) -> None:
    """Notes that states of ``signature`` are made from ``(model, params, rest)``."""
    _MADE.pop(signature, None)
    _MADE[signature] = (model, _abstract(params), _abstract(rest))
    while len(_MADE) > KEPT:
        del _MADE[next(iter(_MADE))]


def made_from(signature: Any) -> tuple[Any, Any, Any] | None:
    """``(model, params, rest)`` (abstract) a state of ``signature`` was made from."""
    return _MADE.get(signature)


def mode_of(state: Any) -> str:
    """The mode whose step makes a state of this form: FSDP's flat shards, ZeRO's guard
    in its optimizer state, DDP's replicated params."""
    if isinstance(state.params, FsdpShards):
        return "fsdp"
    return "zero" if state.guard is None else "ddp"


def unmatched(fn: str, state: Any, mode: str) -> str:
    """The error for a state that matches no plan of a ``mode`` step."""
    other = mode_of(state)
    why = (
        f"it is a mode={other!r} state and this step's mode is {mode!r} (a state does not "
        "change mode; train from its checkpoint with a step of its own mode)"
        if other != mode
        else "it was made for another model, optimizer, mesh or layout than this step's"
    )
    return (
        f"{fn}: this state's structure, shapes or shardings match no state this TrainStep "
        f"makes: {why}. Build the state with `step.init(params_or_module)` (a restored "
        "state too: restore into `step.abstract_state(...)`)."
    )

"""Which optax factories built a transformation, read from its closures.

optax builds every transformation from closures (``chain`` keeps its parts in one),
so a chain's parts are not attributes. The qualified names of the functions in a
transformation's closures (``clip_by_global_norm.<locals>.update_fn``) say which
factories made it. jaxsync reads them only to refuse a documented misuse with a
precise message, or to add the right rewrite to one; never to choose numerics.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

#: How deep closures are followed (a chain of chains of wrappers is a few levels).
_DEPTH = 16


def functions(tx: Any) -> list[Any]:
    """Every Python function ``tx`` reaches through closures, defaults, partials,
    containers, bound methods' objects and the ``init``/``update`` of transformations
    it holds; other callables reached are listed as they are (opaque)."""
    seen: set[int] = set()
    found: list[types.FunctionType] = []

    def walk(obj: Any, depth: int) -> None:
        if depth > _DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            found.append(obj)
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    walk(cell.cell_contents, depth + 1)
            for default in obj.__defaults__ or ():
                walk(default, depth + 1)
        elif isinstance(obj, types.MethodType):
            found.append(obj.__func__)
            walk(obj.__self__, depth + 1)
            for x in getattr(obj.__self__, "__dict__", {}).values():  # e.g. MultiSteps' inner
                walk(x, depth + 1)
        elif isinstance(obj, functools.partial):
            for x in (obj.func, *obj.args, *obj.keywords.values()):
                walk(x, depth + 1)
        elif isinstance(obj, tuple | list):
            for x in obj:
                walk(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x, depth + 1)
        elif hasattr(obj, "init") and hasattr(obj, "update"):
            walk(obj.init, depth + 1)
            walk(obj.update, depth + 1)
        elif callable(obj) and not isinstance(obj, type):
            found.append(obj)  # an object we cannot see into: its caller decides

    walk(tx, 0)
    return found


def factory_of(fn: Any) -> str | None:
    """``clip_by_global_norm`` for ``clip_by_global_norm.<locals>.update_fn``."""
    if "<locals>" not in getattr(fn, "__qualname__", ""):
        return None
    return fn.__qualname__.split(".<locals>")[0].rsplit(".", 1)[-1]


def factories(tx: Any) -> frozenset[str]:
    """Names of the optax factories whose functions ``tx`` closes over, e.g.
    ``{"chain", "clip_by_global_norm", "scale_by_adam", ...}``."""
    return frozenset(f for fn in functions(tx) if (f := factory_of(fn)) is not None)


def is_muon(tx: Any) -> bool:
    """``tx`` is (or contains) ``optax.contrib.muon``'s Newton-Schulz step."""
    return "scale_by_muon" in factories(tx)


def multi_steps_of(tx: Any) -> Any:
    """The ``optax.MultiSteps`` that ``tx`` is (or whose ``gradient_transformation()``
    it is), else None."""
    import optax

    found = tx if isinstance(tx, optax.MultiSteps) else getattr(tx.update, "__self__", None)
    return found if isinstance(found, optax.MultiSteps) else None

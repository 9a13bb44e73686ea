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


def factories(tx: Any) -> frozenset[str]:
    """Names of the optax factories whose functions ``tx`` closes over, e.g.
    ``{"chain", "clip_by_global_norm", "scale_by_adam", ...}``."""
    seen: set[int] = set()
    names: set[str] = set()

    def walk(obj: Any, depth: int) -> None:
        if depth > _DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            if "<locals>" in obj.__qualname__:
                names.add(obj.__qualname__.split(".<locals>")[0].rsplit(".", 1)[-1])
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    walk(cell.cell_contents, depth + 1)
            for default in obj.__defaults__ or ():
                walk(default, depth + 1)
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

    walk(tx, 0)
    return frozenset(names)


def is_muon(tx: Any) -> bool:
    """``tx`` is (or contains) ``optax.contrib.muon``'s Newton-Schulz step."""
    return "scale_by_muon" in factories(tx)

"""A value a context variable holds for the length of one trace.

The step passes trace-time facts to code it does not call directly (the mesh a
reduction runs on, the order a unit's gradients become ready in, a module's views)
through context variables, each set for one traced call and reset after it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` holds ``value`` inside the ``with`` block, and what it held before after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)

"""Saying once that a constant loss scale overflows every step.

A step with non-finite gradients is skipped and counted in ``state.metrics``. A
dynamic loss scale backs off; a constant one that is too large makes every step
overflow, and the run trains nothing while its loop looks healthy. Reading the count
would wait for the device, so it is read only once the step that wrote it has
finished on its own (``is_ready``): the check never blocks a step.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from ..optim.loss_scale import DynamicLossScale

#: Consecutive skipped steps that mean a constant loss scale overflows every step.
ALWAYS = 8
ALWAYS_SKIPPED = (
    "jaxsync.train_step: the last {n} steps were all skipped (non-finite gradients) with "
    "the constant loss_scale={scale!r}: at this scale every step overflows and nothing "
    "trains. Lower it, or pass jaxsync.DynamicLossScale(...), which backs off."
)

# Steps that have warned already.
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()


class AlwaysSkippedWarning(UserWarning):
    """Every recent step was skipped with a constant loss scale."""


def watch(step: Any, state: Any) -> None:
    """Called with the state a step is handed, before it is donated (no device wait)."""
    scale = step.loss_scale
    if scale is None or isinstance(scale, DynamicLossScale) or step in _WARNED:
        return
    count = state.metrics.consecutive_skips
    if not count.is_ready():
        return
    n = int(count.addressable_data(0))  # replicated: this process's copy (multi-host too)
    if n >= ALWAYS:
        _WARNED.add(step)
        warnings.warn(ALWAYS_SKIPPED.format(n=n, scale=scale), AlwaysSkippedWarning, stacklevel=3)

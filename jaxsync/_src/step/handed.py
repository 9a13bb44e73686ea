"""The states a training step handed out, so that a partial save can say what it drops.

``Checkpointer.save(params=, opt_state=)`` writes two fields of a
:class:`jaxsync.TrainState`. For a DDP or FSDP step the loss scale, skip counters
and metrics live in ``state.guard``, and an NNX model's BatchNorm statistics in
``state.model_state``: a run resumed from such a checkpoint restarts them silently.
Each step remembers the optimizer state it last returned (one reference per live
step, replaced every call), and the checkpointer asks whether it is being handed one.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax

# step -> (the opt_state object it last returned, what a params+opt_state save drops)
_LATEST: weakref.WeakKeyDictionary[Any, tuple[Any, str]] = weakref.WeakKeyDictionary()


def note(step: Any, state: Any) -> None:
    """Records ``state`` as the last one ``step`` handed out (costs a dict write)."""
    lost = []
    if state.guard is not None:
        lost.append("the loss scale, skip counters and last metrics (state.guard)")
    if jax.tree.leaves(state.model_state):
        lost.append("the model state (state.model_state: BatchNorm statistics, RNG counters)")
    if lost:
        _LATEST[step] = (state.opt_state, " and ".join(lost))
    else:
        _LATEST.pop(step, None)


def dropped_by_save(opt_state: Any) -> tuple[Any, str] | None:
    """``(step, what is dropped)`` when ``opt_state`` is a step's latest and a save of
    only params and optimizer state would lose other fields of its state."""
    for step, (held, lost) in list(_LATEST.items()):
        if held is opt_state:
            return step, lost
    return None

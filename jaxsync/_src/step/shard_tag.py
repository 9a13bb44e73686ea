"""The shard layout a state was cut for, kept in the state, checked by the step.

A ``"zero"`` or ``"fsdp"`` state holds flat, padded shards whose element order depends
on the data-parallel size ``N`` (and on the layout options: buckets, units, labels). A
trainer that saves ``state`` with its own orbax code (``ocp.StandardCheckpointer``)
and restores it into a step on another ``N`` gets arrays of the same global shape in
another order: orbax cannot know, and the run resumed silently wrong (an FSDP step with
labels saved at 8 devices read its params 3.4 off at 4).

So the state carries its layout as data: ``state.layout``, an int32 ``[2]`` replicated
array ``[N (0 when nothing depends on it: "ddp"), fingerprint of the options]``, which
orbax saves and restores like any leaf. Every method of the step that takes a state
(``step(state, batch)``, ``step.params(state)``, ``save_state``...) compares it with its
own the first time it sees that state (the arrays it made itself are known; a foreign
one costs one read of two integers) and refuses a state cut for another layout, naming
:meth:`jaxsync.Checkpointer.save_state` / ``restore_state``, which move a state between
sizes. The arrays keep their shapes: nothing else in the step, its optimizer states or
its specs changes.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import mesh_axes_size
from .held import split_stacks

WRONG_LAYOUT = (
    "{fn}: this state's flat shards were cut for {saved}, and this step's for {now} "
    "({mode!r} mode): in this step's arrays their elements stand in another order, so the "
    "state would train (and read) silently wrong. It was made by a step of another "
    "layout, or restored by code that does not know jaxsync's layout (plain orbax: "
    "StandardCheckpointer, PyTreeCheckpointer). Move it through "
    "`jaxsync.Checkpointer(dir).save_state(old_step, state)` and "
    "`Checkpointer(dir).restore_state(step, step.abstract_state(params))`, which cut the "
    "shards again for any data-parallel size and layout; or run it (or restore it with "
    "plain orbax) on a step built as the one that made it ({saved})."
)
NO_TAG = (
    "{fn}: this state has no shard layout tag (`state.layout` is {got}): it was saved "
    "before jaxsync kept the layout in the state, or built by hand, so whether its shards "
    "were cut for this step's layout cannot be checked. Restore it into a step built as "
    "the saved one was (the same data-parallel size) and move it with "
    "`jaxsync.Checkpointer(dir).save_state(step, state)` / `restore_state`; or, if it was "
    "saved by a step of this very layout, `state = state._replace(layout=step.init("
    "params).layout)`."
)


def _stable(x: Any) -> Any:
    """``x`` as plain data whose repr is the same in every process (no addresses)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, Mapping):
        return tuple(sorted((str(k), _stable(v)) for k, v in x.items()))
    if isinstance(x, (tuple, list)):
        return tuple(_stable(v) for v in x)
    try:
        return np.dtype(x).name
    except TypeError:
        return type(x).__name__


def tag_of(step: Any) -> np.ndarray:
    """``[N or 0, fingerprint]`` of ``step``'s layout (int32)."""
    mode = step.mode
    n = 0 if mode.name == "ddp" else mesh_axes_size(step.mesh, step.axis_name, "jaxsync.train_step")
    labels = step.labels if not callable(step.labels) else "callable"
    options = (
        mode.name, step.axis_name, step.stacked, labels,
        getattr(mode, "bucket_size", None), getattr(mode, "units", None),
    )  # fmt: skip
    if step.stacked and (mode.name == "fsdp" or split_stacks(mode)):
        # Since 2026-11 a stacked FSDP unit's shard holds a piece of every param (it was
        # a slice of the layer's flat row), and ZeRO keeps a buffer per stacked param:
        # the same shapes, in another order.
        options += ("stacked: a piece of every param",)
    crc = zlib.crc32(repr(_stable(options)).encode()) & 0x7FFFFFFF
    return np.array([n, crc], np.int32)


def tagged(step: Any, state: Any, specs: Any, abstract: bool = False) -> tuple[Any, Any]:
    """``(state, specs)`` with the layout tag (a replicated array; traced when ``abstract``)."""
    tag = tag_of(step)
    value = jnp.asarray(tag) if abstract else jax.device_put(tag, NamedSharding(step.mesh, P()))
    return state._replace(layout=value), specs._replace(layout=P())


def _sizes(tag: np.ndarray) -> str:
    n = int(tag[0])
    return (
        "a layout independent of the data-parallel size" if n == 0 else f"{n} data-parallel devices"
    )


def check_untagged(state: Any, fn: str) -> None:
    """A state without the tag (``layout=None``: an older checkpoint) is named as such
    (it matches no plan of the step)."""
    if getattr(state, "layout", 0) is None:
        raise ValueError(NO_TAG.format(fn=fn, got="None"))


def check_tag(step: Any, state: Any, fn: str) -> None:
    """Refuses a state whose ``layout`` is not this step's; a state the step made or
    returned (kept in ``step._tags``) is not read again."""
    x = state.layout
    if isinstance(x, jax.ShapeDtypeStruct) or any(x is t for t in step._tags):
        return
    if not isinstance(x, jax.Array) or x.shape != (2,):
        got = type(x).__name__ if not hasattr(x, "shape") else f"of shape {x.shape}"
        raise ValueError(NO_TAG.format(fn=fn, got=got))
    saved, now = np.asarray(x.addressable_data(0)), tag_of(step)
    if not np.array_equal(saved, now):
        if saved[0] == now[0]:
            saved_s = f"{_sizes(saved)} with other layout options (bucket_size, units, labels)"
        else:
            saved_s = _sizes(saved)
        raise ValueError(
            WRONG_LAYOUT.format(fn=fn, saved=saved_s, now=_sizes(now), mode=step.mode.name)
        )
    remember(step, x)


def remember(step: Any, tag: Any) -> None:
    """Marks ``tag`` (a state's layout array) as this step's own: not read again."""
    if isinstance(tag, jax.Array):
        step._tags.append(tag)
        del step._tags[:-4]

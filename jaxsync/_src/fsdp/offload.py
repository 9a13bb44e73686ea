"""Host offload: optimizer state in pinned host memory between steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def host_offload_supported(mesh: Mesh) -> bool:
    """Whether every device of ``mesh`` has pinned host memory (for offloading)."""
    return all(
        "pinned_host" in {m.kind for m in d.addressable_memories()}
        for d in mesh.devices.flat
        if d.process_index == jax.process_index()
    )


def _require_host_memory(mesh: Mesh) -> None:
    if not host_offload_supported(mesh):
        kinds = sorted({m.kind for m in mesh.devices.flat[0].addressable_memories()})
        raise ValueError(
            f"host offload needs 'pinned_host' memory, but {mesh.devices.flat[0].platform} "
            f"devices offer {kinds}. Run without offload on this backend."
        )


def _shardings(mesh: Mesh, specs: PyTree, kind: str) -> PyTree:
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=kind),
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def offload(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """Moves ``tree`` (e.g. optimizer state) to pinned host memory, keeping its sharding.

    Raises:
      ValueError: the backend has no pinned host memory (not a silent no-op).
    """
    _require_host_memory(mesh)
    return jax.device_put(tree, _shardings(mesh, specs, "pinned_host"))


def with_offloaded_state(
    step: Callable[..., Any], *, mesh: Mesh, specs: PyTree, argnum: int = 1, out_index: int = 1
) -> Callable[..., Any]:
    """Jits ``step`` so that its state lives in pinned host memory between steps.

    ``step`` (typically a ``jax.shard_map``-ed function, not yet jitted) takes the
    state as argument ``argnum`` and returns it as output ``out_index``. The
    wrapped step copies the state to device memory on entry and back to the
    host on exit, inside one program, so XLA can overlap the copies with compute.
    Pass state placed with :func:`offload`.

    Raises:
      ValueError: the backend has no pinned host memory.
    """
    _require_host_memory(mesh)
    on_device = _shardings(mesh, specs, "device")
    on_host = _shardings(mesh, specs, "pinned_host")

    def wrapped(*args: Any) -> Any:
        args = list(args)
        args[argnum] = jax.device_put(args[argnum], on_device)
        out = list(step(*args))
        out[out_index] = jax.device_put(out[out_index], on_host)
        return tuple(out)

    return jax.jit(wrapped)

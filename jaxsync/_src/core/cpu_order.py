"""One multi-device CPU program in flight at a time, where jaxsync dispatches several.

XLA:CPU runs each device's part of a program on a shared thread pool, and a
collective blocks its thread until every participant arrives. With several
independent multi-device programs in flight (a checksum per leaf, a conversion
per label), the pool can fill with waiting participants of different programs
while the one they wait for has no thread: XLA aborts the process after 40 s
("Termination timeout for all reduce RendezvousKey..."). jaxlib 0.10.2 does it
within a few rounds of 60 small sharded sums on 8 simulated devices.

GPU and TPU order each device's programs on its stream, so there nothing waits.

A ``jax.device_put`` between shardings of different device orders is such a
program too (a reshard with collectives): a tree of them put leaf by leaf, across
processes, deadlocked the two-process trainer's checkpoint conversion under CPU
load (4 runs of 4 beside two busy loops; none with :func:`put`).
"""

from __future__ import annotations

from typing import Any

import jax


def settle(tree: Any) -> Any:
    """``tree``, after waiting for its arrays that span several CPU devices (tracers,
    as under ``jax.eval_shape``, pass through)."""
    spanning = [
        x for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        and len(x.sharding.device_set) > 1
        and next(iter(x.sharding.device_set)).platform == "cpu"
    ]  # fmt: skip
    if spanning:
        jax.block_until_ready(spanning)
    return tree


def put(x: Any, sharding: Any) -> Any:
    """``jax.device_put(x, sharding)``, finished before the next multi-device CPU
    program can start (see above)."""
    return settle(jax.device_put(x, sharding))


def on_cpu(mesh: Any) -> bool:
    """Whether ``mesh``'s devices are XLA:CPU's (compile-only GPU meshes are not),
    for the choices a step makes per backend."""
    return mesh.devices.flat[0].platform == "cpu"

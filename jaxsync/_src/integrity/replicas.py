"""Replicas that should be equal, checked: a fingerprint of every copy, on its device.

Data parallelism keeps copies that must stay bitwise equal: DDP's params and
optimizer state on every device, ZeRO's replicated params, a hybrid FSDP's shards
across its replica groups, a 2-D step's params across the data axes. Silent data
corruption (a flipped bit in one GPU's memory) breaks that without any NaN, and
training goes on from diverged copies. Megatron-Core compares parameter hashes
across data-parallel replicas; :func:`replica_check` does the same for any
jaxsync state, in one compiled program: each device reduces each of its blocks
to a 32-bit fingerprint (the sum of its elements' bits, each weighted by an odd
number that depends on its position, modulo 2**32: any single flipped bit changes
it), and the host compares the fingerprints of the copies that should agree. The
copies of a leaf are the devices that differ only along the mesh axes its
sharding does not name; where they disagree, the devices outside the majority
are named.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.bits import fingerprint


class ReplicaMismatch(NamedTuple):
    """A state leaf whose copies disagree.

    Attributes:
      leaf: its path in the state (``params['w']``, ``opt_state[0].mu['w']``).
      devices: the devices (ids, as in ``jax.devices()``) whose copy differs from
        the majority of its group.
      copies: how many copies its group holds.
    """

    leaf: str
    devices: tuple[int, ...]
    copies: int


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    """What :func:`replica_check` found.

    Attributes:
      checked: leaves with more than one copy, compared.
      mismatches: the leaves whose copies disagree, with the devices at fault.
    """

    checked: int
    mismatches: tuple[ReplicaMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device named by some mismatch, sorted."""
        return tuple(sorted({d for m in self.mismatches for d in m.devices}))

    def __str__(self) -> str:
        if self.ok:
            return f"replica check: {self.checked} replicated leaves, every copy equal"
        lines = [
            f"replica check: {len(self.mismatches)} of {self.checked} replicated leaves "
            f"differ between copies (devices {list(self.devices)}):"
        ]
        lines += [
            f"  {m.leaf}: device(s) {list(m.devices)} differ from the other "
            f"{m.copies - len(m.devices)} of {m.copies} copies"
            for m in self.mismatches
        ]
        return "\n".join(lines)


def replica_check(step: Any, state: Any) -> ReplicaReport:
    """Compares every copy of every replicated leaf of ``state``, bit for bit.

    Args:
      step: the :class:`jaxsync.TrainStep` (its mesh), or a ``jax.sharding.Mesh``.
      state: its state (any pytree of arrays sharded over that mesh).

    Returns:
      A :class:`ReplicaReport`; ``report.ok``, ``print(report)``.

    Runs one program on every device (with several processes, call it on each of
    them, as any collective) and reads back one 32-bit word per leaf per device.

    Example:
      >>> if step_i % 100 == 0:
      ...     report = jaxsync.replica_check(step, state)
      ...     if not report.ok:
      ...         raise RuntimeError(str(report))
    """
    mesh = getattr(step, "mesh", step)
    flat = [
        (jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if isinstance(x, jax.Array)
    ]
    if not flat:
        return ReplicaReport(0, ())
    # Only leaves with copies: a leaf sharded over every axis of size > 1 is its
    # devices' own, and reading it would cost a pass over it for nothing.
    kept = [(name, x, _spec(x, mesh, name)) for name, x in flat]
    kept = [(name, x, spec) for name, x, spec in kept if _copies(spec, mesh) > 1]
    if not kept:
        return ReplicaReport(0, ())
    names, arrays, specs = zip(*kept, strict=True)
    prints = _fingerprints(mesh, tuple(specs))(tuple(arrays))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        host = np.asarray(multihost_utils.process_allgather(prints, tiled=True))
    else:
        host = np.asarray(prints)
    axes = mesh.axis_names
    checked, bad = 0, []
    for i, (name, spec) in enumerate(zip(names, specs, strict=True)):
        named = _named(spec)
        free = [k for k, a in enumerate(axes) if a not in named]
        checked += 1
        groups: dict[tuple, list[tuple[int, ...]]] = {}
        for coords in np.ndindex(*mesh.devices.shape):
            key = tuple(c for k, c in enumerate(coords) if k not in free)
            groups.setdefault(key, []).append(coords)
        faulty: list[int] = []
        copies = 0
        for members in groups.values():
            values = [int(host[c + (i,)]) for c in members]
            majority, _ = Counter(values).most_common(1)[0]
            copies = len(members)
            faulty += [
                int(mesh.devices[c].id)
                for c, v in zip(members, values, strict=True)
                if v != majority
            ]
        if faulty:
            bad.append(ReplicaMismatch(name, tuple(sorted(faulty)), copies))
    return ReplicaReport(checked, tuple(bad))


def _named(spec: P) -> set[str]:
    return {a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))}


def _copies(spec: P, mesh: Any) -> int:
    """How many devices hold each block of a leaf sharded by ``spec``."""
    named = _named(spec)
    return int(np.prod([n for a, n in mesh.shape.items() if a not in named], dtype=np.int64))


def _spec(x: jax.Array, mesh: Any, name: str) -> P:
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape != mesh.shape:
        raise ValueError(
            f"replica_check: state leaf {name} is not sharded over the step's mesh "
            f"{dict(mesh.shape)} (its sharding: {sharding}); pass the state the step "
            "returned, or the mesh it lives on."
        )
    return sharding.spec


@functools.lru_cache(maxsize=32)
def _fingerprints(mesh: Any, specs: tuple[P, ...]) -> Any:
    """One program: every device's fingerprint of its block of every leaf, laid out
    ``[*mesh.shape, leaves]``."""
    axes = mesh.axis_names
    ones = (1,) * len(axes)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(specs,), out_specs=P(*axes),
             check_vma=False)  # fmt: skip
    def run(blocks: tuple[jax.Array, ...]) -> jax.Array:
        return jnp.stack([fingerprint(b) for b in blocks]).reshape(ones + (len(blocks),))

    return run

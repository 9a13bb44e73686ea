"""Naming the device: a deterministic step's units computed by other devices.

In deterministic mode (:class:`jaxsync.Deterministic`) each unit of the global
batch goes through the same per-unit program on whichever device holds it, so a
unit's gradient is the same bits on every device. That makes a device testable
against the others: compute every unit's gradient with the normal placement, then
with the rows rotated by one device's share (device ``d`` computes the units of
device ``d + 1``), then by two, and compare each unit's fingerprints
(:func:`~jaxsync._src.integrity.replicas.fingerprint`, one uint32 per unit and
param). A unit whose gradient moves with the device that computed it names that
device (the one outside the majority of the three); a data problem (a NaN in the
rows) stays with its unit in every placement.

This is a separate program (the *probe*), compiled on the first suspicious step
and run only then: the step itself is not changed and costs nothing more. It
computes the step's forward and backward once per placement (three times with 3
or more devices, twice with 2) and keeps one placement's unit gradients alive at a
time, as the step does.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..core.axes import to_varying
from ..core.bits import fingerprint
from ..deterministic.exact import nonfinite_flags
from ..step.modes import deterministic_of
from ..step.parts import loss_of
from ..step.pieces.rng import Keyed, check_key
from ..sync.grad_sync import value_and_grad


class DeviceRef(NamedTuple):
    """A device named by a check: its place in ``mesh.devices.flat``, its id (as in
    ``jax.devices()``) and its process."""

    index: int
    id: int
    process: int

    def __str__(self) -> str:
        return f"device {self.index} (id {self.id}, process {self.process})"


@dataclasses.dataclass(frozen=True)
class Rotation:
    """Every unit's gradient fingerprints under ``placements`` placements.

    ``prints[r, u, l]``: unit ``u``'s (numbered as the normal placement numbers
    them) gradient of param leaf ``l`` when placement ``r`` put it on device
    ``(u // per_device - r) % devices``; ``nonfinite`` likewise, NaN/Inf flags.
    """

    prints: np.ndarray
    nonfinite: np.ndarray
    per_device: int
    devices: int
    rows: int  # global rows per unit
    leaves: tuple[str, ...]

    def device_of(self, unit: int, placement: int) -> int:
        return (unit // self.per_device - placement) % self.devices

    def moved(self) -> tuple[dict[int, set[int]], set[str], bool]:
        """``({device: units it got wrong}, leaves that moved, ambiguous)``.

        Per unit, the majority fingerprint of its placements is taken as right and
        the devices outside it are named. Where there is no majority (two
        placements that disagree), every device that computed the unit is a
        suspect, and the devices common to all such units are named
        (``ambiguous`` when that leaves more than one).
        """
        blamed: dict[int, set[int]] = {}
        suspects: list[set[int]] = []
        leaves: set[str] = set()
        for u in range(self.prints.shape[1]):
            values = [self.prints[r, u].tobytes() for r in range(self.prints.shape[0])]
            if len(set(values)) == 1:
                continue
            for r in range(self.prints.shape[0]):
                for leaf in np.flatnonzero(self.prints[r, u] != self.prints[0, u]):
                    leaves.add(self.leaves[leaf])
            top, count = Counter(values).most_common(1)[0]
            if count * 2 > len(values):
                for r, v in enumerate(values):
                    if v != top:
                        blamed.setdefault(self.device_of(u, r), set()).add(u)
            else:
                suspects.append({self.device_of(u, r) for r in range(len(values))})
        ambiguous = False
        if suspects and not blamed:
            common = set.intersection(*suspects)
            named = common or set.union(*suspects)
            ambiguous = len(named) > 1
            units = {u for u in range(self.prints.shape[1]) if self._differs(u)}
            blamed = {d: {u for u in units if d in self._computers(u)} for d in named}
        return blamed, leaves, ambiguous

    def nonfinite_units(self) -> tuple[int, ...]:
        """Units whose gradient holds NaN/Inf in every placement (the data's)."""
        return tuple(int(u) for u in np.flatnonzero(self.nonfinite.any(axis=2).all(axis=0)))

    def _differs(self, u: int) -> bool:
        return len({self.prints[r, u].tobytes() for r in range(self.prints.shape[0])}) > 1

    def _computers(self, u: int) -> set[int]:
        return {self.device_of(u, r) for r in range(self.prints.shape[0])}


def rotated_units(step: Any, state: Any, batch: Any, key: Any = None) -> Rotation:
    """Runs the probe on ``state`` (not donated) and ``batch``: every unit's gradient
    fingerprints under the normal placement and the rotated ones (with several
    processes, call it on each of them, as the step)."""
    plan = step._plan(state, "Rerun")
    det = deterministic_of(step.mode)
    axes = step.axis_name
    n = int(np.prod([step.mesh.shape[a] for a in axes]))
    k = det.units // n
    placements = min(3, n)
    kind = None
    extra: tuple[Any, ...] = ()
    if key is not None:
        data, kind = check_key(key, step.loss_fn)
        extra = (data,)
    cache = _PROBES.setdefault(step, {})
    probe = cache.get((id(plan), kind))
    if probe is None:
        probe = cache[(id(plan), kind)] = _probe(step, plan, kind, n, k, placements)
    placed = step.place(batch)
    prints, bad = probe(state, placed, *extra)
    prints, bad = _host(prints), _host(bad)  # [n, placements, k, leaves]
    units = n * k
    by_unit = np.empty((placements, units, prints.shape[-1]), np.uint32)
    flags = np.empty((placements, units, prints.shape[-1]), bool)
    for d in range(n):
        for r in range(placements):
            owner = (d + r) % n  # device d held device d + r's rows in placement r
            by_unit[r, owner * k : (owner + 1) * k] = prints[d, r]
            flags[r, owner * k : (owner + 1) * k] = bad[d, r]
    rows = jax.tree.leaves(placed)[0].shape[0] // units
    leaves = tuple(
        "params" + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]
    )
    return Rotation(by_unit, flags, k, n, rows, leaves)


#: The probes built so far, per step (compiled on a step's first suspicious step).
_PROBES: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def device_ref(mesh: Any, index: int) -> DeviceRef:
    d = mesh.devices.flat[index]
    return DeviceRef(int(index), int(d.id), int(d.process_index))


def _host(x: jax.Array) -> np.ndarray:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _probe(step: Any, plan: Any, kind: Any, n: int, k: int, placements: int) -> Any:
    """The jitted probe ``(state, placed batch[, key data]) -> (prints, nonfinite)``,
    each ``[devices, placements, units per device, param leaves]``."""
    axes = step.axis_name
    data = axes if len(axes) > 1 else axes[0]
    det = deterministic_of(step.mode)

    def per_device(state: Any, batch: Any, *key: Any) -> tuple[jax.Array, jax.Array]:
        device = jax.lax.axis_index(axes)
        # Device d takes device d + 1's rows: after r shifts it holds device d + r's.
        perm = [(s, (s - 1) % n) for s in range(n)]
        loss = loss_of(step, plan, state, batch)
        grad_fn = value_and_grad(loss, axis_name=axes, has_aux=True, deterministic=det)
        leaves = len(jax.tree.leaves(state.params))
        prints = to_varying(jnp.zeros((placements, k, leaves), jnp.uint32), axes)
        flags = to_varying(jnp.zeros((placements, k, leaves), bool), axes)

        def body(r: jax.Array, carry: Any) -> Any:
            rows, prints, flags = carry
            piece = rows
            if key:  # each unit keeps its own key, wherever it is computed
                owner = (device + r) % n
                piece = _keyed(rows, key[0], owner * k + jnp.arange(k, dtype=jnp.int32), kind)
            _, grads = grad_fn(state.params, piece)
            fp = jnp.stack([jax.vmap(fingerprint)(g) for g in jax.tree.leaves(grads.grads)], 1)
            prints = jax.lax.dynamic_update_index_in_dim(prints, fp, r, 0)
            flags = jax.lax.dynamic_update_index_in_dim(flags, nonfinite_flags(grads), r, 0)
            rows = jax.tree.map(lambda x: jax.lax.ppermute(x, axes, perm), rows)
            return rows, prints, flags

        # One loop body: every placement runs the very same unit program (an
        # unrolled copy could be compiled differently and move bits by itself).
        trips = jax.lax.optimization_barrier(jnp.int32(placements))
        _, prints, flags = jax.lax.fori_loop(0, trips, body, (batch, prints, flags))
        return prints[None], flags[None]

    key_spec = () if kind is None else (P(),)
    body = jax.shard_map(
        per_device, mesh=step.mesh, in_specs=(plan.specs, P(data), *key_spec),
        out_specs=(P(data), P(data)),
    )  # fmt: skip
    body.__name__ = "jaxsync_rotated_units"
    return jax.jit(body)


def _keyed(rows: Any, key_data: jax.Array, pieces: jax.Array, kind: Any) -> Keyed:
    """``rows`` with the keys of the units ``pieces``, as the step's :mod:`rng` gives them."""
    n_rows = jax.tree.leaves(rows)[0].shape[0]
    key = jax.random.wrap_key_data(key_data, impl=kind.impl)
    data = jax.random.key_data(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, pieces))
    keys = jnp.repeat(data, n_rows // pieces.shape[0], axis=0, total_repeat_length=n_rows)
    return Keyed(rows, None, keys, kind)

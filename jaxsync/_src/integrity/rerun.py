"""Running a suspicious step again: a numerical event reproduces, a transient fault does not.

A NaN or a loss spike at scale is either the data, the model or the learning rate
(it comes back when the step is run again on the same state and batch) or a
hardware fault. Megatron-Core's rerun state machine tells them apart by running
the step again; :class:`Rerun` does the same around a :class:`jaxsync.TrainStep`.
It keeps a copy of the state each step starts from, and when a step is skipped
as non-finite, or its loss exceeds ``loss_jump`` times the mean of the recent
ones, runs it again from the copy and compares the two results bit for bit. XLA's
programs are deterministic on the same devices and inputs, so a difference is the
hardware's (on GPUs, barring kernels that use atomics).

A one-off fault is named from what the first run recorded: NaN/Inf per unit, and,
with ``TrainerMetrics(unit_prints=True)``, each unit's gradient fingerprints, which
the rerun's are compared with (the units that differ were computed on the faulty
device).

A device that is wrong every time (the same wrong bits each run) reproduces too.
In deterministic mode (:class:`jaxsync.Deterministic`) a unit's gradient is the
same bits whichever device computes it, so :mod:`.rotation` computes every unit
on other devices as well and names a device whose result moves with it: a
*persistent device fault*, told apart from a numerical event.

What keeping costs: ``keep="device"`` (the default) holds one more copy of the
state on every device (the step donates its state) and copies it once per step;
``keep="host"`` holds it in host memory instead, for a device-to-host copy of the
state each step. The batch is held either way, as the caller's reference.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.bits import as_bits
from ..step.modes import deterministic_of
from .rotation import DeviceRef, Rotation, device_ref, rotated_units

NUMERICAL = "numerical event"
TRANSIENT = "transient fault"
PERSISTENT = "persistent device fault"

NOT_DETERMINISTIC = (
    "outside deterministic mode a device's gradient is a float sum over its own rows, "
    "whose bits depend on which rows and how many, so the same rows on another device "
    "cannot be compared bit for bit; train with `jaxsync.Deterministic(units=...)` to "
    "have the device named"
)
NO_RECORD = (
    "a one-off fault that left every gradient finite leaves no record of which device "
    "computed what (the step records only NaN/Inf, per unit), and it did not come back "
    "when every unit was computed again on other devices; build the step with "
    "`metrics=jaxsync.TrainerMetrics(unit_prints=True)` to record each unit's gradient "
    "fingerprints, which name the device of such a fault"
)
AFTER_GRADIENTS = (
    "every unit's gradient had the same bits in both runs (the step's record of its "
    "units' fingerprints): the fault came after the gradients (the sync, the optimizer "
    "update or the memory holding the state), where the record names no device"
)


@dataclasses.dataclass(frozen=True)
class RerunReport:
    """One step run again.

    Attributes:
      step: the step's number (``state.step`` before it).
      reason: ``"nonfinite"`` (the step was skipped) or ``"loss jump"``.
      reproducible: whether the second run gave the same bits.
      loss: the first run's loss; ``rerun_loss``: the second's.
      differing: state leaves whose bits differ between the runs (paths).
      case: ``"numerical event"`` (data, model, learning rate: it reproduces, and
        every unit gives the same bits on every device), ``"transient fault"`` (it
        does not reproduce) or ``"persistent device fault"`` (it reproduces, but a
        unit's gradient moves with the device that computes it; deterministic mode).
      devices: the devices named, with their place in ``mesh.devices.flat``, id
        and process; empty where none could be.
      units: the units named (deterministic mode): those a named device got wrong,
        or, for a numerical event, those whose gradient holds NaN/Inf everywhere
        (the data); unit ``u`` is global rows ``[u * rows_per_unit, (u + 1) *
        rows_per_unit)`` of the batch.
      grads: param leaves whose unit gradients moved with the device, or (a
        transient fault, ``TrainerMetrics(unit_prints=True)``) whose fingerprints in
        ``state.metrics.unit_prints`` differ between the first run and the rerun.
      where: how the device was named, or why it could not be.
      rows_per_unit: global batch rows per unit (0 outside deterministic mode).
    """

    step: int
    reason: str
    reproducible: bool
    loss: float
    rerun_loss: float
    differing: tuple[str, ...]
    case: str = ""
    devices: tuple[DeviceRef, ...] = ()
    units: tuple[int, ...] = ()
    grads: tuple[str, ...] = ()
    where: str = ""
    rows_per_unit: int = 0

    def __post_init__(self) -> None:
        if not self.case:
            object.__setattr__(self, "case", NUMERICAL if self.reproducible else TRANSIENT)

    def __str__(self) -> str:
        what = {
            NUMERICAL: "a numerical event (data, model or learning rate, not the hardware)",
            TRANSIENT: "a transient fault",
            PERSISTENT: "a persistent device fault",
        }[self.case]
        parts = [f"step {self.step} ({self.reason}, loss {self.loss:.6g}): {what}"]
        if self.reproducible:
            parts[0] += ": the rerun gave the same bits"
        else:
            parts[0] += (
                f": the rerun gave other bits (loss {self.rerun_loss:.6g}; "
                f"{len(self.differing)} state leaves differ, e.g. {list(self.differing[:3])})"
            )
        if self.devices:
            parts.append(f"on {', '.join(map(str, self.devices))}")
        if self.where:
            parts.append(self.where)
        parts.append({
            NUMERICAL: "the step stands",
            TRANSIENT: "training goes on from the rerun",
            PERSISTENT: "the step's result stands as it came: take the device out of the job",
        }[self.case])  # fmt: skip
        return "; ".join(parts)


class Rerun:
    """A :class:`jaxsync.TrainStep` that runs a skipped or spiking step again.

    Args:
      step: the train step.
      loss_jump: rerun a step whose loss exceeds this many times the mean of the
        last ``window`` finite losses (None: only non-finite, skipped steps).
      window: how many recent losses the mean reads.
      keep: where the copy of the state a rerun starts from is kept: ``"device"``
        (one more state per device) or ``"host"`` (none on the devices; the state
        is copied to host memory every step, which waits for it).

    Call it as the step: ``state, loss = rerun(state, batch)``; ``rerun.reports``
    lists what was run again. Each call reads the loss on the host (one sync per
    step) and keeps a copy of the state it starts from. In deterministic mode a
    suspicious step also runs every unit on other devices (a separate program,
    compiled then) to name a device that is wrong every time.

    Example:
      >>> rerun = jaxsync.Rerun(step, loss_jump=3.0)
      >>> for batch in data:
      ...     state, loss = rerun(state, batch)
      >>> for r in rerun.reports:
      ...     print(r)
    """

    def __init__(
        self, step: Any, *, loss_jump: float | None = None, window: int = 20,
        keep: str = "device",
    ):  # fmt: skip
        if loss_jump is not None and (
            isinstance(loss_jump, bool) or not isinstance(loss_jump, int | float) or loss_jump <= 1
        ):
            raise ValueError(f"`loss_jump` must be a number > 1 or None, got {loss_jump!r}.")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"`window` must be a positive int, got {window!r}.")
        if keep not in ("device", "host"):
            raise ValueError(f'`keep` must be "device" or "host", got {keep!r}.')
        self.step, self.loss_jump, self.keep = step, loss_jump, keep
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.reports: list[RerunReport] = []

    def __call__(self, state: Any, batch: Any, **kw: Any) -> tuple[Any, Any]:
        # The step donates `state`: keep a copy of it.
        kept = jax.tree.map(jnp.copy, state) if self.keep == "device" else _to_host(state)
        new, out = self.step(state, batch, **kw)
        # One host read per step: the loss and the skipped flag together.
        loss, skipped = jax.device_get((_loss_of(out), new.metrics.skipped))
        loss = float(loss)
        reason = self._suspicious(bool(skipped), loss)
        if reason is None:
            self.recent.append(loss)
            return new, out
        if self.keep == "host":
            kept = _to_device(kept)
        number = int(jax.device_get(kept.step))  # read only for a step run again
        recorded = _recorded(kept, new)
        rotation, why = self._rotate(kept, batch, kw)  # before the rerun donates `kept`
        again, out2 = self.step(kept, batch, **kw)
        differing = _differing(new, again)
        rerun_loss = float(jax.device_get(_loss_of(out2)))
        report = RerunReport(number, reason, not differing, loss, rerun_loss, differing)
        report = self._name(report, rotation, why, recorded, _prints_moved(new, again))
        self.reports.append(report)
        if report.reproducible:
            return new, out
        if np.isfinite(report.rerun_loss):
            self.recent.append(report.rerun_loss)
        return again, out2  # the fault was the first run's

    def _suspicious(self, skipped: bool, loss: float) -> str | None:
        if skipped or not np.isfinite(loss):
            return "nonfinite"
        jump = self.loss_jump is not None and bool(self.recent)
        if jump and loss > self.loss_jump * float(np.mean(self.recent)):
            return "loss jump"
        return None

    def _rotate(self, kept: Any, batch: Any, kw: dict) -> tuple[Rotation | None, str]:
        """Every unit computed on other devices, or None and why it cannot be."""
        mode = getattr(self.step, "mode", None)
        if mode is None or deterministic_of(mode) is None:
            return None, NOT_DETERMINISTIC
        if _dp_size(self.step) == 1:
            return None, "one device: there is no other device to compute its units"
        return rotated_units(self.step, kept, batch, kw.get("key")), ""

    def _name(
        self,
        report: RerunReport,
        rotation: Rotation | None,
        why: str,
        recorded: tuple[int, ...],
        prints: dict[int, tuple[str, ...]] | None,
    ) -> RerunReport:
        """The case, and the device(s) and unit(s) at fault, or why none is named."""
        mesh = self.step.mesh
        blamed, leaves, ambiguous = rotation.moved() if rotation else ({}, set(), False)
        rows = rotation.rows if rotation else 0
        fields: dict[str, Any] = {"rows_per_unit": rows}
        if blamed:
            units = tuple(sorted({u for us in blamed.values() for u in us}))
            fields.update(
                case=PERSISTENT if report.reproducible else TRANSIENT,
                devices=tuple(device_ref(mesh, d) for d in sorted(blamed)),
                units=units, grads=tuple(sorted(leaves)),
                where=f"units {list(units)} gave other gradient bits (of "
                f"{', '.join(sorted(leaves)[:3])}) there than on the other devices (the rows "
                "placed as usual, then rotated by one and by two devices' shares)"
                + ("; with two devices there is no majority: one of them is at fault"
                   if ambiguous else ""),
            )  # fmt: skip
        elif not report.reproducible and recorded:
            k = _units_per_device(self.step)  # deterministic mode records units
            devices = sorted({u // k for u in recorded}) if k else list(recorded)
            fields.update(
                devices=tuple(device_ref(mesh, d) for d in devices),
                units=recorded if k else (),
                where=(f"its units {list(recorded)} " if k else "its local gradients ")
                + "held NaN/Inf in the first run (the step's record) and not in the rerun",
            )
        elif not report.reproducible and prints:
            k = _units_per_device(self.step)
            units = tuple(sorted(prints))
            leaves = tuple(sorted({leaf for ls in prints.values() for leaf in ls}))
            fields.update(
                devices=tuple(device_ref(mesh, d) for d in sorted({u // k for u in units})),
                units=units, grads=leaves,
                where=f"its units {list(units)} gave other gradient bits (of "
                f"{', '.join(leaves[:3])}) in the first run than in the rerun (the step's "
                "record of its units' fingerprints)",
            )  # fmt: skip
        elif not report.reproducible and prints is not None:
            fields["where"] = AFTER_GRADIENTS
        elif not report.reproducible:
            fields["where"] = "the device cannot be named: " + (why or NO_RECORD)
        elif rotation is not None:
            bad = rotation.nonfinite_units()
            fields.update(
                units=bad,
                where=(
                    f"units {list(bad)} (global rows "
                    + ", ".join(f"{u * rows}-{(u + 1) * rows - 1}" for u in bad[:4])
                    + ") hold NaN/Inf gradients on every device that computes them"
                )
                if bad
                else "every unit gave the same bits on every device",
            )
        return dataclasses.replace(report, **fields)


def _units_per_device(step: Any) -> int:
    """Units each device runs (0 outside deterministic mode)."""
    det = deterministic_of(step.mode) if hasattr(step, "mode") else None
    if det is None:
        return 0
    return det.units // _dp_size(step)


def _dp_size(step: Any) -> int:
    """Devices the step's batch is split over."""
    return int(np.prod([step.mesh.shape[a] for a in step.axis_name]))


def _recorded(kept: Any, new: Any) -> tuple[int, ...]:
    """The first run's record of NaN/Inf local gradients (devices; deterministic mode:
    units), when this step made it (the first of a run of skipped steps)."""
    m = jax.device_get(new.metrics)
    if not bool(m.skipped) or int(jax.device_get(kept.metrics.consecutive_skips)):
        return ()
    first = np.asarray(m.first_nonfinite_device).ravel()
    return tuple(sorted({int(u) for u in first if u >= 0}))


def _prints_moved(new: Any, again: Any) -> dict[int, tuple[str, ...]] | None:
    """``{unit: param leaves}`` whose gradient fingerprints differ between the two runs
    (``state.metrics.unit_prints``); None where the step does not record them."""
    first, second = new.metrics.unit_prints, again.metrics.unit_prints
    if first is None or second is None:
        return None
    a, b = np.asarray(jax.device_get(first)), np.asarray(jax.device_get(second))
    names = [
        "params" + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(new.params)[0]
    ]
    return {
        int(u): tuple(names[leaf] for leaf in np.flatnonzero(a[u] != b[u]))
        for u in np.flatnonzero((a != b).any(axis=1))
    }


class _Host:
    """One array's distinct blocks in host memory, and where each goes back."""

    def __init__(self, x: jax.Array):
        self.shape, self.dtype, self.sharding = x.shape, x.dtype, x.sharding
        blocks: dict[str, np.ndarray] = {}
        self.places = []
        for s in x.addressable_shards:
            key = str(s.index)
            if key not in blocks:  # one host copy per distinct block, not per replica
                blocks[key] = np.asarray(s.data)
            self.places.append((s.device, blocks[key]))


def _to_host(state: Any) -> Any:
    return jax.tree.map(_Host, state)


def _to_device(host: Any) -> Any:
    def back(h: _Host) -> jax.Array:
        arrays = [jax.device_put(a, d) for d, a in h.places]
        return jax.make_array_from_single_device_arrays(h.shape, h.sharding, arrays)

    return jax.tree.map(back, host, is_leaf=lambda x: isinstance(x, _Host))


def _loss_of(out: Any) -> Any:
    """The loss in a step's output (``loss`` or ``(loss, aux)``), still on device."""
    return out[0] if isinstance(out, tuple) else out


def _differing(a: Any, b: Any) -> tuple[str, ...]:
    """Paths of the leaves whose bits differ (a NaN equals a NaN of the same bits).
    Compared on the devices, so that each process reads one replicated bool per
    leaf (several processes: call it on each, as the step)."""
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    pairs = [
        (jax.tree_util.keystr(p), x, y)
        for (p, x), y in zip(flat_a, jax.tree.leaves(b), strict=True)
    ]
    same = jax.device_get(_same_bits([x for _, x, _ in pairs], [y for _, _, y in pairs]))
    return tuple(name for (name, _, _), eq in zip(pairs, same, strict=True) if not eq)


@jax.jit
def _same_bits(xs: list[Any], ys: list[Any]) -> list[jax.Array]:
    return [jnp.array_equal(as_bits(x), as_bits(y)) for x, y in zip(xs, ys, strict=True)]

"""Running a suspicious step again: a numerical event reproduces, a transient fault does not.

A NaN or a loss spike at scale is either the data, the model or the learning rate
(it comes back when the step is run again on the same state and batch) or a
transient hardware fault (it does not). Megatron-Core's rerun state machine tells
them apart by running the step again; :class:`Rerun` does the same around a
:class:`jaxsync.TrainStep`. It keeps a copy of the state each step starts from
(the step donates its state, so the copy costs one more state's memory on every
device, and one copy of it per step in time) and the batch, and when a step is
skipped as non-finite, or its loss exceeds ``loss_jump`` times the mean of the
recent ones, runs it again from the copy and compares the two results bit for
bit. XLA's programs are deterministic on the same devices and inputs, so a
difference is the hardware's (on GPUs, barring kernels that use atomics).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .replicas import as_bits


@dataclasses.dataclass(frozen=True)
class RerunReport:
    """One step run again.

    Attributes:
      step: the step's number (``state.step`` before it).
      reason: ``"nonfinite"`` (the step was skipped) or ``"loss jump"``.
      reproducible: whether the second run gave the same bits: a numerical event
        (data, model, learning rate) when True, a transient fault when False.
      loss: the first run's loss; ``rerun_loss``: the second's.
      differing: state leaves whose bits differ between the runs (paths).
    """

    step: int
    reason: str
    reproducible: bool
    loss: float
    rerun_loss: float
    differing: tuple[str, ...]

    def __str__(self) -> str:
        if self.reproducible:
            return (
                f"step {self.step} ({self.reason}, loss {self.loss:.6g}) ran again to the same "
                "bits: a numerical event (data, model or learning rate), not the hardware"
            )
        return (
            f"step {self.step} ({self.reason}, loss {self.loss:.6g}) ran again to other bits "
            f"(loss {self.rerun_loss:.6g}; {len(self.differing)} state leaves differ, e.g. "
            f"{list(self.differing[:3])}): a transient fault; training goes on from the rerun"
        )


class Rerun:
    """A :class:`jaxsync.TrainStep` that runs a skipped or spiking step again.

    Args:
      step: the train step.
      loss_jump: rerun a step whose loss exceeds this many times the mean of the
        last ``window`` finite losses (None: only non-finite, skipped steps).
      window: how many recent losses the mean reads.

    Call it as the step: ``state, loss = rerun(state, batch)``; ``rerun.reports``
    lists what was run again. Each call reads the loss on the host (one sync per
    step) and keeps a copy of the state it starts from.

    Example:
      >>> rerun = jaxsync.Rerun(step, loss_jump=3.0)
      >>> for batch in data:
      ...     state, loss = rerun(state, batch)
      >>> for r in rerun.reports:
      ...     print(r)
    """

    def __init__(self, step: Any, *, loss_jump: float | None = None, window: int = 20):
        if loss_jump is not None and (
            isinstance(loss_jump, bool) or not isinstance(loss_jump, int | float) or loss_jump <= 1
        ):
            raise ValueError(f"`loss_jump` must be a number > 1 or None, got {loss_jump!r}.")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"`window` must be a positive int, got {window!r}.")
        self.step, self.loss_jump = step, loss_jump
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.reports: list[RerunReport] = []

    def __call__(self, state: Any, batch: Any, **kw: Any) -> tuple[Any, Any]:
        kept = jax.tree.map(jnp.copy, state)  # the step donates `state`
        new, out = self.step(state, batch, **kw)
        loss = _loss(out)
        reason = self._suspicious(new, loss)
        if reason is None:
            self.recent.append(loss)
            return new, out
        number = int(jax.device_get(kept.step))  # read only for a step run again
        again, out2 = self.step(kept, batch, **kw)
        differing = _differing(new, again)
        report = RerunReport(number, reason, not differing, loss, _loss(out2), differing)
        self.reports.append(report)
        if report.reproducible:
            return new, out
        if np.isfinite(report.rerun_loss):
            self.recent.append(report.rerun_loss)
        return again, out2  # the fault was the first run's

    def _suspicious(self, state: Any, loss: float) -> str | None:
        if bool(jax.device_get(state.metrics.skipped)) or not np.isfinite(loss):
            return "nonfinite"
        jump = self.loss_jump is not None and bool(self.recent)
        if jump and loss > self.loss_jump * float(np.mean(self.recent)):
            return "loss jump"
        return None


def _loss(out: Any) -> float:
    loss = out[0] if isinstance(out, tuple) else out
    return float(jax.device_get(loss))


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

"""Slow processes named: each process times its own loop, and every K steps the
processes compare.

In a data-parallel job every process waits for the slowest at the step's
collectives, and a loop that reads the loss waits there too, so the slow process
is not the one whose steps take longest (they all do) but the one whose *own*
work between steps is longest: loading and placing the next batch, logging,
whatever the loop or the step's own host side (checks, dispatch) does. :class:`Stragglers` wraps a
:class:`jaxsync.TrainStep` and measures that: on the last ``window`` steps of
every ``every`` it waits for the step's result before returning, so that the
time until the next step is dispatched is the host's own work and no waiting
on the others. The
steps in between run as they do without it (no host sync added). At the K-th
step the processes' medians are gathered (one small all-gather, the only
communication it adds) and a process whose host time is ``threshold`` times the
median of all of them is named. A device that computes slowly holds back every
process alike and is not what this names.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class StragglerReport:
    """One comparison of the processes' loops.

    Attributes:
      step: the step count at the comparison.
      host_ms: per process, the median of its host's own work from a step's
        result to the next step dispatched (ms), over the measured steps.
      slow: ``(process, times the median)`` of each process named slow.
    """

    step: int
    host_ms: tuple[float, ...]
    slow: tuple[tuple[int, float], ...]

    def __str__(self) -> str:
        if not self.slow:
            return f"step {self.step}: no straggler (host ms per process {self._fmt()})"
        named = ", ".join(f"process {p} ({r:.1f}x the median)" for p, r in self.slow)
        return (
            f"step {self.step}: {named} spend(s) the longest on the host between steps "
            f"(loading batches, logging); host ms per process {self._fmt()}"
        )

    def _fmt(self) -> str:
        return "[" + ", ".join(f"{t:.1f}" for t in self.host_ms) + "]"


class Stragglers:
    """A :class:`jaxsync.TrainStep` that times its loop and names slow processes.

    Args:
      step: the train step.
      every: compare the processes every this many steps (every process must
        call the wrapped step the same number of times, as a training loop does).
      threshold: name a process whose median time outside the step is this many
        times the median over all processes.
      min_ms: and at least this many milliseconds above it (noise on idle loops).

    ``stragglers.reports`` holds every comparison (with several processes, the
    same on each). The last ``min(5, every - 1)`` steps of each ``every`` wait for
    their result before returning (a host sync on those steps only).

    Example:
      >>> timed = jaxsync.Stragglers(step, every=100)
      >>> state, loss = timed(state, batch)
      >>> if timed.reports and timed.reports[-1].slow: print(timed.reports[-1])
    """

    def __init__(self, step: Any, *, every: int = 100, threshold: float = 1.5,
                 min_ms: float = 2.0):  # fmt: skip
        if isinstance(every, bool) or not isinstance(every, int) or every < 2:
            raise ValueError(f"`every` must be an int >= 2 (steps per comparison), got {every!r}.")
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or threshold <= 1:
            raise ValueError(f"`threshold` must be a number > 1, got {threshold!r}.")
        self.step, self.every, self.threshold, self.min_ms = step, every, threshold, min_ms
        self.window = min(5, every - 1)
        self.reports: list[StragglerReport] = []
        self._host: list[float] = []
        self._ready: float | None = None  # when the last measured step's result was ready
        self._count = 0

    def __call__(self, state: Any, batch: Any, **kw: Any) -> tuple[Any, Any]:
        out = self.step(state, batch, **kw)
        if self._ready is not None:  # the host's own work from the last result to this
            self._host.append(time.perf_counter() - self._ready)  # step dispatched
            self._ready = None
        self._count += 1
        position = self._count % self.every
        if position == 0:
            self.reports.append(self._compare())
            self._host = []
        elif position >= self.every - self.window:  # the next call's gap is measured
            jax.block_until_ready(out)
            self._ready = time.perf_counter()
        return out

    def _compare(self) -> StragglerReport:
        mine = np.array([np.median(self._host) if self._host else 0.0], np.float32) * 1e3
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            host = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
        else:
            host = mine
        med = float(np.median(host))
        slow = tuple(
            (p, float(h / med) if med > 0 else float("inf"))
            for p, h in enumerate(host)
            if h > self.threshold * med and h - med > self.min_ms
        )
        return StragglerReport(self._count, tuple(map(float, host)), slow)

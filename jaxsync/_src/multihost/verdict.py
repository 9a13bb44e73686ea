"""The hang watchdog's rules, without threads or RPCs: the phases a process reports,
the timeouts, who holds a job up (:func:`decide`) and the report that names them.

Pure functions of what every process last published (:class:`Seen`), so that they
are tested on their own; :mod:`.watchdog` runs them in each process.
"""

from __future__ import annotations

import os
from typing import NamedTuple

#: Exit code of a process the watchdog ends (EX_TEMPFAIL: restart from a checkpoint).
HANG_EXIT_CODE = 75
#: Read by :func:`jaxsync.initialize` when ``hang_timeout`` is not given.
ENV_HANG_TIMEOUT = "JAXSYNC_HANG_TIMEOUT"
#: Read by :func:`jaxsync.initialize` when ``first_step_timeout`` is not given.
ENV_FIRST_STEP_TIMEOUT = "JAXSYNC_FIRST_STEP_TIMEOUT"
#: The first step's allowance (set-up, compilation) when neither says: 10 minutes,
#: or ``hang_timeout`` if that is longer.
FIRST_STEP_TIMEOUT = 600.0
START, DATA, STEP, CHECKPOINT = "start", "data", "forward/backward", "checkpoint"
#: The phase of a process whose script has ended (it waits in JAX's shutdown): its
#: heartbeat stops without its being dead.
EXITED = "exited"
#: The cross-process comparisons of :mod:`.consistency` (at ``init``, the first step).
CHECK = "cross-process check"
_DEAD = "dead, stopped or frozen"


class Seen(NamedTuple):
    """One process as a watcher sees it; ages in seconds on the watcher's clock."""

    rank: int
    step: int
    phase: str
    done: int  # steps its device has finished
    beat_age: float  # since its heartbeat counter last changed
    pos_age: float  # since its (step, phase) last changed


class Verdict(NamedTuple):
    why: str  # "silent", "behind" or "together"
    named: tuple[int, ...]


def decide(seen: list[Seen], timeout: float, first_step: float | None = None) -> Verdict | None:
    """Who holds the job up, from what every process last published (pure).

    A process whose heartbeat stood still for ``timeout`` is dead or stopped, unless
    its last record said that its script ended (:data:`EXITED`). Else
    the processes furthest behind (lowest step; at equal steps between steps
    before inside one) that have not moved for ``timeout`` while another is ahead
    hold the others up. Else, all at one place for ``timeout`` are stuck together,
    inside a collective or a step. Processes whose device has not finished a step
    yet (set-up, compilation) get ``first_step`` (default: :func:`first_step_from`)
    instead of ``timeout``.
    """
    first_step = first_step_from(first_step, timeout)
    silent = tuple(s.rank for s in seen if s.beat_age > timeout and s.phase != EXITED)
    if silent:
        return Verdict("silent", silent)
    lowest = min(_order(s) for s in seen)
    behind = [s for s in seen if _order(s) == lowest]
    # Set-up before the first step (model init, compilation) has its own allowance.
    limit = first_step if all(s.done == 0 for s in behind) else timeout
    if any(s.pos_age <= limit for s in behind):
        return None
    why = "behind" if len(behind) < len(seen) else "together"
    return Verdict(why, tuple(s.rank for s in behind))


def _order(s: Seen) -> tuple[int, int]:
    # set-up before any step < between steps (or in a check) < inside the step
    return (s.step, 2 if s.phase == STEP else 0 if s.phase == START else 1)


def report(
    verdict: Verdict,
    seen: list[Seen],
    timeout: float,
    me: int,
    first_step: float | None = None,
    limit: str = "hang_timeout",
) -> str:
    """The message a verdict prints: who, at which step and phase, for how long."""
    by_rank = {s.rank: s for s in seen}
    named = ", ".join(str(r) for r in verdict.named)
    first = by_rank[verdict.named[0]]
    if verdict.why == "silent":
        head = (
            f"process(es) {named} stopped answering: no heartbeat for {first.beat_age:.1f}s "
            f"({_DEAD}), last seen at {where(first)}"
        )
    elif verdict.why == "behind":
        head = (
            f"process(es) {named} did not arrive: stuck at {where(first)} for "
            f"{first.pos_age:.1f}s while the others are ahead and wait for it"
        )
        if first.beat_age > timeout / 3:  # live ones beat every timeout / 10 s
            head += f"; its heartbeat stopped too, {first.beat_age:.1f}s ago ({_DEAD})"
    else:
        head = (
            f"every process has been at {where(first)} for {first.pos_age:.1f}s: none is "
            "behind, so the step itself does not finish somewhere (a process stuck inside "
            "it, e.g. in a host callback, or a step longer than the timeout); see the "
            "Python stacks"
        )
    if verdict.why != "silent" and first.done == 0:
        head += (
            f" (before its first step finished: first_step_timeout="
            f"{first_step_from(first_step, timeout):g}s)"
        )
    lines = [
        f"jaxsync hang watchdog (process {me}, {limit}={timeout:g}s): {head}. "
        f"Exiting with code {HANG_EXIT_CODE}."
    ]
    for s in seen:
        who = " (this process)" if s.rank == me else ""
        lines.append(
            f"  process {s.rank}{who}: {where(s)}; moved {s.pos_age:.1f}s ago, "
            f"heartbeat {s.beat_age:.1f}s ago"
        )
    return "\n".join(lines)


def where(s: Seen) -> str:
    if s.phase != STEP and s.done < s.step:  # dispatched, but its device is not done
        return f"step {s.done}, phase {STEP} (device; host already at step {s.step}, {s.phase})"
    return f"step {s.step}, phase {s.phase}"


def _seconds(value: float | None, env: str, what: str) -> float | None:
    """``value``, else the environment variable ``env``; None when neither is set."""
    if value is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return None
        what = f"{env}={text!r}"
        try:
            value = float(text)
        except ValueError:
            value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(
            f"{what} must be a number of seconds >= 0 (0: off), above the longest step, "
            f"compilation and checkpoint save; got {value!r}."
        )
    return float(value)


def timeout_from(hang_timeout: float | None) -> float | None:
    """``hang_timeout``, else :data:`ENV_HANG_TIMEOUT`; None when off (unset or 0)."""
    return _seconds(hang_timeout, ENV_HANG_TIMEOUT, "`hang_timeout`") or None


def first_step_from(first_step_timeout: float | None, timeout: float | None) -> float:
    """The first step's allowance: ``first_step_timeout``, else
    :data:`ENV_FIRST_STEP_TIMEOUT`, else the longer of :data:`FIRST_STEP_TIMEOUT`
    and ``timeout``; 0 means no limit."""
    got = _seconds(first_step_timeout, ENV_FIRST_STEP_TIMEOUT, "`first_step_timeout`")
    if got is None:
        return max(FIRST_STEP_TIMEOUT, timeout or 0.0)
    return got or float("inf")

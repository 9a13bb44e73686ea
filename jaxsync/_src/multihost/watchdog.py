"""A hang names itself: every process exits, naming who did not arrive, where.

When one process of a multi-process run stops (stuck in user code, deadlocked,
SIGSTOPped, dead without the coordinator noticing), the others wait in the next
collective forever, and XLA cannot be interrupted from Python. So, with a
``hang_timeout``, each process runs two daemon threads:

- the *publisher* writes this process's heartbeat counter, its (step, phase) and
  how many steps its device has finished into the coordination service's
  key-value store every ``timeout / 10`` s (at most 2 s), and reads everyone's;
- the *judge* applies :func:`decide` to what was read. Ages are measured on this
  process's own clock from when a value last *changed*: no clocks are compared
  across hosts. On a verdict it prints the report and this process's Python
  stacks to stderr and ends the process with :data:`HANG_EXIT_CODE` through
  ``os._exit`` (the only way out of a blocked collective).

The training thread only assigns a tuple (:func:`run_step`, :func:`phase`): no
RPC sits on the step's path, and the step counter is read from the device once per
state it did not return itself (the first step, a restored state). The optimizer
update runs in the step's one XLA program, so it is reported as forward/backward.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

#: Exit code of a process the watchdog ends (EX_TEMPFAIL: restart from a checkpoint).
HANG_EXIT_CODE = 75
#: Read by :func:`jaxsync.initialize` when ``hang_timeout`` is not given.
ENV_HANG_TIMEOUT = "JAXSYNC_HANG_TIMEOUT"
START, DATA, STEP, CHECKPOINT = "start", "data", "forward/backward", "checkpoint"
_KEY = "jaxsync/hang/"
_DEAD = "dead, stopped or frozen"

# Written by the training thread only; read by the watchdog's threads.
_pos: tuple[int, str] = (0, START)
_last_step: tuple[Any, int] | None = None  # (the step array the last step returned, its value)
_pending: collections.deque = collections.deque(maxlen=64)  # (step, loss) not seen finished
_watch: _Watch | None = None


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


def decide(seen: list[Seen], timeout: float) -> Verdict | None:
    """Who holds the job up, from what every process last published (pure).

    A process whose heartbeat stood still for ``timeout`` is dead or stopped. Else
    the processes furthest behind (lowest step; at equal steps between steps
    before inside one) that have not moved for ``timeout`` while another is ahead
    hold the others up. Else, all at one place for ``timeout`` are stuck together,
    inside a collective or a step. Set-up before a process's first step is not timed.
    """
    silent = tuple(s.rank for s in seen if s.beat_age > timeout)
    if silent:
        return Verdict("silent", silent)
    lowest = min(_order(s) for s in seen)
    behind = [s for s in seen if _order(s) == lowest]
    if behind[0].phase == START or any(s.pos_age <= timeout for s in behind):
        return None  # set-up before the first step (model init, compilation) is not timed
    why = "behind" if len(behind) < len(seen) else "together"
    return Verdict(why, tuple(s.rank for s in behind))


def _order(s: Seen) -> tuple[int, int]:
    return (s.step, 1 if s.phase == STEP else 0)


def report(verdict: Verdict, seen: list[Seen], timeout: float, me: int) -> str:
    """The message a verdict prints: who, at which step and phase, for how long."""
    by_rank = {s.rank: s for s in seen}
    named = ", ".join(str(r) for r in verdict.named)
    first = by_rank[verdict.named[0]]
    if verdict.why == "silent":
        head = (
            f"process(es) {named} stopped answering: no heartbeat for {first.beat_age:.1f}s "
            f"({_DEAD}), last seen at {_where(first)}"
        )
    elif verdict.why == "behind":
        head = (
            f"process(es) {named} did not arrive: stuck at {_where(first)} for "
            f"{first.pos_age:.1f}s while the others are ahead and wait for it"
        )
        if first.beat_age > timeout / 3:  # live ones beat every timeout / 10 s
            head += f"; its heartbeat stopped too, {first.beat_age:.1f}s ago ({_DEAD})"
    else:
        head = (
            f"every process has been at {_where(first)} for {first.pos_age:.1f}s: none is "
            "behind, so the step itself does not finish somewhere (a process stuck inside "
            "it, e.g. in a host callback, or a step longer than the timeout); see the "
            "Python stacks"
        )
    lines = [
        f"jaxsync hang watchdog (process {me}, hang_timeout={timeout:g}s): {head}. "
        f"Exiting with code {HANG_EXIT_CODE}."
    ]
    for s in seen:
        who = " (this process)" if s.rank == me else ""
        lines.append(
            f"  process {s.rank}{who}: {_where(s)}; moved {s.pos_age:.1f}s ago, "
            f"heartbeat {s.beat_age:.1f}s ago"
        )
    return "\n".join(lines)


def _where(s: Seen) -> str:
    if s.phase != STEP and s.done < s.step:  # dispatched, but its device is not done
        return f"step {s.done}, phase {STEP} (device; host already at step {s.step}, {s.phase})"
    return f"step {s.step}, phase {s.phase}"


def run_step(fn: Callable[[Any, Any], Any], state: Any, batch: Any) -> Any:
    """``fn(state, batch)`` (returning ``(state, loss)``), marked as step ``state.step``."""
    global _pos, _last_step
    if _watch is None:
        return fn(state, batch)
    step = state.step
    if _last_step is not None and _last_step[0] is step:
        n = _last_step[1]
    else:  # a state this process did not step before: read its counter once
        n = int(step.addressable_data(0))
    _pos = (n, STEP)
    out = fn(state, batch)
    _last_step = (out[0].step, n + 1)
    _pending.append((n + 1, out[1]))
    _pos = (n + 1, DATA)
    return out


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Marks the enclosed code (or decorated function) as phase ``name`` of this step."""
    global _pos
    before = _pos
    _pos = (before[0], name)
    try:
        yield
    finally:
        _pos = (_pos[0], before[1])


def timeout_from(hang_timeout: float | None) -> float | None:
    """``hang_timeout``, else :data:`ENV_HANG_TIMEOUT`; None when off (unset or 0)."""
    what = "`hang_timeout`"
    if hang_timeout is None:
        text = os.environ.get(ENV_HANG_TIMEOUT, "").strip()
        if not text:
            return None
        what = f"{ENV_HANG_TIMEOUT}={text!r}"
        try:
            hang_timeout = float(text)
        except ValueError:
            hang_timeout = -1.0
    if not hang_timeout >= 0:  # also NaN
        raise ValueError(
            f"{what} must be a number of seconds >= 0 (0: off), above the longest step, "
            f"compilation and checkpoint save; got {hang_timeout!r}."
        )
    return float(hang_timeout) or None


def start(hang_timeout: float | None, process_id: int, num_processes: int) -> None:
    """Starts the watchdog for a multi-process run (idempotent; off without a timeout)."""
    global _watch
    timeout = timeout_from(hang_timeout)
    if timeout is None or num_processes < 2 or _watch is not None:
        return
    from jax._src.distributed import global_state

    _watch = _Watch(global_state.client, process_id, num_processes, timeout)
    for target, name in ((_watch.publish, "publisher"), (_watch.judge, "judge")):
        threading.Thread(target=target, name=f"jaxsync-hang-{name}", daemon=True).start()


class _Watch:
    def __init__(self, client: Any, rank: int, nproc: int, timeout: float):
        self.client, self.rank, self.timeout = client, rank, timeout
        self.interval = min(timeout / 10, 2.0)
        now = time.monotonic()
        # rank -> [published text, beat, beat changed at, (step, phase), moved at, done]
        self.table = {r: ["", -1, now, (0, START), now, 0] for r in range(nproc)}
        self.answered = now  # when the key-value store last answered
        self.done = 0

    def _finished(self) -> int:
        while _pending:
            n, loss = _pending[0]
            with contextlib.suppress(Exception):  # a deleted loss was finished
                if not loss.is_ready():
                    break
            self.done = n
            _pending.popleft()
        return self.done

    def publish(self) -> None:
        beat = 0
        while True:
            beat += 1
            step, where = _pos
            text = json.dumps([beat, step, where, self._finished()])
            try:  # blocks while the coordinator (in process 0) is stopped: the judge sees it
                self.client.key_value_set(f"{_KEY}{self.rank}", text, allow_overwrite=True)
                entries = self.client.key_value_dir_get(_KEY)
            except Exception:  # its absence of answers is what the judge looks at
                time.sleep(self.interval)
                continue
            now = time.monotonic()
            for key, value in entries:
                row = self.table.get(int(key.rsplit("/", 1)[1]))
                if row is None or row[0] == value:
                    continue
                b, s, p, d = json.loads(value)
                if b != row[1]:
                    row[1], row[2] = b, now
                if (s, p) != row[3]:
                    row[3], row[4] = (s, p), now
                row[0], row[5] = value, d
            self.answered = now
            time.sleep(self.interval)

    def seen(self, now: float) -> list[Seen]:
        return [
            Seen(r, row[3][0], row[3][1], row[5], now - row[2], now - row[4])
            for r, row in sorted(self.table.items())
        ]

    def judge(self) -> None:
        while True:
            time.sleep(self.interval)
            now = time.monotonic()
            seen = self.seen(now)
            if now - self.answered > self.timeout and self.rank != 0:
                # The coordination service lives in process 0: it is stopped or frozen.
                seen = [s._replace(beat_age=now - self.answered) if s.rank == 0 else s
                        for s in seen]  # fmt: skip
                verdict: Verdict | None = Verdict("silent", (0,))
            else:
                verdict = decide(seen, self.timeout)
            if verdict is not None:
                text = report(verdict, seen, self.timeout, self.rank)
                if now - self.answered > self.timeout / 3 and self.rank != 0:
                    quiet = now - self.answered
                    text += f"\n  (the coordination service in process 0: silent for {quiet:.1f}s)"
                self.fail(text)

    def fail(self, message: str) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            sys.stdout.flush()
        if self.rank == 0:  # hosts the coordination service, whose loss JAX answers by
            time.sleep(2 * self.interval + 0.5)  # aborting the others: let them report
        os._exit(HANG_EXIT_CODE)

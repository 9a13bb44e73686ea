"""A hang names itself: every process exits, naming who did not arrive, where.

In every multi-process run started by :func:`jaxsync.initialize` a *monitor*
runs (two daemon threads, below): it publishes this process's heartbeat and
position and reads every process's, with the fault records of :mod:`.faults`,
about once a second. A process that reads another's fault record exits at once,
naming it. With a ``hang_timeout`` the monitor also judges hangs:

When one process of a multi-process run stops (stuck in user code, deadlocked,
SIGSTOPped, dead without the coordinator noticing), the others wait in the next
collective forever, and XLA cannot be interrupted from Python. So each process
runs two daemon threads:

- the *publisher* writes this process's heartbeat counter, its (step, phase) and
  how many steps its device has finished into the coordination service's
  key-value store every ``timeout / 10`` s (at most 2 s), and reads everyone's;
- the *judge* applies :func:`decide` to what was read. Ages are measured on this
  process's own clock from when a value last *changed*: no clocks are compared
  across hosts. On a verdict it prints the report and this process's Python
  stacks to stderr and ends the process with :data:`HANG_EXIT_CODE` through
  ``os._exit`` (the only way out of a blocked collective).

The first step (until this process's device has finished one) gets
``first_step_timeout`` instead of ``hang_timeout``: it includes compilation, and
a process that never reaches it (stuck in set-up) while the others wait is named
once it runs out. Without a ``hang_timeout`` the judge names only that and a
process whose heartbeat stopped for ``JAXSYNC_DEAD_TIMEOUT`` seconds (dead).

The training thread only assigns a tuple (:func:`run_step`, :func:`phase`) and
compares the batch's shapes with the last step's: no RPC sits on the step's
path unless the shapes changed (then :mod:`.shapes` asks whether every process's
did), and the step counter is read from the device once per state it did not
return itself (the first step, a restored state). The optimizer update runs in
the step's one XLA program, so it is reported as forward/backward.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import faults, shapes
from .verdict import (  # noqa: F401 (the watchdog's names, for callers and tests)
    CHECK,
    CHECKPOINT,
    DATA,
    ENV_FIRST_STEP_TIMEOUT,
    ENV_HANG_TIMEOUT,
    EXITED,
    FIRST_STEP_TIMEOUT,
    HANG_EXIT_CODE,
    START,
    STEP,
    Seen,
    Verdict,
    _seconds,
    decide,
    first_step_from,
    report,
    timeout_from,
    where,
)

#: How often the monitor publishes and reads without a ``hang_timeout``, seconds.
MONITOR_INTERVAL = 1.0
#: Without a ``hang_timeout``: a process whose heartbeat stood still this long (seconds)
#: is dead, killed or frozen, and the others exit naming it. Read from the environment.
ENV_DEAD_TIMEOUT = "JAXSYNC_DEAD_TIMEOUT"
DEAD_TIMEOUT = 30.0
_KEY = "jaxsync/hang/"

# Written by the training thread only; read by the watchdog's threads.
_pos: tuple[int, str] = (0, START)
_last_step: tuple[Any, int] | None = None  # (the step array the last step returned, its value)
_pending: collections.deque = collections.deque(maxlen=64)  # (step, loss) not seen finished
_watch: _Watch | None = None
_shapes: dict[Any, tuple] = {}  # step function -> its last batch's (shape, dtype)s


def run_step(fn: Callable[[Any, Any], Any], state: Any, batch: Any) -> Any:
    """``fn(state, batch)`` (returning ``(state, loss)``), marked as step ``state.step``.

    Raises:
      ValueError: the batch's shapes changed on this process and not on every process
        alike (:mod:`.shapes`; the others are told through a fault record).
    """
    global _pos, _last_step
    if _watch is None:
        return fn(state, batch)
    step = state.step
    if _last_step is not None and _last_step[0] is step:
        n = _last_step[1]
    else:  # a state this process did not step before: read its counter once
        n = int(step.addressable_data(0))
    now = shapes.signature(batch)
    before = _shapes.get(fn)
    if before != now:  # a host-side comparison: the only cost when nothing changed
        _shapes[fn] = now
        if before is not None:
            shapes.check_changed(_watch, n, before, now)
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


def start(
    hang_timeout: float | None,
    process_id: int,
    num_processes: int,
    first_step_timeout: float | None = None,
) -> None:
    """Starts the monitor of a multi-process run (idempotent), judging hangs when a
    timeout is set."""
    global _watch
    timeout = timeout_from(hang_timeout)
    first = first_step_from(first_step_timeout, timeout)
    if num_processes < 2 or _watch is not None:
        return
    from jax._src.distributed import global_state

    _watch = _Watch(global_state.client, process_id, num_processes, timeout, first)
    for target, name in ((_watch.publish, "publisher"), (_watch.judge, "judge")):
        thread = threading.Thread(target=target, name=f"jaxsync-hang-{name}", daemon=True)
        _watch.threads.append(thread)
        thread.start()
    # Registered after JAX's own exit handler (jax is imported by now), so it runs
    # first: JAX then frees its clients with no thread of ours inside them.
    atexit.register(stop)


def stop(timeout: float = 5.0) -> None:
    """Stops the monitor and waits (up to ``timeout`` s) for its threads to leave.

    Runs at interpreter exit, before JAX's exit handler frees its runtime clients:
    a daemon thread still inside a jaxlib call then (an RPC, an array's
    ``is_ready``) is ended by the interpreter's finalization mid-call, which
    aborts the process (``FATAL: exception not rethrown``) after it finished.
    """
    global _watch, _last_step
    watch = _watch
    if watch is None or watch.failing.is_set():  # fail() ends the process itself
        return
    watch.stopping.set()
    end = time.monotonic() + timeout
    for thread in watch.threads:
        if thread is not threading.current_thread():
            thread.join(max(0.0, end - time.monotonic()))
    if not watch.closed():  # the others' judges: its heartbeat stops, it is not dead
        with contextlib.suppress(Exception):
            set_key = watch.client.key_value_set
            faults.call(set_key, f"{_KEY}{watch.rank}", watch.text(EXITED), True, timeout=2.0)
    _watch, _last_step = None, None
    _pending.clear()  # the last steps' arrays: freed now, while JAX still runs


class _Watch:
    def __init__(self, client: Any, rank: int, nproc: int, timeout: float | None, first: float):
        self.client, self.rank, self.nproc, self.timeout = client, rank, nproc, timeout
        self.first = first
        dead = _seconds(None, ENV_DEAD_TIMEOUT, ENV_DEAD_TIMEOUT)
        self.dead = DEAD_TIMEOUT if dead is None else dead or float("inf")  # 0: off
        self.interval = min(timeout / 10, 2.0) if timeout else MONITOR_INTERVAL
        now = time.monotonic()
        # rank -> [published text, beat, beat changed at, (step, phase), moved at, done]
        self.table = {r: ["", -1, now, (0, START), now, 0] for r in range(nproc)}
        self.answered = now  # when the key-value store last answered
        self.done = 0
        self.faults: dict[int, dict] = {}  # fault records, as last read
        self.quit = threading.Event()  # set while this process reports its own failure
        self.failing = threading.Event()  # set once fail() runs: it ends the process
        self.stopping = threading.Event()  # set by stop(): the threads leave
        self.beat = 0
        self.threads: list[threading.Thread] = []

    def _finished(self) -> int:
        while _pending:
            n, loss = _pending[0]
            with contextlib.suppress(Exception):  # a deleted loss was finished
                if not loss.is_ready():
                    break
            self.done = n
            _pending.popleft()
        return self.done

    def positions(self, entries: list[tuple[str, str]]) -> dict[int, tuple[int, str]]:
        """(step, phase) by rank, from ``key_value_dir_get`` entries."""
        out = {}
        for key, value in entries:
            if key.startswith(_KEY):
                with contextlib.suppress(ValueError, TypeError, IndexError):
                    _, s, p, _ = json.loads(value)
                    out[int(key.rsplit("/", 1)[1])] = (s, p)
        return out

    def closed(self) -> bool:
        """Whether the script shut JAX's distributed runtime down: nothing to watch."""
        from jax._src.distributed import global_state

        return global_state.client is not self.client

    def text(self, phase_name: str | None = None) -> str:
        """This process's next heartbeat record: [beat, step, phase, steps done]."""
        self.beat += 1
        step, now = _pos
        return json.dumps([self.beat, step, phase_name or now, self._finished()])

    def publish(self) -> None:
        while not self.closed() and not self.stopping.is_set():
            text = self.text()
            try:  # blocks while the coordinator (in process 0) is stopped: the judge sees it
                self.client.key_value_set(f"{_KEY}{self.rank}", text, allow_overwrite=True)
                entries = self.client.key_value_dir_get("jaxsync/")
            except Exception:  # its absence of answers is what the judge looks at
                self.stopping.wait(self.interval)
                continue
            now = time.monotonic()
            for key, value in entries:
                if not key.startswith(_KEY):
                    continue
                row = self.table.get(int(key.rsplit("/", 1)[1]))
                if row is None or row[0] == value:
                    continue
                b, s, p, d = json.loads(value)
                if b != row[1]:
                    row[1], row[2] = b, now
                if (s, p) != row[3]:
                    row[3], row[4] = (s, p), now
                row[0], row[5] = value, d
            self.faults = faults.parse(entries)
            self.answered = now
            self.stopping.wait(self.interval)

    def seen(self, now: float) -> list[Seen]:
        return [
            Seen(r, row[3][0], row[3][1], row[5], now - row[2], now - row[4])
            for r, row in sorted(self.table.items())
        ]

    def judge(self) -> None:
        while not self.stopping.wait(self.interval):
            if self.closed():
                return
            rec = faults.first(self.faults, self.rank, hangs=False)
            if rec is not None and not self.quit.is_set():
                faults.blame(self.rank, rec["rank"], faults.describe(rec))
                self.fail(faults.peer_failed(rec, self.rank), faults.PEER_EXIT_CODE, rec["rank"])
            now = time.monotonic()
            seen = self.seen(now)
            # Without a hang_timeout: the dead, and a process that never reaches its
            # first step while the others wait for it (first_step_timeout).
            limit, name = self.timeout or self.dead, "hang_timeout"
            if now - self.answered > limit and self.rank != 0:
                # The coordination service lives in process 0: it is stopped or frozen.
                seen = [s._replace(beat_age=now - self.answered) if s.rank == 0 else s
                        for s in seen]  # fmt: skip
                verdict: Verdict | None = Verdict("silent", (0,))
            elif self.timeout:
                verdict = decide(seen, self.timeout, self.first)
            else:
                silent = tuple(s.rank for s in seen if s.beat_age > limit and s.phase != EXITED)
                verdict, name = Verdict("silent", silent) if silent else None, ENV_DEAD_TIMEOUT
                late = decide(seen, float("inf"), self.first)  # first steps only
                if verdict is None and late is not None and late.why == "behind":
                    verdict, limit, name = late, self.first, "first_step_timeout"
            if verdict is not None and not self.quit.is_set():  # else: the error hook reports
                text = report(verdict, seen, limit, self.rank, self.first, name)
                if now - self.answered > limit / 3 and self.rank != 0:
                    quiet = now - self.answered
                    text += f"\n  (the coordination service in process 0: silent for {quiet:.1f}s)"
                culprit = self.rank if self.rank in verdict.named else verdict.named[0]
                if verdict.why == "together":  # no one to blame: each sees it for itself
                    culprit = -1
                elif culprit != self.rank:
                    faults.blame(self.rank, culprit, text.split("\n")[0])
                self.fail(text, HANG_EXIT_CODE, culprit)

    def fail(self, message: str, code: int, culprit: int) -> None:
        """Says ``message``, publishes it as a fault (caused by ``culprit``'s unless
        that is this process; -1: by none, shared by all), exits with ``code``."""
        self.quit.set()
        self.failing.set()
        step, at = _pos
        after = None if culprit == self.rank else culprit
        line = message.split("\n")[0][:500]
        rec = faults.record(self.rank, step, at, line, after, code == HANG_EXIT_CODE)
        faults.publish(self.rank, rec)
        with contextlib.suppress(Exception):
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            if code == HANG_EXIT_CODE:
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
            sys.stdout.flush()
        if self.rank == 0:  # hosts the coordination service, whose loss JAX answers by
            time.sleep(2 * self.interval + 0.5)  # aborting the others: let them report
        os._exit(code)

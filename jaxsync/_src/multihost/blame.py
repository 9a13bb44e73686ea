"""Who is at fault when this process fails: itself, or another one it names.

Called from :func:`jaxsync.initialize`'s exception hook (after the traceback is
printed), and from a SIGABRT handler when JAX aborts a process because the
coordination service is gone ("PollForError"), in a multi-process run whose
monitor runs (:mod:`.watchdog`). A process whose own fault it is publishes it (:mod:`.faults`);
one whose error only says that a collective broke (gloo's "Connection reset by
peer") first looks, for a few seconds, for the process at fault: one that
published a fault, one whose heartbeat stopped (killed), or the coordinator, gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from typing import Any

from . import faults, watchdog


def culprit(w: Any, wait: float) -> tuple[int, str] | None:
    """Another process at fault, within ``wait`` s: one that published a fault, one
    whose heartbeat stopped (killed), or the coordinator, gone (None: none seen)."""
    deadline = time.monotonic() + wait
    stale = max(3 * w.interval, 4.0)
    while True:
        try:
            recs = faults.read()
        except Exception as e:
            if w.rank != 0:
                return 0, faults.coordinator_gone(str(e), w.faults.get(0))
            recs = {}
        rec = faults.first(recs, w.rank)
        if rec is not None:
            return rec["rank"], faults.describe(rec)
        now = time.monotonic()
        for s in w.seen(now):
            if s.rank != w.rank and s.beat_age > stale:
                return s.rank, (
                    f"process {s.rank} stopped answering: no heartbeat for {s.beat_age:.1f}s "
                    f"and no error published, so it was killed or crashed (SIGKILL, out of "
                    f"memory, a segfault), last seen at {watchdog.where(s)}"
                )
        if now >= deadline:
            return None
        time.sleep(0.25)


# An error that says only that a collective or the runtime broke: the process at
# fault may be another one, which it is worth waiting a few seconds to learn.
_SECONDHAND = ("gloo", "onnection", "UNAVAILABLE", "DEADLINE", "Broken pipe", "ocket")
_RUNTIME = ("XlaRuntimeError", "JaxRuntimeError")


def on_uncaught(kind: type[BaseException], value: BaseException, code: int) -> int:
    """After an uncaught exception's traceback: names the process at fault and
    returns the exit code (:data:`faults.PEER_EXIT_CODE` when it is another one).

    This process's own fault is published for the others (process 0, whose exit
    ends the coordination service, then waits for them to read it)."""
    w = watchdog._watch
    if w is None:
        return code
    if w.failing.is_set():  # the monitor reports already, and ends this process
        time.sleep(60)
        return code
    w.quit.set()  # the judge must not end this process while it reports
    what = f"{kind.__name__}: {value}"
    secondhand = kind.__name__ in _RUNTIME or any(word in what for word in _SECONDHAND)
    found = culprit(w, max(3 * w.interval, 4.0) + w.interval + 1.0) if secondhand else None
    step, where = watchdog._pos
    if found is None:
        faults.publish(w.rank, faults.record(w.rank, step, where, what[:500]))
        if w.rank == 0:  # let the others read it before the service ends with this process
            time.sleep(2 * w.interval + 0.5)
        return code
    rank, why = found
    faults.say(
        f"jaxsync (process {w.rank}): the error above follows from another process's "
        f"failure: {why}. Exiting with code {faults.PEER_EXIT_CODE}."
    )
    faults.publish(w.rank, faults.record(w.rank, step, where, what[:500], after=rank))
    faults.blame(w.rank, rank, why)
    return faults.PEER_EXIT_CODE


_handlers: list[Any] = []  # the C handler must outlive its installation


def note_aborts(rank: int) -> None:
    """Names the coordinator's loss when JAX aborts this process (not process 0).

    When process 0 dies, JAX's client in every other process polls the error and
    aborts (SIGABRT, "PollForError"), naming no process and before any Python code
    can run: a C-level SIGABRT handler (through ctypes) says first whether the
    coordinator still accepts connections, then lets the abort go on.
    """
    if rank == 0 or _handlers or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_abort)
        _handlers.append(handler)
        libc.signal(signal.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))


def _on_abort(signum: int) -> None:
    with contextlib.suppress(Exception):
        w = watchdog._watch
        from jax._src.distributed import global_state

        address = getattr(global_state, "coordinator_address", None) or ""
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=0.5):
                gone = False
        except (OSError, ValueError):
            gone = True
        if gone:
            last = w.faults.get(0) if w is not None else None
            why = faults.coordinator_gone(f"nothing listens at {address} any more", last)
        else:
            why = (
                "JAX's coordination service (in process 0) reported an error; process 0 "
                "still accepts connections, so another process may have failed: see their output"
            )
        me = w.rank if w is not None else "?"
        if w is not None and gone:
            faults.blame(w.rank, 0, why.split(". ")[0])
        os.write(2, f"\njaxsync (process {me}): JAX aborts this process: {why}\n".encode())

"""The launcher's side of each process it starts: its output, its exit, its first raise,
whom it blames, and its end when the launcher dies.

One thread per process pumps its output to the launcher's, each line prefixed with
the rank, and notes when the process first printed a traceback (when it raised,
which can be well before it exits: JAX's shutdown runs after). One thread per
process waits for it, so exits are queued in the order they happen.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, NamedTuple

from .faults import blamed

TRACEBACK = b"Traceback (most recent call last)"


class Exit(NamedTuple):
    """A process that ended: when (launcher's clock), which rank, its exit code."""

    time: float
    rank: int
    code: int


def pump(
    rank: int, stream: IO[bytes], out: IO[str], lock: threading.Lock, raised: dict[int, float]
) -> None:
    """Copies a process's lines to ``out``, prefixed with its rank. A line repeated
    at once is written once and then counted: a crash that prints one line from
    every thread (``terminate called recursively``) must not push the line that says
    why out of a log's tail."""
    last, repeats = b"", 0

    def write(text: str) -> None:
        with lock:
            out.write(f"[{rank}] {text}")
            out.flush()

    def flush_repeats() -> None:
        if repeats == 1:
            write(last.decode(errors="replace"))
        elif repeats:
            write(f"(the line above {repeats} more times)\n")

    for line in iter(stream.readline, b""):
        if line.startswith(TRACEBACK):
            raised.setdefault(rank, time.monotonic())  # when it first raised
        if line == last:
            repeats += 1
            continue
        flush_repeats()
        last, repeats = line, 0
        write(line.decode(errors="replace"))
    flush_repeats()


def wait(rank: int, proc: subprocess.Popen, exits: queue.Queue) -> None:
    # One waiter per process, so exits are seen in the order they happen.
    code = proc.wait()
    exits.put(Exit(time.monotonic(), rank, code))


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` by which the child gets SIGKILL when the launcher dies (Linux).

    SIGTERM and SIGINT reach the processes through the launcher (forwarded, then
    SIGKILL after the grace period), but a launcher killed with SIGKILL (a
    scheduler's hard limit, the OOM killer) forwards nothing: without this its
    processes would run on, orphaned, until a collective failed. (SIGTERM would not
    do here: JAX's preemption service catches SIGTERM in every process.)
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the call took effect
            os._exit(1)

    return preexec


def culprit(launch_dir: str, rank: int) -> tuple[int, str] | None:
    """The process that ``rank`` ended because of, following the chain of blame
    (a process that named another; see :func:`faults.blame`); None: its own fault."""
    seen, found = {rank}, None
    while (named := blamed(launch_dir, rank)) is not None and named[0] not in seen:
        found, rank = named, named[0]
        seen.add(rank)
    return found


def check_args(
    nproc: int,
    devices_per_proc: int | None,
    port: int | None,
    timeout: float | None,
    grace: float,
    init_timeout: float,
    stall_timeout: float,
) -> None:
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"`--nproc` must be an integer >= 1, got {nproc!r}.")
    if devices_per_proc is not None and (
        not isinstance(devices_per_proc, int) or devices_per_proc < 1
    ):
        raise ValueError(
            f"`--devices-per-proc` must be an integer >= 1 (CPU devices simulated in each "
            f"process), got {devices_per_proc!r}; leave it out to use the real devices."
        )
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"`--port` must be in 1..65535, got {port!r}.")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"`--timeout` must be positive (seconds), got {timeout!r}.")
    if not grace >= 0:
        raise ValueError(f"`--grace` must be >= 0 (seconds), got {grace!r}.")
    if not init_timeout >= 0:
        raise ValueError(
            f"`--init-timeout` must be >= 0 (seconds; 0: no limit), got {init_timeout!r}."
        )
    if not stall_timeout >= 0:
        raise ValueError(
            f"`--stall-timeout` must be >= 0 (seconds; 0: no limit), got {stall_timeout!r}."
        )

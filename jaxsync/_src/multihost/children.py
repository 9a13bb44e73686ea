"""The launcher's side of each process it starts: its output, its exit, its first raise.

One thread per process pumps its output to the launcher's, each line prefixed with
the rank, and notes when the process first printed a traceback (when it raised,
which can be well before it exits: JAX's shutdown runs after). One thread per
process waits for it, so exits are queued in the order they happen.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
from typing import IO, NamedTuple

TRACEBACK = b"Traceback (most recent call last)"


class Exit(NamedTuple):
    """A process that ended: when (launcher's clock), which rank, its exit code."""

    time: float
    rank: int
    code: int


def pump(
    rank: int, stream: IO[bytes], out: IO[str], lock: threading.Lock, raised: dict[int, float]
) -> None:
    for line in iter(stream.readline, b""):
        if line.startswith(TRACEBACK):
            raised.setdefault(rank, time.monotonic())  # when it first raised
        with lock:
            out.write(f"[{rank}] {line.decode(errors='replace')}")
            out.flush()


def wait(rank: int, proc: subprocess.Popen, exits: queue.Queue) -> None:
    # One waiter per process, so exits are seen in the order they happen.
    code = proc.wait()
    exits.put(Exit(time.monotonic(), rank, code))


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"

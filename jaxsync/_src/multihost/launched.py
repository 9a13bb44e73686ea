"""What a process started by ``python -m jaxsync.launch`` tells the launcher.

The launcher cannot see inside its processes, and three failures look alike
from outside: a script that never calls :func:`jaxsync.initialize` (each process
then trains alone, as "process 0" of a job of its own), a process stuck in a
collective because another one is stuck elsewhere, and a process still busy.
So, once :func:`jaxsync.initialize` has joined the job, each process

- writes ``connected.<rank>`` into the launcher's directory;
- keeps ``alive.<rank>`` fresh while its main thread makes progress (a daemon
  thread samples the main thread's current Python frame once a second: a frame
  or instruction that has not changed means no progress, which is what a
  process waiting in a collective that never completes looks like), with the
  place it was last seen at;
- prints the Python stack of every thread on ``SIGUSR1``, which the launcher
  sends before it stops a stalled job.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import sysconfig
import threading
import time
from types import FrameType

#: How often the main thread's progress is sampled, in seconds.
INTERVAL = 1.0

# Frames in these directories are library internals: the place reported is the
# innermost frame outside them (the user's line that called into JAX).
_LIBRARY_DIRS = tuple(
    {
        os.path.normpath(path) + os.sep
        for name, path in sysconfig.get_paths().items()
        if name in ("stdlib", "platstdlib", "purelib", "platlib") and path
    }
    | {os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep}
)


def connected_marker(launch_dir: str, process_id: int) -> str:
    """The file by which process ``process_id`` tells the launcher it joined the job."""
    return os.path.join(launch_dir, f"connected.{process_id}")


def alive_marker(launch_dir: str, process_id: int) -> str:
    """The file whose age says how long process ``process_id`` has made no progress."""
    return os.path.join(launch_dir, f"alive.{process_id}")


def _place(frame: FrameType) -> str:
    inner = frame
    f: FrameType | None = frame
    while f is not None:
        if not os.path.abspath(f.f_code.co_filename).startswith(_LIBRARY_DIRS):
            inner = f
            break
        f = f.f_back
    return f"{inner.f_code.co_filename}:{inner.f_lineno} in {inner.f_code.co_name}"


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # the launcher never reads half a line


def _watch(path: str) -> None:
    main = threading.main_thread()
    last = None
    while main.is_alive():
        frame = sys._current_frames().get(main.ident)
        if frame is not None:
            seen = (id(frame), frame.f_lasti)
            if seen != last:
                last = seen
                _write(path, _place(frame))
        del frame
        time.sleep(INTERVAL)


def report_to_launcher(launch_dir: str, process_id: int) -> None:
    """Marks this process as joined and starts reporting its progress (idempotent)."""
    if not os.path.isdir(launch_dir):
        return
    marker = connected_marker(launch_dir, process_id)
    if os.path.exists(marker):
        return
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    _write(alive_marker(launch_dir, process_id), "jaxsync.initialize")
    threading.Thread(
        target=_watch,
        args=(alive_marker(launch_dir, process_id),),
        name="jaxsync-progress",
        daemon=True,
    ).start()
    _write(marker, str(os.getpid()))

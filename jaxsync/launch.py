"""A local launcher in the spirit of ``torchrun``: N processes on 127.0.0.1.

    python -m jaxsync.launch --nproc 2 --devices-per-proc 4 examples/train_gpt.py --steps 50

Each process gets the coordinator address, the process count and its id in the
environment (read by :func:`jaxsync.initialize`); with ``--devices-per-proc``
each also simulates that many CPU devices. Output lines are prefixed with the
rank. The job ends, with a message naming the rank, as soon as it cannot
finish: when a process exits with an error (the first one to fail is blamed;
the others are stopped after a grace period), when a process ends without ever
calling ``jaxsync.initialize()`` (it would have trained alone), when a process
has not joined the job within ``--init-timeout``, when a process has made no
progress for ``--stall-timeout`` (its Python stack is printed first: a process
stuck somewhere and the processes waiting for it in a collective all stall, and
the stacks show which is which), and when ``--timeout`` passes. A process that
ends because another one failed (its watchdog or error hook names it, see
:mod:`jaxsync._src.multihost.faults`) puts the blame on that one. A process that
finishes while others still run is reported. SIGTERM, SIGINT and SIGHUP sent
to the launcher are passed on to every process, which is then stopped the same
way (SIGKILL after ``--grace``), and a launcher killed outright (SIGKILL) takes
its processes with it (Linux: each asks the kernel for SIGKILL when the
launcher dies), so no process outlives the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from jaxsync._src.multihost import children
from jaxsync._src.multihost.distributed import (
    ENV_COORDINATOR,
    ENV_LAUNCH_DIR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from jaxsync._src.multihost.launched import alive_marker, connected_marker

#: Exit code when the job is stopped by ``--timeout`` or ``--stall-timeout``.
TIMEOUT_CODE = 124
#: Exit code when a process did not join the job (no ``jaxsync.initialize()``).
NOT_JOINED_CODE = 1

_PREFIX = "jaxsync.launch: "
NO_INITIALIZE = (
    "process {rank} exited with code 0 without calling jaxsync.initialize(), so it ran "
    "as a single-process job of its own instead of one of {nproc} processes training "
    "together. Call jaxsync.initialize() at the top of the script, before any JAX "
    "computation."
)
NOT_JOINED = (
    "process(es) {ranks} did not call jaxsync.initialize() within --init-timeout="
    "{limit:g}s. Call it at the top of the script, before any JAX computation (or raise "
    "--init-timeout if the script needs longer before it can start, 0 to wait forever)."
)
STALLED = (
    "no progress for {limit:g}s (--stall-timeout) in process(es) {ranks}: {where}. A "
    "process waiting in a collective for a stuck one stalls too; their Python stacks "
    "are printed above. Stopping the job (raise --stall-timeout if a step or a "
    "compilation really takes that long, 0 to never stop)."
)
# Survivors idle for longer than this are named when another process fails.
_IDLE = 10.0
# After a failed exit, how long the other processes get to end too before the
# launcher says which failed first (a peer whose collective fails on the closed
# connection can exit before the process that raised has finished shutting down).
_SETTLE = 2.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    argv: list[str],
    *,
    nproc: int,
    devices_per_proc: int | None = None,
    port: int | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
    init_timeout: float = 300.0,
    stall_timeout: float = 900.0,
    env: dict[str, str] | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """Runs ``python argv...`` in ``nproc`` processes; returns the job's exit code.

    Args:
      argv: the script and its arguments.
      nproc: number of processes.
      devices_per_proc: simulate this many CPU devices in each process.
      port: the coordinator's port (default: a free one).
      timeout: stop everything after this many seconds (exit code 124).
      grace: after the job has failed, seconds the remaining processes get to
        end on their own after SIGTERM, before SIGKILL.
      init_timeout: stop the job when some process has not called
        ``jaxsync.initialize()`` this many seconds after the start (0: no limit).
      stall_timeout: stop the job when a process's main thread has made no
        progress (has been in the same Python frame at the same instruction)
        for this many seconds (0: no limit); see :mod:`jaxsync._src.multihost.launched`.
      env: the processes' base environment (default: this one's).
      out, err: where the processes' output and the launcher's messages go.

    Returns:
      0 when every process exited with 0; else the code of the first process
      that failed, 124 on ``timeout`` or ``stall_timeout``, 128 + the signal's number when the
      launcher was signalled, 1 when a process did not join the job.
    """
    children.check_args(nproc, devices_per_proc, port, timeout, grace, init_timeout, stall_timeout)
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    port = port or free_port()
    with tempfile.TemporaryDirectory(prefix="jaxsync-launch-") as launch_dir:
        return _Job(argv, nproc, devices_per_proc, port, env, launch_dir, out, err).run(
            timeout, grace, init_timeout, stall_timeout
        )


class _Job:
    def __init__(
        self,
        argv: list[str],
        nproc: int,
        devices_per_proc: int | None,
        port: int,
        env: dict[str, str] | None,
        launch_dir: str,
        out: IO[str],
        err: IO[str],
    ):
        self.nproc, self.launch_dir, self.out, self.err = nproc, launch_dir, out, err
        self.lock = threading.Lock()
        self.exits: queue.Queue[children.Exit] = queue.Queue()
        self.signalled: list[int] = []
        self.passed_to: list[int] = []  # the processes running when the first signal came
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.raised: dict[int, float] = {}  # rank -> when its first traceback came
        base = dict(os.environ if env is None else env)
        for rank in range(nproc):
            penv = dict(base)
            penv.update(
                {
                    ENV_COORDINATOR: f"127.0.0.1:{port}",
                    ENV_NUM_PROCESSES: str(nproc),
                    ENV_PROCESS_ID: str(rank),
                    ENV_LAUNCH_DIR: launch_dir,
                    "PYTHONUNBUFFERED": "1",
                }
            )
            if devices_per_proc:
                flags = " ".join(
                    f
                    for f in penv.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count")
                )
                penv["XLA_FLAGS"] = (
                    f"{flags} --xla_force_host_platform_device_count={devices_per_proc}".strip()
                )
                penv.setdefault("JAX_PLATFORMS", "cpu")
            # A session of its own, so that stopping it stops whatever it started;
            # signals to the launcher are passed on explicitly.
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=penv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=children.die_with_parent(os.getpid()),
                )
            )
        for rank, p in enumerate(self.procs):
            pump = threading.Thread(
                target=children.pump,
                args=(rank, p.stdout, out, self.lock, self.raised),
                daemon=True,
            )
            pump.start()
            self.pumps.append(pump)
            threading.Thread(target=children.wait, args=(rank, p, self.exits), daemon=True).start()

    def say(self, message: str) -> None:
        with self.lock:
            self.err.write(_PREFIX + message + "\n")
            self.err.flush()

    def joined(self, rank: int) -> bool:
        return os.path.exists(connected_marker(self.launch_dir, rank))

    def running(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.poll() is None]

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Pass it on at once (Ctrl-C reaches only the launcher: the processes
        # run in sessions of their own); the main loop then stops the job.
        if not self.signalled:  # the processes it reached (they may end at once)
            self.passed_to = self.running()
        self.signalled.append(signum)
        self.signal_all(signum)

    def run(
        self, timeout: float | None, grace: float, init_timeout: float, stall_timeout: float
    ) -> int:
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            code = self._watch(timeout, init_timeout, stall_timeout)
        finally:
            # From here on a second Ctrl-C must not leave processes behind.
            try:
                self._stop(grace)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        return code

    def stalled(self, limit: float) -> dict[int, tuple[float, str]]:
        """Running processes with no progress for over ``limit`` s: (seconds, where)."""
        out = {}
        for rank in self.running():
            path = alive_marker(self.launch_dir, rank)
            try:
                age = time.time() - os.path.getmtime(path)
                if age > limit:
                    with open(path) as f:
                        out[rank] = (age, f.read().strip() or "?")
            except FileNotFoundError:  # not joined yet: --init-timeout's business
                continue
        return out

    def _watch(self, timeout: float | None, init_timeout: float, stall_timeout: float) -> int:
        start = time.monotonic()
        finished: list[int] = []
        while True:
            if self.signalled:
                sig = self.signalled[0]
                self.say(
                    f"received {signal.Signals(sig).name}; passed it on to processes "
                    f"{self.passed_to} and stopping them."
                )
                return 128 + sig
            try:
                ended = self.exits.get(timeout=0.1)
            except queue.Empty:
                ended = None
            if self.signalled:  # a process ended by the signal passed on: say the signal
                continue
            now = time.monotonic()
            if ended is not None:
                self.pumps[ended.rank].join(timeout=2.0)  # its last lines first
                if ended.code != 0:
                    ended = self._first_failure(ended)
                    code, how = ended.code, f"exited with code {ended.code}"
                    if code < 0:  # killed by a signal: the shell's convention, 128 + signal
                        code = 128 - code
                        how = (
                            f"was killed by {children.signal_name(-ended.code)} (exit code {code})"
                        )
                    running = self.running()
                    note = "" if self.joined(ended.rank) else " (before jaxsync.initialize())"
                    # It may have ended because of another's failure, which it named.
                    named = children.culprit(self.launch_dir, ended.rank)
                    # A process stuck elsewhere makes the others fail (a collective
                    # times out): say which of the survivors had stopped progressing.
                    idle = "".join(
                        f" Process {r} had made no progress for {age:.0f}s (at {where})."
                        for r, (age, where) in sorted(self.stalled(_IDLE).items())
                    )
                    # The others may have ended already (a peer's collective fails
                    # fast once this one's connection closes).
                    rest = (
                        f"stopping process(es) {running}, which were still running."
                        if running
                        else "no other process was still running."
                    )
                    first = f"process {ended.rank} failed first: it"
                    if named is not None:
                        first = (
                            f"process {named[0]} failed first: {named[1]}. Process "
                            f"{ended.rank} ended because of it: it"
                        )
                    self.say(f"{first} {how}{note} after {ended.time - start:.1f}s; {rest}{idle}")
                    return code
                if self.nproc > 1 and not self.joined(ended.rank):
                    self.say(NO_INITIALIZE.format(rank=ended.rank, nproc=self.nproc))
                    return NOT_JOINED_CODE
                finished.append(ended.rank)
                if len(finished) == self.nproc:
                    return 0
                self.say(
                    f"process {ended.rank} finished (exit code 0) after {now - start:.1f}s "
                    f"while process(es) {self.running()} still run."
                )
                continue
            if timeout is not None and now - start > timeout:
                self.say(
                    f"timed out after {timeout:g}s (--timeout); stopping process(es) "
                    f"{self.running()}."
                )
                return TIMEOUT_CODE
            if init_timeout and self.nproc > 1 and now - start > init_timeout:
                missing = [r for r in range(self.nproc) if not self.joined(r)]
                if missing:
                    self.say(NOT_JOINED.format(ranks=missing, limit=init_timeout))
                    return NOT_JOINED_CODE
            stalled = self.stalled(stall_timeout) if stall_timeout else {}
            if stalled:
                for rank in stalled:  # faulthandler prints its stack (see launched.py)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.procs[rank].pid, signal.SIGUSR1)
                time.sleep(1.0)
                where = "; ".join(f"process {r} at {w}" for r, (_, w) in sorted(stalled.items()))
                self.say(STALLED.format(limit=stall_timeout, ranks=sorted(stalled), where=where))
                return TIMEOUT_CODE

    def _first_failure(self, ended: children.Exit) -> children.Exit:
        """Of the processes that fail within ``_SETTLE`` s of ``ended``, the one that
        failed first: by its first traceback where it printed one (a process that
        raises may exit after the peer whose collective then failed), else its exit."""
        failed, deadline = [ended], time.monotonic() + _SETTLE
        while True:
            # While others run, wait for them; once none does, take the exits already
            # queued (or about to be: a waiter thread puts its exit just after).
            waiting = bool(self.running()) and time.monotonic() < deadline
            try:
                other = self.exits.get(timeout=0.1 if waiting else 0.2)
            except queue.Empty:
                if waiting:
                    continue
                break
            self.pumps[other.rank].join(timeout=2.0)
            if other.code != 0:
                failed.append(other)
        first = min(failed, key=lambda e: min(self.raised.get(e.rank, e.time), e.time))
        # The process the first one names (its fault record) failed before it, whatever
        # the clock says: its traceback can reach the launcher after the peer's exit.
        named = children.culprit(self.launch_dir, first.rank)
        by_rank = {e.rank: e for e in failed}
        return by_rank.get(named[0], first) if named is not None else first

    def _stop(self, grace: float) -> None:
        if not self.running():
            return
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        stuck = self.running()
        if stuck:
            self.say(f"process(es) {stuck} still running {grace:g}s after SIGTERM; killing them.")
            self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for pump in self.pumps:
            pump.join(timeout=2.0)


def main(args: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxsync.launch", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--nproc", type=int, required=True, help="number of processes")
    ap.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        help="simulate this many CPU devices in each process",
    )
    ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    ap.add_argument("--timeout", type=float, default=None, help="stop everything after this many s")
    ap.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="once the job failed, seconds the others get after SIGTERM before SIGKILL",
    )
    ap.add_argument(
        "--init-timeout",
        type=float,
        default=300.0,
        help="stop when a process has not called jaxsync.initialize() after this many s (0: never)",
    )
    ap.add_argument(
        "--stall-timeout",
        type=float,
        default=900.0,
        help="stop when a process has made no progress for this many s (0: never)",
    )
    ap.add_argument("script", help="the Python script to run")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = ap.parse_args(args)
    try:
        return launch(
            [ns.script, *ns.script_args],
            nproc=ns.nproc,
            devices_per_proc=ns.devices_per_proc,
            port=ns.port,
            timeout=ns.timeout,
            grace=ns.grace,
            init_timeout=ns.init_timeout,
            stall_timeout=ns.stall_timeout,
        )
    except ValueError as e:
        ap.error(str(e))  # exits with code 2 and the usage line, like other bad arguments
        raise


if __name__ == "__main__":
    sys.exit(main())

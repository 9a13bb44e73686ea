"""A local launcher in the spirit of ``torchrun``: N processes on 127.0.0.1.

    python -m jaxsync.launch --nproc 2 --devices-per-proc 4 examples/train_gpt.py --steps 50

Each process gets the coordinator address, the process count and its id in the
environment (read by :func:`jaxsync.initialize`); with ``--devices-per-proc``
each also simulates that many CPU devices. Output lines are prefixed with the
rank. If any process fails, the others are stopped and the launcher exits with
that process's code and a message saying which rank failed, instead of leaving
the rest hanging in a collective that will never complete.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxsync._src.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(rank: int, stream, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[{rank}] {line.decode(errors='replace')}")
        out.flush()


def launch(
    argv: list[str],
    *,
    nproc: int,
    devices_per_proc: int | None = None,
    port: int | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Runs ``python argv...`` in ``nproc`` processes; returns the exit code."""
    if nproc < 1:
        raise ValueError(f"`--nproc` must be at least 1, got {nproc}.")
    port = port or free_port()
    procs = []
    base = dict(os.environ if env is None else env)
    for rank in range(nproc):
        penv = dict(base)
        penv.update(
            {
                ENV_COORDINATOR: f"127.0.0.1:{port}",
                ENV_NUM_PROCESSES: str(nproc),
                ENV_PROCESS_ID: str(rank),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if devices_per_proc:
            flags = penv.get("XLA_FLAGS", "")
            flags = " ".join(
                f
                for f in flags.split()
                if not f.startswith("--xla_force_host_platform_device_count")
            )
            penv["XLA_FLAGS"] = (
                f"{flags} --xla_force_host_platform_device_count={devices_per_proc}".strip()
            )
            penv.setdefault("JAX_PLATFORMS", "cpu")
        p = subprocess.Popen(
            [sys.executable, *argv],
            env=penv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(p)
        threading.Thread(target=_pump, args=(rank, p.stdout, sys.stdout), daemon=True).start()

    start, code = time.monotonic(), 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                sys.stderr.write(
                    f"jaxsync.launch: process {rank} exited with code {code}; stopping the "
                    f"other {nproc - 1} process(es).\n"
                )
                break
            if all(c == 0 for c in codes):
                return 0
            if timeout is not None and time.monotonic() - start > timeout:
                sys.stderr.write(f"jaxsync.launch: timed out after {timeout:.0f}s; stopping.\n")
                code = 124
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        code = 130
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return code


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
    ap.add_argument("script", help="the Python script to run")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = ap.parse_args(args)
    return launch(
        [ns.script, *ns.script_args],
        nproc=ns.nproc,
        devices_per_proc=ns.devices_per_proc,
        port=ns.port,
        timeout=ns.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())

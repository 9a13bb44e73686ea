"""Multi-host start-up: ``jax.distributed.initialize`` with sensible defaults.

One call at the top of a training script, before any JAX computation. Alone it
does nothing; under ``python -m jaxsync.launch`` it reads the launcher's
environment; on a cluster that JAX knows (SLURM, Open MPI, Kubernetes...) it
lets JAX detect the coordinator and ranks; explicit arguments win over both.
On CPU it selects gloo collectives, without which cross-process CPU
collectives are not available.

In a multi-process run, an exception that nobody catches ends the process at
once (after printing it): JAX's shutdown at exit waits for every other process,
so a failed process would otherwise stay alive until the others time out, and
neither the launcher nor the cluster could tell which one failed. Before it
ends, it says which process is at fault (:mod:`.blame`): itself (published for
the others to name, :mod:`.faults`), or another one, when its error only says
that a collective broke.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import NamedTuple

import jax

from . import blame, watchdog
from .launched import report_to_launcher

#: Environment variables set by ``python -m jaxsync.launch`` for each process.
ENV_COORDINATOR = "JAXSYNC_COORDINATOR"
ENV_NUM_PROCESSES = "JAXSYNC_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSYNC_PROCESS_ID"
#: The launcher's directory, where each process reports that it joined and progresses.
ENV_LAUNCH_DIR = "JAXSYNC_LAUNCH_DIR"


# Variables whose presence means a cluster launched us with several tasks.
_CLUSTER_HINTS = {
    "SLURM_NTASKS": "SLURM",
    "OMPI_COMM_WORLD_SIZE": "Open MPI",
    "PMI_SIZE": "MPICH/PMI",
    "JOBSET_NAME": "Kubernetes JobSet",
}


class ProcessInfo(NamedTuple):
    """Where this process stands after :func:`initialize`."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int
    how: str


def _cluster() -> str | None:
    for var, name in _CLUSTER_HINTS.items():
        value = os.environ.get(var)
        if value is not None and (not value.isdigit() or int(value) > 1):
            return name
    return None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str = "gloo",
    exit_on_error: bool = True,
    hang_timeout: float | None = None,
    first_step_timeout: float | None = None,
) -> ProcessInfo:
    """Starts JAX's multi-process runtime when this is a multi-process run.

    Args:
      coordinator_address: ``host:port`` of process 0; with ``num_processes`` and
        ``process_id`` this forces an explicit start.
      num_processes: total number of processes.
      process_id: this process's rank.
      local_device_ids: restrict this process to these local devices.
      cpu_collectives: CPU collectives implementation for cross-process runs.
      exit_on_error: in a multi-process run, end this process right after an
        uncaught exception is printed (exit code 1, 130 for Ctrl-C) instead of
        waiting in JAX's shutdown for the other processes. Checkpoint saves
        still in flight are not finished then (the last complete one stays).
      hang_timeout: in a multi-process run, seconds after which a job that makes
        no progress ends: every process exits with code 75, naming the
        process(es) that did not arrive, the step and the phase (see
        :mod:`jaxsync._src.multihost.watchdog`). Default: the environment
        variable ``JAXSYNC_HANG_TIMEOUT``, else off; 0 is off. Set it above the
        longest step, compilation, evaluation and checkpoint save.
      first_step_timeout: in a multi-process run, the allowance of everything
        before a process's first step has finished on its device (set-up, data
        loading, compilation), in seconds, instead of ``hang_timeout``: a
        process that hangs before its first step while the others wait for it
        is named once it runs out, with or without ``hang_timeout``. Default:
        the environment variable ``JAXSYNC_FIRST_STEP_TIMEOUT``, else 600 s or
        ``hang_timeout`` if longer; 0 is no limit. (Without ``hang_timeout``, a
        process whose heartbeat stops for ``JAXSYNC_DEAD_TIMEOUT`` s, default
        30, is named as dead too; see :mod:`jaxsync._src.multihost.faults`.)

    Returns:
      A :class:`ProcessInfo`; ``how`` says which path was taken.
    """
    explicit = [coordinator_address, num_processes, process_id]
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ValueError(
            "pass all of `coordinator_address`, `num_processes` and `process_id`, or none "
            f"of them (got {coordinator_address!r}, {num_processes!r}, {process_id!r})."
        )
    how = "single process"
    if coordinator_address is None and os.environ.get(ENV_COORDINATOR):
        coordinator_address = os.environ[ENV_COORDINATOR]
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
        process_id = int(os.environ[ENV_PROCESS_ID])
        how = "jaxsync.launch"
    elif coordinator_address is not None:
        how = "explicit"
    cluster = _cluster() if coordinator_address is None else None

    if coordinator_address is not None or cluster is not None:
        if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
            jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        if not jax.distributed.is_initialized():
            if cluster is not None:
                jax.distributed.initialize(local_device_ids=local_device_ids)
                how = cluster
            else:
                jax.distributed.initialize(
                    coordinator_address=coordinator_address,
                    num_processes=num_processes,
                    process_id=process_id,
                    local_device_ids=local_device_ids,
                )
    info = ProcessInfo(
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        how,
    )
    if exit_on_error and info.num_processes > 1:
        _exit_on_uncaught_exception()
        _exit_now_on_failure_code()
    watchdog.start(hang_timeout, info.process_id, info.num_processes, first_step_timeout)
    if info.num_processes > 1:
        blame.note_aborts(info.process_id)
    launch_dir = os.environ.get(ENV_LAUNCH_DIR)
    if how == "jaxsync.launch" and launch_dir:
        report_to_launcher(launch_dir, info.process_id)
    return info


def _exit_on_uncaught_exception() -> None:
    previous = sys.excepthook
    if getattr(previous, "_jaxsync_exits", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        code = 130 if issubclass(kind, KeyboardInterrupt) else 1
        try:
            previous(kind, value, tb)
            code = blame.on_uncaught(kind, value, code)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # a closed stream must not keep us
                    stream.flush()
            os._exit(code)

    hook._jaxsync_exits = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _exit_now_on_failure_code() -> None:
    """``sys.exit(code)`` with a failure code ends the process at once, with that code.

    Otherwise the interpreter's exit waits in JAX's shutdown barrier for the other
    processes, which go on until a collective fails for want of this one: another
    process then fails first, with another code, and the launcher blames it.
    (``SystemExit`` raised by hand still takes the slow path.)
    """
    previous = sys.exit
    if getattr(previous, "_jaxsync_exits", False):
        return

    def exit_now(status: object = None) -> None:
        if status is None or status == 0:
            previous(status)
            return
        code = status if isinstance(status, int) else 1
        if not isinstance(status, int):
            with contextlib.suppress(Exception):  # what sys.exit(message) writes
                sys.stderr.write(f"{status}\n")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)

    exit_now._jaxsync_exits = True  # type: ignore[attr-defined]
    sys.exit = exit_now

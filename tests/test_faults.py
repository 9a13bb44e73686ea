"""Faults mid-run name themselves: with 2 real processes on 127.0.0.1 (gloo), bare
and under ``python -m jaxsync.launch``, every process exits within a bounded time,
with a nonzero code, naming the process at fault and the step or phase: a batch
that changes shape on one process at a later step, a process that hangs before
its first step, a process that raises or is killed, the coordinator killed, the
launcher killed, and the hang's blame under the launcher."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxsync._src.multihost import faults, shapes
from jaxsync._src.multihost.children import culprit
from jaxsync._src.multihost.faults import PEER_EXIT_CODE
from jaxsync._src.multihost.watchdog import (
    CHECK,
    DATA,
    HANG_EXIT_CODE,
    START,
    STEP,
    Seen,
    Verdict,
    decide,
    first_step_from,
    report,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AT = 3  # the step at which the fault happens
LIMIT = 60.0  # no run below may take longer (seconds)

# One tiny DDP loop. `mode` says which process does what at step AT (or before
# the first step); everything else trains. Each process writes its pid first.
JOB = f"""
import os, signal, sys, time
import numpy as np
import jax, jax.numpy as jnp, optax
import jaxsync

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["JAXSYNC_PROCESS_ID"])
open(os.path.join(out, f"pid.{{rank}}"), "w").write(str(os.getpid()))
jaxsync.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("data",))

def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] - y) ** 2)

step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh, "ddp")
state = step.init({{"w": jnp.ones((4, 2))}})
if mode == "hang_first" and rank == 1:
    time.sleep(600)  # never reaches its first step
rows = 4
for i in range(8):
    if i == {AT}:
        if mode == "shape" and rank == 1:
            rows = 2
        if mode == "shape_all":
            rows = 2  # every process alike: fine
        if mode == "raise" and rank == 1:
            raise RuntimeError("process one gives up")
        if mode == "raise0" and rank == 0:
            raise RuntimeError("process zero gives up")
        if mode == "kill" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "kill0" and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == f"hang{{rank}}":
            time.sleep(600)
        if mode == "wait":
            open(os.path.join(out, f"waiting.{{rank}}"), "w").close()
            time.sleep(600)
    batch = (np.ones((rows, 4), np.float32), np.ones((rows, 2), np.float32))
    state, loss = step(state, batch)
    print("step", i, float(loss), flush=True)
print("done", flush=True)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is not alive
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def env_for(extra=None):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONUNBUFFERED": "1",
    }
    for var in ("JAXSYNC_LAUNCH_DIR", "JAXSYNC_HANG_TIMEOUT", "JAXSYNC_FIRST_STEP_TIMEOUT"):
        env.pop(var, None)
    env.update(extra or {})
    return env


def run_bare(tmp_path, mode, extra=None, limit=LIMIT):
    """Both processes, bare: ({rank: exit code}, {rank: output}, seconds)."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    port, procs, logs = free_port(), [], []
    t0 = time.monotonic()
    for rank in range(2):
        env = env_for({
            "JAXSYNC_COORDINATOR": f"127.0.0.1:{port}",
            "JAXSYNC_NUM_PROCESSES": "2",
            "JAXSYNC_PROCESS_ID": str(rank),
            **(extra or {}),
        })  # fmt: skip
        log = open(tmp_path / f"out.{rank}", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(job), mode, str(tmp_path)], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        ))  # fmt: skip
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() - t0 < limit:
            time.sleep(0.05)
        secs = time.monotonic() - t0
        codes = {r: p.returncode for r, p in enumerate(procs)}
    finally:
        for p in procs:  # nothing outlives the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for log in logs:
            log.close()
    outs = {r: (tmp_path / f"out.{r}").read_text() for r in range(2)}
    tails = "".join(
        f"\n--- process {r} (exit {codes[r]}), last lines:\n{o[-3000:]}" for r, o in outs.items()
    )
    assert None not in codes.values(), f"still running after {limit}s: {codes}{tails}"
    return codes, outs, secs


def run_launched(tmp_path, mode, *args, extra=None, limit=LIMIT):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "jaxsync.launch", "--nproc", "2", "--devices-per-proc", "2",
         "--grace", "2", *args, str(job), mode, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=limit, env=env_for(extra),
    )  # fmt: skip
    return out, time.monotonic() - t0


def lines_of(out):
    return "\n".join(
        line for line in out.splitlines() if not line.startswith(("  File", "    ", "Thread"))
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_batch_that_changes_shape_on_one_process_is_named_by_both(tmp_path):
    # Before: both exited 0, process 1 trained on a global batch of another shape.
    codes, outs, secs = run_bare(tmp_path, "shape")
    assert codes == {0: PEER_EXIT_CODE, 1: 1}, (codes, outs)
    assert (
        f"ValueError: TrainStep: the batch changed shape at step {AT} on process 1 and not "
        "alike on every process: process 1 now passes (4, 4) float32, (4, 2) float32 (before: "
        "(8, 4) float32, (8, 2) float32), while process 0 still passes (8, 4) float32"
    ) in outs[1], outs[1]
    assert (
        f"jaxsync (process 0): process 1 failed at step {AT} (phase data): its batch " in (outs[0])
    ), outs[0]
    assert f"\nstep {AT} " not in outs[0]  # process 0 did not finish step 3 alone
    print(f"both exited in {secs:.1f}s")


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_shapes_that_change_alike_on_every_process_are_fine(tmp_path):
    codes, outs, _ = run_bare(tmp_path, "shape_all")
    assert codes == {0: 0, 1: 0}, (codes, outs)
    assert "done" in outs[0] and "done" in outs[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_batch_that_changes_shape_is_blamed_by_the_launcher(tmp_path):
    out, secs = run_launched(tmp_path, "shape")
    assert out.returncode == 1, (out.stdout[-3000:], out.stderr)
    assert "jaxsync.launch: process 1 failed first: it exited with code 1" in out.stderr, out.stderr
    assert f"[1] ValueError: TrainStep: the batch changed shape at step {AT}" in out.stdout
    assert f"[0] jaxsync (process 0): process 1 failed at step {AT} (phase data)" in out.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_process_that_hangs_before_its_first_step_is_named(tmp_path):
    # Before: the watchdog did not time set-up, and both processes waited forever (and
    # without a hang_timeout there was no watchdog). Now first_step_timeout applies
    # with or without one.
    extra = {"JAXSYNC_FIRST_STEP_TIMEOUT": "8"}
    codes, outs, secs = run_bare(tmp_path, "hang_first", extra)
    assert codes[1] == HANG_EXIT_CODE and codes[0] in (HANG_EXIT_CODE, PEER_EXIT_CODE), (
        codes, outs,
    )  # fmt: skip
    assert (
        "process(es) 1 did not arrive: stuck at step 0, phase start for" in outs[1]
        and "(before its first step finished: first_step_timeout=8s)" in outs[1]
    ), outs[1]
    # process 0 waited in the first step's cross-process check: it names process 1 too
    assert re.search(r"process(\(es\))? 1 (did not arrive|stopped answering|failed)", outs[0]), (
        lines_of(outs[0])
    )
    assert secs < 8 + 25, secs


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_bare_process_that_raises_is_named_by_the_other(tmp_path):
    # Before: process 0 ended on gloo's "Connection reset by peer" (or waited), naming no one.
    codes, outs, _ = run_bare(tmp_path, "raise")
    assert codes == {0: PEER_EXIT_CODE, 1: 1}, (codes, outs)
    assert "RuntimeError: process one gives up" in outs[1]
    assert (
        f"jaxsync (process 0): process 1 failed at step {AT} (phase data): RuntimeError: "
        "process one gives up"
    ) in outs[0], lines_of(outs[0])


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_bare_process_killed_is_named_by_the_other(tmp_path):
    # Before: process 0 waited in step 3's collective forever (no hang_timeout).
    codes, outs, secs = run_bare(tmp_path, "kill", {"JAXSYNC_DEAD_TIMEOUT": "6"})
    assert codes[1] == -signal.SIGKILL and codes[0] in (HANG_EXIT_CODE, PEER_EXIT_CODE), codes
    # (its last position is up to a second old: maybe from before its first step)
    assert re.search(r"process(\(es\))? 1 stopped answering: no heartbeat for [\d.]+s", outs[0]), (
        lines_of(outs[0])
    )
    assert secs < 6 + 30, secs


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_the_coordinator_killed_is_named_by_the_survivor(tmp_path):
    # Before: JAX aborted process 1 with a gRPC "PollForError" status naming no process.
    codes, outs, _ = run_bare(tmp_path, "kill0")
    assert codes[0] == -signal.SIGKILL and codes[1] != 0, codes
    assert "the coordinator (process 0) is gone" in outs[1], lines_of(outs[1])


def wait_for(paths, proc, limit=LIMIT):
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
        time.sleep(0.1)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_killing_the_launcher_ends_its_processes(tmp_path):
    # Before: a launcher killed with SIGKILL left both processes running (JAX's
    # preemption service catches SIGTERM, so they ignored that too).
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxsync.launch", "--nproc", "2", "--devices-per-proc", "2",
         str(job), "wait", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env_for(),
    )  # fmt: skip
    try:
        wait_for([tmp_path / f"waiting.{r}" for r in range(2)], launcher)
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if alive(p)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for r in range(2):
            with contextlib.suppress(Exception):
                os.kill(int((tmp_path / f"pid.{r}").read_text()), signal.SIGKILL)
    assert not left, f"processes {left} outlived the launcher"


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("hung", [0, 1])
def test_the_launcher_blames_the_process_that_hangs(tmp_path, hung):
    # Both watchdogs end their process naming the hung one, and the launcher blames
    # the hung one whichever exits first. Before: it blamed the first exit, which is
    # process 1 whenever process 0 hangs (process 0 waits a little before it exits,
    # to let the others read its coordination service once more).
    out, _ = run_launched(tmp_path, f"hang{hung}", extra={"JAXSYNC_HANG_TIMEOUT": "3"})
    assert out.returncode == HANG_EXIT_CODE, (out.stdout[-3000:], out.stderr)
    assert f"jaxsync.launch: process {hung} failed first" in out.stderr, out.stderr
    assert f"process {1 - hung} failed first" not in out.stderr, out.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_the_coordinator_raising_is_named_by_the_other(tmp_path):
    # Process 0 runs the coordination service: it waits a moment after publishing its
    # error, so that the other reads it before the service ends with process 0.
    codes, outs, _ = run_bare(tmp_path, "raise0")
    assert codes == {0: 1, 1: PEER_EXIT_CODE}, (codes, lines_of(outs[1]))
    assert (
        f"jaxsync (process 1): process 0 failed at step {AT} (phase data): RuntimeError: "
        "process zero gives up"
    ) in outs[1], lines_of(outs[1])


def seen(rank, step, phase, done=None, beat=0.5, moved=0.5):
    return Seen(rank, step, phase, step if done is None else done, beat, moved)


@pytest.mark.parametrize(
    "records, first_step, verdict",
    [
        # one process never reached its first step while the other waits in its check
        ([seen(0, 0, CHECK, moved=9), seen(1, 0, START, moved=9)], 8.0, ("behind", (1,))),
        ([seen(0, 0, CHECK, moved=9), seen(1, 0, START, moved=9)], 10.0, None),
        # the first step compiles for longer than hang_timeout: not a hang
        ([seen(0, 0, STEP, moved=9), seen(1, 0, STEP, moved=9)], 600.0, None),
        ([seen(0, 0, STEP, moved=9), seen(1, 0, STEP, moved=9)], 8.0, ("together", (0, 1))),
        # once a step has finished, hang_timeout again
        ([seen(0, 5, STEP, moved=4), seen(1, 5, DATA, moved=4)], 600.0, ("behind", (1,))),
        # a dead process is named whatever the allowance
        ([seen(0, 0, CHECK, moved=9), seen(1, 0, START, beat=4, moved=9)], 600.0,
         ("silent", (1,))),
    ],
)  # fmt: skip
def test_the_first_step_has_its_own_allowance(records, first_step, verdict):
    got = decide(records, timeout=3.0, first_step=first_step)
    assert got == (None if verdict is None else Verdict(*verdict))
    if got is not None and got.why != "silent" and records[0].done == 0:
        text = report(got, records, 3.0, me=0, first_step=first_step)
        assert f"(before its first step finished: first_step_timeout={first_step:g}s)" in text


def test_first_step_timeout_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("JAXSYNC_FIRST_STEP_TIMEOUT", raising=False)
    assert first_step_from(None, None) == 600.0 and first_step_from(None, 900) == 900.0
    assert first_step_from(30, 5) == 30.0 and first_step_from(0, 5) == float("inf")
    monkeypatch.setenv("JAXSYNC_FIRST_STEP_TIMEOUT", "45")
    assert first_step_from(None, 5) == 45.0
    monkeypatch.setenv("JAXSYNC_FIRST_STEP_TIMEOUT", "later")
    with pytest.raises(ValueError, match="JAXSYNC_FIRST_STEP_TIMEOUT='later' must be a number"):
        first_step_from(None, 5)
    with pytest.raises(ValueError, match="`first_step_timeout` must be a number of seconds"):
        first_step_from(-1, 5)


def test_the_first_fault_is_one_no_other_caused():
    records = {
        0: {"rank": 0, "step": 3, "phase": "data", "what": "x", "after": 1, "hang": False},
        1: {"rank": 1, "step": 3, "phase": "data", "what": "y", "after": None, "hang": True},
    }
    assert faults.first(records, me=0) is records[1]  # a hang verdict names who hung
    assert faults.first(records, me=0, hangs=False) is None  # the judge waits for its own
    assert faults.first(records, me=1) is None  # never one's own
    assert faults.describe(records[1]) == "process 1 failed at step 3 (phase data): y"


def test_the_launcher_follows_the_chain_of_blame(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSYNC_LAUNCH_DIR", str(tmp_path))
    faults.blame(0, 2, "process 2 did not arrive")
    faults.blame(2, 1, "process 1 failed at step 4")
    assert culprit(str(tmp_path), 0) == (1, "process 1 failed at step 4")
    assert culprit(str(tmp_path), 1) is None  # its own fault
    faults.blame(1, 0, "a cycle")  # never loops
    assert culprit(str(tmp_path), 0) is not None


def test_the_shape_signature_is_shapes_and_dtypes():
    import numpy as np

    batch = {"x": np.ones((8, 4), np.float32), "y": np.ones((8,), np.int32)}
    sig = shapes.signature(batch)
    assert sig == shapes.signature({"x": np.zeros((8, 4), np.float32), "y": np.zeros(8, np.int32)})
    assert sig != shapes.signature({"x": np.ones((4, 4), np.float32), "y": np.ones(4, np.int32)})
    assert shapes.text(sig) == "(8, 4) float32, (8,) int32"

"""The local launcher: bad arguments, scripts that never join, failed, stalled and
signalled jobs. The scripts are tiny; the ones that start JAX's multi-process
runtime are marked ``multiprocess``."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxsync import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script(tmp_path, body, name="job.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run_launcher(*args, timeout=120):
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "jaxsync.launch", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return out, time.monotonic() - t0


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nproc", "0"], "`--nproc` must be an integer >= 1, got 0"),
        (
            ["--nproc", "2", "--devices-per-proc", "0"],
            "`--devices-per-proc` must be an integer >= 1",
        ),
        (["--nproc", "2", "--devices-per-proc", "-1"], "got -1"),
        (["--nproc", "2", "--grace", "-1"], "`--grace` must be >= 0"),
        (["--nproc", "2", "--timeout", "0"], "`--timeout` must be positive"),
        (["--nproc", "2", "--stall-timeout", "-5"], "`--stall-timeout` must be >= 0"),
    ],
)
def test_bad_arguments_are_rejected(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        launch.main([*args, "never_started.py"])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


# Pretends to have called jaxsync.initialize() (without starting JAX, to stay fast).
JOINS = """
import os
rank = int(os.environ["JAXSYNC_PROCESS_ID"])
open(os.path.join(os.environ["JAXSYNC_LAUNCH_DIR"], f"connected.{rank}"), "w").close()
"""


def test_script_without_initialize_is_reported(tmp_path):
    alone = script(
        tmp_path, "import os; print('training alone as rank', os.environ['JAXSYNC_PROCESS_ID'])"
    )
    out, _ = run_launcher("--nproc", "2", alone)
    assert out.returncode == 1
    assert re.search(
        r"process \d exited with code 0 without calling jaxsync.initialize\(\)", out.stderr
    )
    assert "one of 2 processes" in out.stderr


def test_early_finish_is_reported(tmp_path):
    body = JOINS + "import time\nif rank == 0:\n    time.sleep(2)\n"
    out, _ = run_launcher("--nproc", "2", script(tmp_path, body))
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"process 1 finished \(exit code 0\) after .* while process\(es\) \[0\] still run",
        out.stderr,
    )


def test_first_failure_is_blamed_without_initialize(tmp_path):
    # Rank 2 fails later than rank 1: the first failure is the one reported.
    body = JOINS + textwrap.dedent("""
        import sys, time
        if rank == 1:
            sys.exit(3)
        if rank == 2:
            time.sleep(0.5)
            sys.exit(4)
        time.sleep(120)
    """)
    out, secs = run_launcher("--nproc", "3", "--grace", "1", script(tmp_path, body))
    assert out.returncode == 3
    assert "process 1 failed first: it exited with code 3" in out.stderr
    assert secs < 30


JAX_JOB = """
import os, sys, time
import jax, jax.numpy as jnp
import jaxsync
from jax.sharding import NamedSharding, PartitionSpec as P

rank = os.environ["JAXSYNC_PROCESS_ID"]
pid_file = os.path.join(sys.argv[2], f"pid.{rank}")
with open(pid_file + ".tmp", "w") as f:  # whole, then renamed: a reader never sees it empty
    f.write(str(os.getpid()))
os.replace(pid_file + ".tmp", pid_file)
jaxsync.initialize()
rank, mode = jax.process_index(), sys.argv[1]
mesh = jax.make_mesh((jax.device_count(),), ("d",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), jnp.ones((1,)))
total = jax.jit(jnp.sum)
print("first sum", total(x), flush=True)  # gloo is connected from here on
if rank == 1 and mode == "raise":
    raise RuntimeError("rank one gives up")
if rank == 1 and mode == "stall":
    time.sleep(600)  # alive, but never reaches the next collective
if mode == "wait":
    time.sleep(600)
print("second sum", total(x * 2), flush=True)
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(d):
    return [int((d / f"pid.{r}").read_text()) for r in range(2)]


@pytest.mark.multiprocess
def test_raising_rank_is_blamed_and_the_job_ends_promptly(tmp_path):
    job = script(tmp_path, JAX_JOB)
    out, secs = run_launcher(
        "--nproc", "2", "--devices-per-proc", "1", "--grace", "1", job, "raise", str(tmp_path)
    )
    assert out.returncode == 1
    assert "[1] RuntimeError: rank one gives up" in out.stdout
    assert "process 1 failed first: it exited with code 1" in out.stderr
    # Rank 0 is stopped, or its own collective has already failed on the closed
    # connection (seen under load): either way it is not left waiting.
    assert (
        "stopping process(es) [0]" in out.stderr
        or "no other process was still running" in out.stderr
    ), out.stderr
    assert secs < 25, secs  # before: rank 1 waited in JAX's shutdown, rank 0 in gloo
    assert not any(_alive(p) for p in _pids(tmp_path))


@pytest.mark.multiprocess
def test_stalled_rank_ends_the_job_and_is_shown(tmp_path):
    job = script(tmp_path, JAX_JOB)
    out, secs = run_launcher(
        "--nproc",
        "2",
        "--devices-per-proc",
        "1",
        "--grace",
        "1",
        "--stall-timeout",
        "4",
        job,
        "stall",
        str(tmp_path),
    )
    assert out.returncode == 124, out.stderr
    msg = out.stderr
    # both ranks stall; under load the launcher may see one cross the limit first
    assert re.search(r"no progress for 4s \(--stall-timeout\) in process\(es\) \[(0|1|0, 1)\]", msg)
    assert re.search(r"process [01] at .*job\.py:\d+ in <module>", msg)
    assert "[1] " in out.stdout and "Thread" in out.stdout  # the stacks, from faulthandler
    assert secs < 40, secs
    assert not any(_alive(p) for p in _pids(tmp_path))


@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_stops_every_process(tmp_path):
    job = script(tmp_path, JAX_JOB)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxsync.launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "1",
            "--grace",
            "1",
            job,
            "wait",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"pid.{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.1)
    pids = _pids(tmp_path)
    time.sleep(1.0)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM; passed it on to processes [0, 1]" in stderr
    assert not any(_alive(p) for p in pids)  # before: both kept running, orphaned


def test_the_rank_that_raised_is_blamed_when_a_peer_exits_before_it(tmp_path):
    # What CI saw: rank 1 raises, its connection closes, rank 0's collective fails
    # and rank 0 exits first while rank 1 is still shutting down. The blame goes by
    # when each failed (its traceback), not by which exit the launcher saw first.
    body = JOINS + textwrap.dedent("""
        import atexit, sys, time
        if rank == 1:
            atexit.register(time.sleep, 1.0)  # a slow shutdown after the raise
            raise RuntimeError("rank one gives up")
        time.sleep(0.3)  # the peer notices the closed connection
        sys.exit(1)
    """)
    out, secs = run_launcher("--nproc", "2", "--grace", "1", script(tmp_path, body))
    assert out.returncode == 1
    assert "[1] RuntimeError: rank one gives up" in out.stdout
    assert "process 1 failed first: it exited with code 1" in out.stderr, out.stderr
    assert "no other process was still running" in out.stderr, out.stderr
    assert secs < 30


def test_a_rank_killed_by_a_signal_is_blamed_with_the_shells_code(tmp_path):
    # Before: the launcher exited with the negative returncode (-11 -> status 245).
    body = JOINS + textwrap.dedent("""
        import os, signal, time
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(120)
    """)
    out, secs = run_launcher("--nproc", "2", "--grace", "1", script(tmp_path, body))
    assert out.returncode == 128 + signal.SIGSEGV
    assert "process 1 failed first: it was killed by SIGSEGV (exit code 139)" in out.stderr
    assert secs < 30


def test_sys_exit_with_a_failure_code_does_not_wait_for_the_others(tmp_path):
    # In a multi-process run the interpreter's exit waits in JAX's shutdown barrier
    # (here: an atexit hook that sleeps) until another rank fails first, with its
    # own code, and takes the blame. jaxsync.initialize makes sys.exit(code) end
    # the process at once with that code.
    body = """
        import atexit, sys, time
        from jaxsync._src.multihost.distributed import _exit_now_on_failure_code
        atexit.register(time.sleep, 60)  # what JAX's shutdown barrier looks like
        _exit_now_on_failure_code()
        print("bye", flush=True)
        sys.exit(7)
    """
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, script(tmp_path, body)], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 7 and out.stdout == "bye\n"
    assert time.monotonic() - t0 < 30


def test_a_line_repeated_at_once_is_counted_not_copied():
    # A crash printing one line from every thread must leave its cause in the tail.
    import io
    import threading

    from jaxsync._src.multihost import children

    lines = [b"terminate called after throwing X\n", *[b"terminate called recursively\n"] * 300]
    lines += [b"a\n", b"a\n", b"b\n"]
    out, raised = io.StringIO(), {}
    children.pump(1, io.BytesIO(b"".join(lines)), out, threading.Lock(), raised)
    assert out.getvalue().splitlines() == [
        "[1] terminate called after throwing X",
        "[1] terminate called recursively",
        "[1] (the line above 299 more times)",
        "[1] a",
        "[1] a",
        "[1] b",
    ]


def test_the_named_process_is_blamed_when_its_traceback_arrives_after_the_peers_exit(tmp_path):
    # Staged without processes: rank 1 raised and published its fault; rank 0 read it
    # and exited (76) before rank 1's traceback reached the launcher (seen in CI under
    # load). The exit times say rank 0; rank 0's blame record says rank 1.
    import json
    import queue
    import threading

    from jaxsync._src.multihost import children

    job = object.__new__(launch._Job)
    job.launch_dir = str(tmp_path)
    job.procs = [type("Done", (), {"poll": lambda self: 1})() for _ in range(2)]
    job.pumps = [threading.Thread(target=lambda: None) for _ in range(2)]
    for t in job.pumps:
        t.start()
    job.exits = queue.Queue()
    t0 = time.monotonic()
    peer, culprit = children.Exit(t0, 0, 76), children.Exit(t0 + 0.2, 1, 1)
    job.exits.put(culprit)
    job.raised = {1: t0 + 0.3}  # its traceback read after both exits
    assert job._first_failure(peer).rank == 0  # the clock alone blames the peer
    (tmp_path / "blame.0").write_text(json.dumps({"culprit": 1, "why": "rank one gives up"}))
    job.exits.put(culprit)
    assert job._first_failure(peer) == culprit

"""A hang names itself: with a hang timeout every process of a stalled job exits
(code 75), and the survivors name the process that did not arrive, its step and
its phase. Real 2-process runs of a tiny train_step loop on 127.0.0.1 (gloo),
plus the decision rules on their own, without processes."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxsync._src.multihost.watchdog import (
    CHECKPOINT,
    DATA,
    EXITED,
    HANG_EXIT_CODE,
    START,
    STEP,
    Seen,
    Verdict,
    decide,
    report,
    timeout_from,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 5.0  # the hang timeout of the runs below, seconds
STALL_AT = 3  # the step before which (or in which) rank 1 stalls

# Rank 1 stalls before (or, "callback", inside) step STALL_AT; it writes the time
# it did so. Rank 0 only trains, reading each loss as a training loop that logs does.
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
now = [0]

def stall():
    open(os.path.join(out, "stall"), "w").write(repr(time.time()))

def maybe_sleep(x):
    if rank == 1 and now[0] == {STALL_AT} and not os.path.exists(os.path.join(out, "stall")):
        stall()
        time.sleep(600)

def loss_fn(p, batch):
    x, y = batch
    if mode == "callback":
        jax.debug.callback(maybe_sleep, x[0, 0])
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh, "ddp")
state = step.init({{"w": jnp.ones((4, 2)), "b": jnp.zeros((2,))}})
rows = 2 * jax.local_device_count()
batch = (np.ones((rows, 4), np.float32), np.ones((rows, 2), np.float32))
for i in range(10_000):
    now[0] = i
    if mode == "finish" and i == {STALL_AT}:
        break
    if rank == 1 and i == {STALL_AT}:
        if mode == "sleep":
            stall()
            time.sleep(600)
        if mode in ("stop", "exit"):
            time.sleep(1.0)  # a process's last record is up to one poll (0.5 s) old
            stall()
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(3)
    state, loss = step(state, batch)
    print("step", i, float(loss), flush=True)
if mode == "finish":  # rank 1's script ends; rank 0 works on alone, past the dead timeout
    if rank == 1:
        stall()
    else:
        time.sleep(3 * float(os.environ["JAXSYNC_DEAD_TIMEOUT"]))
    print("finished", flush=True)
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
    return True


def stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def run_job(tmp_path, mode, limit=45.0, **env_vars):
    """Starts the 2 ranks (``env_vars`` added to their environment); returns ({rank:
    code}, {rank: output}, {rank: seconds from the stall to the exit}, still-running
    Popen objects) once every rank that can exit has (a SIGSTOPped one cannot)."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(JOB))
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "PYTHONUNBUFFERED": "1",
            "JAXSYNC_COORDINATOR": f"127.0.0.1:{port}",
            "JAXSYNC_NUM_PROCESSES": "2",
            "JAXSYNC_PROCESS_ID": str(rank),
            "JAXSYNC_HANG_TIMEOUT": str(TIMEOUT),
            **env_vars,
        }
        env.pop("JAXSYNC_LAUNCH_DIR", None)
        log = open(tmp_path / f"out.{rank}", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(job), mode, str(tmp_path)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    exited = {}
    deadline = time.monotonic() + limit
    expect = {0} if mode == "stop" else {0, 1}
    try:
        while set(exited) != expect and time.monotonic() < deadline:
            for rank, p in enumerate(procs):
                if rank not in exited and p.poll() is not None:
                    exited[rank] = time.time()
            time.sleep(0.05)
        stall = float((tmp_path / "stall").read_text())
        left = [p for r, p in enumerate(procs) if r not in exited]
        if mode == "stop":
            assert stopped(procs[1].pid)  # still stopped: only it can be left behind
        codes = {r: procs[r].returncode for r in exited}
    finally:
        for p in procs:  # nothing outlives the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for log in logs:
            log.close()
    assert not any(alive(p.pid) for p in procs)
    outs = {r: (tmp_path / f"out.{r}").read_text() for r in range(2)}
    assert set(exited) == expect, (codes, outs)
    return codes, outs, {r: t - stall for r, t in exited.items()}, left


# Not moving for the timeout, rank 1 may be named as behind just before its
# heartbeat counts as stopped too (it stood still 1 s before it stopped).
NAMED_SILENT = (
    rf"process\(es\) 1 (stopped answering: .*dead, stopped or frozen\), last seen at step "
    rf"{STALL_AT}, phase data|did not arrive: .* step {STALL_AT}, phase data.*dead, stopped "
    r"or frozen)"
)


def report_of(out):
    """The watchdog's first line in a rank's output."""
    match = re.search(r"jaxsync hang watchdog \(process \d.*", out)
    assert match, out[-3000:]
    return match.group(0)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_sleeping_between_steps_is_named_by_both(tmp_path):
    codes, outs, after, _ = run_job(tmp_path, "sleep")
    assert codes == {0: HANG_EXIT_CODE, 1: HANG_EXIT_CODE}, (codes, outs)
    for rank in (0, 1):
        line = report_of(outs[rank])
        assert f"process(es) 1 did not arrive: stuck at step {STALL_AT}, phase data" in line
        assert after[rank] < TIMEOUT + 5, after  # measured: about TIMEOUT + 1 to 2
    # rank 0 dispatched step 3 and waits on its loss: its device is inside the step
    assert (
        f"process 0 (this process): step {STALL_AT}, phase forward/backward (device; host "
        f"already at step {STALL_AT + 1}, data)"
    ) in outs[0]
    print("seconds from the stall to each exit:", after)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_stuck_inside_the_step_stops_every_rank(tmp_path):
    # A host callback sleeps on rank 1: both hosts wait on step 3's loss, so no
    # process is behind; the report says the step (on the devices) does not finish.
    codes, outs, after, _ = run_job(tmp_path, "callback")
    assert codes == {0: HANG_EXIT_CODE, 1: HANG_EXIT_CODE}, (codes, outs)
    for rank in (0, 1):
        line = report_of(outs[rank])
        assert f"every process has been at step {STALL_AT}, phase forward/backward" in line
        assert after[rank] < TIMEOUT + 5, after
    print("seconds from the stall to each exit:", after)
    assert "in maybe_sleep" in outs[1]  # its stacks show where rank 1 sleeps


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_stopped_rank_is_named_and_the_other_exits(tmp_path):
    codes, outs, after, left = run_job(tmp_path, "stop")
    assert codes == {0: HANG_EXIT_CODE}, (codes, outs)
    assert re.search(NAMED_SILENT, report_of(outs[0])), outs[0]
    assert after[0] < TIMEOUT + 5, after
    print("seconds from the stall to each exit:", after)
    assert [p.pid for p in left] and not any(alive(p.pid) for p in left)  # killed above


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_that_exits_before_a_collective_is_named(tmp_path):
    codes, outs, after, _ = run_job(tmp_path, "exit")
    assert codes == {0: HANG_EXIT_CODE, 1: 3}, (codes, outs)
    assert re.search(NAMED_SILENT, report_of(outs[0])), outs[0]
    assert after[0] < TIMEOUT + 5, after
    print("seconds from the stall to each exit:", after)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_whose_script_ended_is_not_taken_for_dead(tmp_path):
    # Rank 1 finishes and waits in JAX's shutdown while rank 0 works on for three
    # dead timeouts: rank 1's monitor stopped at exit (before JAX freed its clients)
    # and said so, so rank 0 does not name it as dead and both end cleanly. A dead
    # timeout of 4 s: at 2 s, under the full suite on 2 cores, rank 1's last beat
    # before its exit record was once older than that (a fresh-clone CI run).
    codes, outs, after, _ = run_job(
        tmp_path, "finish", JAXSYNC_HANG_TIMEOUT="0", JAXSYNC_DEAD_TIMEOUT="4"
    )
    assert codes == {0: 0, 1: 0}, (codes, outs)
    assert "jaxsync hang watchdog" not in outs[0] + outs[1]
    assert after[0] > 12.0 and "finished" in outs[0] and "finished" in outs[1], after


class FakeStore:
    """The coordination service's key-value store, in this process."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_the_monitor_stops_before_jax_exits_and_says_so(monkeypatch):
    import json

    import jax.numpy as jnp
    from jax._src.distributed import global_state

    from jaxsync._src.multihost import watchdog

    loss = jnp.ones(())  # (JAX's backend starts with the real client: none)
    store = FakeStore()
    monkeypatch.setattr(global_state, "client", store)
    monkeypatch.setattr(watchdog, "_pos", (4, DATA))
    monkeypatch.setattr(watchdog, "_pending", watchdog.collections.deque(maxlen=64))
    monkeypatch.setattr(watchdog, "_watch", None)
    monkeypatch.setattr(watchdog, "MONITOR_INTERVAL", 0.05)
    monkeypatch.delenv("JAXSYNC_HANG_TIMEOUT", raising=False)  # judges only the dead (30 s)
    monkeypatch.delenv("JAXSYNC_DEAD_TIMEOUT", raising=False)
    watchdog.start(None, 1, 2)
    watch = watchdog._watch
    watchdog._pending.append((4, loss))
    deadline = time.monotonic() + 10
    while "jaxsync/hang/1" not in store.kv and time.monotonic() < deadline:
        time.sleep(0.01)
    assert json.loads(store.kv["jaxsync/hang/1"])[1:3] == [4, DATA]
    assert all(t.is_alive() for t in watch.threads) and len(watch.threads) == 2
    watchdog.stop()
    assert not any(t.is_alive() for t in watch.threads)
    beat, step, phase, done = json.loads(store.kv["jaxsync/hang/1"])
    assert (step, phase, done) == (4, watchdog.EXITED, 4) and beat == watch.beat
    assert watchdog._watch is None and not watchdog._pending  # no array outlives it
    watchdog.stop()  # again, as at exit: nothing to do


def seen(rank, step, phase, done=None, beat=0.5, moved=0.5):
    return Seen(rank, step, phase, step if done is None else done, beat, moved)


@pytest.mark.parametrize(
    "records, verdict",
    [
        # all moving, or not yet long enough
        ([seen(0, 5, DATA), seen(1, 5, STEP)], None),
        ([seen(0, 6, DATA, moved=9), seen(1, 5, DATA, moved=4)], None),
        # a heartbeat that stood still names its process, wherever the others are
        ([seen(0, 6, DATA, moved=9), seen(1, 5, DATA, beat=6, moved=9)], ("silent", (1,))),
        ([seen(0, 0, START, beat=7), seen(1, 0, START)], ("silent", (0,))),
        # the lowest step, unmoved while another is ahead (which may still move)
        ([seen(0, 7, DATA, moved=0.1), seen(1, 5, DATA, moved=6), seen(2, 6, STEP)],
         ("behind", (1,))),
        # same step: between steps is behind inside the step
        ([seen(0, 5, STEP, moved=6), seen(1, 5, CHECKPOINT, moved=6)], ("behind", (1,))),
        ([seen(0, 5, STEP, moved=6), seen(1, 5, DATA, moved=6), seen(2, 5, DATA, moved=6)],
         ("behind", (1, 2))),
        # everyone at one place: stuck together (not during set-up)
        ([seen(0, 4, DATA, done=3, moved=6), seen(1, 4, DATA, done=3, moved=6)],
         ("together", (0, 1))),
        ([seen(0, 0, START, moved=60), seen(1, 0, START, moved=60)], None),
        ([seen(0, 0, STEP, moved=6), seen(1, 0, START, moved=60)], None),
        # a script that ended is not dead; behind the others it did not arrive
        ([seen(0, 5, DATA), seen(1, 5, EXITED, beat=60, moved=60)], None),
        ([seen(0, 6, STEP, moved=6), seen(1, 5, EXITED, beat=60, moved=6)], ("behind", (1,))),
    ],
)  # fmt: skip
def test_decide_names_who_holds_the_job_up(records, verdict):
    got = decide(records, timeout=5.0)
    assert got == (None if verdict is None else Verdict(*verdict))
    if got is not None:  # the report names them, with step and phase
        text = report(got, records, 5.0, me=0)
        assert f"process(es) {', '.join(map(str, got.named))}" in text or "every" in text
        assert "(this process)" in text and f"code {HANG_EXIT_CODE}" in text


def test_the_report_says_where_the_device_is():
    records = [seen(0, 4, DATA, done=3, moved=6), seen(1, 4, DATA, done=3, moved=6)]
    text = report(decide(records, 5.0), records, 5.0, me=1)
    assert "every process has been at step 3, phase forward/backward (device; host" in text
    assert "process 1 (this process): step 3" in text


def test_timeout_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv("JAXSYNC_HANG_TIMEOUT", raising=False)
    assert timeout_from(None) is None and timeout_from(0) is None and timeout_from(30) == 30.0
    monkeypatch.setenv("JAXSYNC_HANG_TIMEOUT", "12.5")
    assert timeout_from(None) == 12.5 and timeout_from(0) is None
    monkeypatch.setenv("JAXSYNC_HANG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="JAXSYNC_HANG_TIMEOUT='soon' must be a number"):
        timeout_from(None)
    with pytest.raises(ValueError, match="`hang_timeout` must be a number of seconds >= 0"):
        timeout_from(-1)


def test_train_step_and_checkpointer_mark_their_phase(tmp_path, monkeypatch):
    # One process: the marks are read only by a running watchdog, so pretend one runs.
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxsync
    from jaxsync._src.multihost import watchdog

    monkeypatch.setattr(watchdog, "_watch", object())
    monkeypatch.setattr(watchdog, "_pos", (0, START))
    monkeypatch.setattr(watchdog, "_pending", watchdog.collections.deque(maxlen=64))
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    loss_fn = lambda p, b: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh, "ddp")
    state = step.init({"w": jnp.ones((3,))})
    for _ in range(3):
        state, loss = step(state, np.ones((4, 3), np.float32))
    assert watchdog._pos == (3, DATA) and [n for n, _ in watchdog._pending] == [1, 2, 3]
    during = []
    monkeypatch.setattr(jaxsync.Checkpointer, "_write", lambda *a: during.append(watchdog._pos))
    with jaxsync.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, params=step.params(state), opt_state=())
    assert during == [(3, CHECKPOINT)] and watchdog._pos == (3, DATA)

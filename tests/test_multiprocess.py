"""Real multi-process runs: several Python processes on 127.0.0.1 with gloo."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train_gpt.py")
CONFIG = os.path.join(ROOT, "tests", "data", "test_gpt.yaml")

pytestmark = pytest.mark.multiprocess


def env(devices):
    e = dict(os.environ)
    flags = " ".join(
        f
        for f in e.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    e["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def train(run_dir, *extra, nproc=1, devices=4, timeout=None):
    args = [
        TRAIN,
        "--config",
        CONFIG,
        "--run-dir",
        str(run_dir),
        "--dump-params",
        str(run_dir / "params.npz"),
        *extra,
    ]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "jaxsync.launch",
            "--nproc",
            str(nproc),
            "--devices-per-proc",
            str(devices),
            # A stuck job ends with every rank's Python stack in the output (the
            # launcher's report) before the subprocess timeout, which only says
            # "timed out": once in a full suite on 2 busy cores this run took over
            # 300 s (42 s alone, 60 s beside two busy loops), with nothing to read.
            "--stall-timeout",
            "200",
            *args,
        ]
    else:
        cmd = [sys.executable, *args]
    timeout = timeout or (480 if nproc > 1 else 300)
    out = subprocess.run(
        cmd, env=env(devices), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def assert_params_close(a, b, **tol):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **tol)


STEPS = "24"  # with a checkpoint every 4: plenty of saves to land a kill in


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run dir of a one-process run that never stopped (shared by the kill tests and
    the two-process test)."""
    full = tmp_path_factory.mktemp("full")
    train(full, "--steps", STEPS)
    return full


def test_two_processes_equal_one_process(tmp_path, uninterrupted):
    # the one-process run is the kill tests' uninterrupted one (same config and steps)
    one, two = uninterrupted, tmp_path / "two"
    out = train(two, "--steps", STEPS, nproc=2, devices=2)
    assert "[0] done" in out and "4 devices on 2 process(es)" in out
    a, b = load(one / "params.npz"), load(two / "params.npz")
    assert_params_close(a, b, rtol=1e-4, atol=1e-5)
    la = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(la, lb, rtol=1e-4)
    assert la[-1] < la[0]


def _kill_when(proc, ready, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    proc.kill()
    return False


def _killed_run(run_dir, when):
    """Starts the trainer in ``run_dir`` and SIGKILLs it once ``when`` holds; returns
    whether the kill landed there (a save can finish between the look and the kill)."""
    ckpts = run_dir / "checkpoints"

    def complete():
        return [d for d in os.listdir(ckpts) if d.isdigit()] if ckpts.exists() else []

    def saving():
        return ckpts.exists() and any("tmp" in d for d in os.listdir(ckpts))

    def ready():
        if when == "training":  # a checkpoint exists and training goes on
            return "4" in complete()
        return saving() and complete()

    cmd = [sys.executable, TRAIN, "--config", CONFIG, "--run-dir", str(run_dir), "--steps", STEPS]
    proc = subprocess.Popen(
        cmd, env=env(4), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert _kill_when(proc, ready), "the run finished before it could be killed"
    survivors = complete()
    assert survivors and STEPS not in survivors
    # mid-save: the interrupted save left only a temporary directory
    return when == "training" or saving()


@pytest.mark.parametrize("when", ["training", "saving"])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, when, uninterrupted):
    for attempt in range(3):  # the kill must land mid-save: retry a fresh run if it missed
        killed = tmp_path / f"killed{attempt}"
        if _killed_run(killed, when):
            break
    else:
        pytest.fail(f"3 runs: every SIGKILL landed after the save it aimed at ({when})")
    train(killed, "--steps", STEPS, "--resume")
    want = load(uninterrupted / "params.npz")
    assert_params_close(want, load(killed / "params.npz"), rtol=0, atol=0)


def test_launcher_stops_everyone_when_one_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        if os.environ["JAXSYNC_PROCESS_ID"] == "1":
            print("rank one gives up", flush=True)
            sys.exit(3)
        time.sleep(120)
    """)
    )
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "jaxsync.launch", "--nproc", "3", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3
    assert "[1] rank one gives up" in out.stdout
    assert "process 1 failed first: it exited with code 3" in out.stderr
    assert "stopping process(es) [0, 2]" in out.stderr
    assert time.time() - t0 < 30


DISAGREE = """
import json, os, sys
import numpy as np
import jax, jax.numpy as jnp, optax
import jaxsync

jaxsync.initialize()
me = jax.process_index()
mesh = jax.make_mesh((jax.device_count(),), ("data",))
params = {"w": jnp.ones((4, 2)), "b": jnp.zeros((2,))}
loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
batch = lambda rows: {"x": np.ones((rows, 4), np.float32), "y": np.ones((rows, 2), np.float32)}
out = {}


def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except ValueError as e:
        out[name] = str(e)


# a stale config: another learning rate on process 1
lr = 0.1 if me == 0 else 0.2
attempt("lr", lambda: jaxsync.train_step(loss, optax.adam(lr), mesh).init(params))
# params from another seed on process 1
other = dict(params, b=params["b"] + me)
attempt("params", lambda: jaxsync.train_step(loss, optax.sgd(0.1), mesh).init(other))
# process 1 shards w over "model" (a 2-D step there, a 1-D one on process 0)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
mesh2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
spec = P() if me == 0 else P(None, "model")
placed = dict(params, w=jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh2, spec)))
placed["b"] = jax.device_put(np.zeros((2,), np.float32), NamedSharding(mesh2, P()))
attempt("specs", lambda: jaxsync.train_step(loss, optax.sgd(0.1), mesh2).init(placed))
# another row count from process 1's data loader
step = jaxsync.train_step(loss, optax.sgd(0.1), mesh, mode="ddp")
state = step.init(params)
attempt("rows", lambda: step(state, batch(4 if me == 0 else 8)))
# and everything agreeing trains
step = jaxsync.train_step(loss, optax.sgd(0.1), mesh, mode="zero")
state = step.init(params)
state, l = step(state, batch(4))
out["loss"] = float(l)
with open(os.path.join(sys.argv[1], f"out{me}.json"), "w") as f:
    json.dump(out, f)
"""


def test_processes_that_disagree_are_named(tmp_path):
    script = tmp_path / "disagree.py"
    script.write_text(DISAGREE)
    cmd = [sys.executable, "-m", "jaxsync.launch", "--nproc", "2", "--devices-per-proc", "2"]
    run = subprocess.run(
        [*cmd, str(script), str(tmp_path)], env=env(2), cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for me in (0, 1):
        out = json.loads((tmp_path / f"out{me}.json").read_text())
        assert "processes of this run disagree" in out["lr"]
        assert "optimizer `tx` (its hyperparameters)" in out["lr"]
        assert "[0]: " in out["lr"] and "-0.1" in out["lr"] and "-0.2" in out["lr"]
        assert "param b:" in out["params"] and "param w" not in out["params"]
        assert "param shardings (PartitionSpecs)" in out["specs"]
        assert "process(es) [0]: param b: P();param w: P()\n" in out["specs"]
        assert "process(es) [1]: param b: P();param w: P(None, 'model')\n" in out["specs"]
        assert "process(es) [0]: 4 rows" in out["rows"]
        assert "process(es) [1]: 8 rows" in out["rows"]
        assert out["loss"] == 9.0

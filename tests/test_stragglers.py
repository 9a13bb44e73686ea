"""Stragglers: each process times its own loop; the slow one is named."""

from __future__ import annotations

import time

import jax
import numpy as np
import optax
import pytest
from helpers import launch, mlp_loss, mlp_params

import jaxsync


def _run(mesh, every, steps, pause=0.0):
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh, "ddp")
    timed = jaxsync.Stragglers(step, every=every)
    state = step.init(mlp_params(jax.random.PRNGKey(0)))
    batch = (np.ones((16, 12), np.float32), np.ones((16, 5), np.float32))
    for _ in range(steps):
        time.sleep(pause)
        state, _ = timed(state, batch)
    return timed.reports


def test_one_process_compares_every_k_steps_and_blames_no_one(mesh8):
    reports = _run(mesh8, every=5, steps=12, pause=0.01)
    assert [r.step for r in reports] == [5, 10]
    assert all(r.slow == () and len(r.host_ms) == 1 for r in reports)
    assert reports[-1].host_ms[0] >= 9.0  # the 10 ms spent outside the step
    assert "no straggler" in str(reports[-1])


def test_bad_options_are_named(mesh8):
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, "ddp")
    with pytest.raises(ValueError, match="`every`"):
        jaxsync.Stragglers(step, every=1)
    with pytest.raises(ValueError, match="`threshold`"):
        jaxsync.Stragglers(step, threshold=1)


JOB = """
import sys, time
import jax, numpy as np, optax
import jaxsync
jaxsync.initialize()
sys.path.insert(0, sys.argv[1])
from helpers import launch, mlp_loss, mlp_params
mesh = jax.make_mesh((jax.device_count(),), ("data",))
step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh, "ddp")
timed = jaxsync.Stragglers(step, every=10)
state = step.init(mlp_params(jax.random.PRNGKey(0)))
rows = 16 // jax.process_count()
batch = (np.ones((rows, 12), np.float32), np.ones((rows, 5), np.float32))
slow = sys.argv[2]
real = step.__call__
def sleepy(*a, **k):  # process 1 sleeps inside its step call (its host side)
    time.sleep(0.05)
    return real(*a, **k)
timed.step = sleepy if slow == "step" and jax.process_index() == 1 else step
for i in range(20):
    if slow == "data" and jax.process_index() == 1:
        time.sleep(0.05)  # a slow data loader on process 1
    state, loss = timed(state, batch)
    float(loss)  # a loop that logs
print("slow", [p for p, _ in timed.reports[-1].slow], timed.reports[-1], flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("slow", ["data", "step"])
def test_the_process_with_a_slow_loop_is_named_on_every_process(tmp_path, slow):
    out = launch(tmp_path, JOB, slow)
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):
        assert f"[{rank}] slow [1]" in out.stdout, out.stdout

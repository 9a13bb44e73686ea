"""Rerun: a suspicious step run again from a copy of its state tells a numerical
event (the same bits again) from a transient fault (other bits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_loss, mlp_params

import jaxsync

SIZES = (12, 33, 17, 5)
FAULT = {"armed": False}


def _glitch(x):
    """One-off corruption: the first call after arming returns NaN, then 1 again."""
    if FAULT["armed"]:
        FAULT["armed"] = False
        return np.float32(np.nan)
    return np.float32(1.0)


def faulty_loss(params, batch):
    # A device's result corrupted once, as a flipped bit in a GPU's arithmetic would.
    flag = jax.experimental.io_callback(_glitch, jax.ShapeDtypeStruct((), jnp.float32), 0.0)
    return mlp_loss(params, batch) * flag


def _run(mesh, batches, arm_at=None, **kw):
    step = jaxsync.train_step(faulty_loss, optax.adam(1e-2), mesh, "ddp")
    rerun = jaxsync.Rerun(step, **kw)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    for i, b in enumerate(batches):
        FAULT["armed"] = i == arm_at
        state, _ = rerun(state, b)
    return step, state, rerun.reports


def _batches(n=5):
    xs, ys = make_batches(jax.random.PRNGKey(1), n, 32, SIZES)
    return [(xs[i], ys[i]) for i in range(n)]


def test_a_transient_fault_does_not_reproduce_and_training_goes_on_as_if_none(mesh8):
    batches = _batches()
    step, clean, none = _run(mesh8, batches)
    assert none == []
    step, state, (report,) = _run(mesh8, batches, arm_at=2)
    assert (report.step, report.reason, report.reproducible) == (2, "nonfinite", False)
    assert np.isnan(report.loss) and np.isfinite(report.rerun_loss)
    assert any("params" in p for p in report.differing)
    # The rerun's result was kept: the same bits as the run that had no fault.
    for a, b in zip(jax.tree.leaves(step.params(state)), jax.tree.leaves(step.params(clean)),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(state.step) == 5 and "transient fault" in str(report)


def test_a_nan_in_the_data_reproduces(mesh8):
    batches = _batches()
    x, y = batches[3]
    batches[3] = (x.at[0, 0].set(jnp.nan), y)
    step, state, (report,) = _run(mesh8, batches)
    assert (report.step, report.reason, report.reproducible) == (3, "nonfinite", True)
    assert report.differing == () and "numerical event" in str(report)
    assert int(state.step) == 4  # the skipped step stays skipped


def test_a_loss_jump_is_run_again(mesh8):
    batches = _batches(6)
    x, y = batches[4]
    batches[4] = (x, y * 100.0)  # a spike the data makes: it reproduces
    _, _, (report,) = _run(mesh8, batches, loss_jump=3.0)
    assert (report.step, report.reason, report.reproducible) == (4, "loss jump", True)


def test_bad_options_are_named(mesh8):
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, "ddp")
    with pytest.raises(ValueError, match="`loss_jump`"):
        jaxsync.Rerun(step, loss_jump=0.5)
    with pytest.raises(ValueError, match="`window`"):
        jaxsync.Rerun(step, window=0)


def test_two_hundred_clean_steps_raise_no_alarm(mesh8):
    # Replica checks every 10 steps, a rerun on any loss 3x the recent mean, straggler
    # comparisons every 20: nothing is reported on a clean run.
    step = jaxsync.train_step(mlp_loss, optax.adam(1e-2), mesh8, "zero")
    rerun = jaxsync.Rerun(step, loss_jump=3.0)
    timed = jaxsync.Stragglers(rerun, every=20)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    xs, ys = make_batches(jax.random.PRNGKey(3), 200, 32, SIZES)
    for i in range(200):
        state, _ = timed(state, (xs[i], ys[i]))
        if (i + 1) % 10 == 0:
            assert jaxsync.replica_check(step, state).ok, i
    assert rerun.reports == []
    assert len(timed.reports) == 10 and all(r.slow == () for r in timed.reports)

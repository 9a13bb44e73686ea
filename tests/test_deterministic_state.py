"""Deterministic mode through train_step: skipped steps, metrics and model state
that do not depend on the data-parallel size."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx

import jaxsync

PARAMS = {"w": jnp.ones((4, 2))}


def log_loss(p, b):
    return jnp.mean(jnp.log(b["x"] @ p["w"]))


def bad_batch():
    x = np.ones((8, 4), np.float32)
    x[3] = -1.0  # log of a negative: a NaN loss, finite gradient
    x[5] = 0.0  # log(0): -inf loss, NaN gradient, in unit 5 of 8
    return {"x": x}


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_a_skipped_step_reports_the_same_nan_and_units_at_every_size(mode):
    require_devices(8)
    seen = set()
    for n in (1, 2, 4, 8):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        step = jaxsync.train_step(
            log_loss, optax.sgd(0.1), mesh, mode=mode,
            deterministic=jaxsync.Deterministic(units=8),
        )  # fmt: skip
        state, loss = step(step.init(PARAMS), bad_batch())
        m = state.metrics
        # Before: -inf (0xff800000) at N >= 2 and NaN at N = 1; ddp counted N devices.
        seen.add(np.asarray(loss).tobytes())
        assert bool(m.skipped) and int(state.step) == 0
        assert m.nonfinite_devices.tolist() == [1] and m.first_nonfinite_device.tolist() == [5]
    assert seen == {np.float32(np.nan).tobytes()}


def test_model_state_is_refused_by_name():
    require_devices(2)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.lin(x)))

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    for mode in ("ddp", "zero"):
        step = jaxsync.train_step(
            lambda m, b: jnp.mean(m(b)), optax.sgd(0.1), mesh, mode=mode,
            deterministic=jaxsync.Deterministic(units=8),
        )  # fmt: skip
        with pytest.raises(ValueError, match=rf"bn.mean, bn.var, drop.rngs.*mode='{mode}'"):
            step.init(Model(nnx.Rngs(0)))

"""No silent wrong answers: bad input fails early and names what is wrong.

Most tests here only trace (``.trace``/``eval_shape``): the errors are raised at
trace time, so nothing is compiled.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import mlp_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src import elementwise
from jaxsync._src.loss_scale import init_loss_scale, update_loss_scale


def small_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"b": 0.1 * jax.random.normal(k1, (4,)), "w": jax.random.normal(k2, (8, 4))}


def small_loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def small_batch(mesh, rows=16):
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x, y = jax.random.normal(kx, (rows, 8)), jax.random.normal(ky, (rows, 4))
    return jaxsync.shard_batch((x, y), mesh)


# ---------------------------------------------------------------- loss scale
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0, True, "1024", 1e39])
def test_constant_loss_scale_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="`loss_scale`"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", loss_scale=bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"initial_scale": float("nan")}, "`initial_scale` must be a finite number > 0"),
        ({"initial_scale": float("inf")}, "`initial_scale` must be a finite number > 0"),
        ({"initial_scale": 0.0}, "`initial_scale`"),
        ({"initial_scale": -1.0}, "`initial_scale`"),
        ({"initial_scale": 1e39}, "`initial_scale`"),  # Inf in float32
        ({"min_scale": float("nan")}, "`min_scale`"),
        ({"min_scale": 0.0}, "`min_scale`"),
        ({"growth_factor": float("inf")}, "`growth_factor`"),
        ({"growth_factor": 0.5}, "`growth_factor` must be a finite number >= 1"),
        ({"backoff_factor": 1.0}, r"`backoff_factor` must be a number in \(0, 1\)"),
        ({"backoff_factor": 0.0}, "`backoff_factor`"),
        ({"growth_interval": 0}, "`growth_interval` must be an integer >= 1"),
        ({"growth_interval": 2.5}, "`growth_interval`"),
        ({"hysteresis": 0}, "`hysteresis`"),
        ({"initial_scale": 2.0, "min_scale": 4.0}, "`min_scale` .* is above `initial_scale`"),
    ],
)
def test_dynamic_loss_scale_rejects_nonsense(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxsync.DynamicLossScale(**kwargs)


def test_dynamic_loss_scale_never_grows_to_inf():
    """An Inf scale makes every step non-finite and backs off to Inf: never reach it."""
    cfg = jaxsync.DynamicLossScale(initial_scale=2.0**127, growth_interval=1, hysteresis=1)
    s = update_loss_scale(cfg, init_loss_scale(cfg), jnp.asarray(True))
    assert float(s.scale) == 2.0**127
    s = update_loss_scale(cfg, s, jnp.asarray(False))
    assert float(s.scale) == 2.0**126

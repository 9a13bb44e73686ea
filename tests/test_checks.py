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


# ---------------------------------------------------------- elementwise probe
def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


def test_small_weight_decay_with_mask_callable_rejected(mesh8):
    """On flat shards the mask sees 1-D arrays and decays nothing; a decay of 3e-4
    hid under the old probe's tolerance. A step of zero gradients leaves only the
    decay, so tree and shards differ by all of it."""
    params = mlp_params(jax.random.PRNGKey(0))
    inner = optax.adamw(1e-3, weight_decay=3e-4, mask=_decay_mask)
    tx = jaxsync.distributed_optimizer(inner, axis_name="data")
    with pytest.raises(ValueError, match=r"not elementwise.*\['layer0'\]\['w'\] after a step of "
                       "zero gradients.*pass `labels=`"):
        tx.sharded_init(params, mesh8)


def test_unfactored_looking_adafactor_rejected_on_real_shapes():
    """Adafactor factors dims >= 128: the old probe (dims <= 3) never saw it."""
    inner = optax.adafactor(1e-3, multiply_by_parameter_scale=False, clipping_threshold=None)
    params = {"w": jax.ShapeDtypeStruct((128, 160), jnp.float32), "b": jnp.zeros(160)}
    with pytest.raises(ValueError, match=r"not elementwise.*param \['w'\]"):
        elementwise.check_elementwise(inner, params, "all params")
    # Without a factored param it *is* elementwise, and the probe says so.
    elementwise.check_elementwise(inner, {"w": jnp.zeros((8, 160)), "b": jnp.zeros(160)}, "all")


@pytest.mark.parametrize(
    "inner",
    [
        optax.sgd(0.1),
        optax.sgd(0.05, momentum=0.9, nesterov=True),
        optax.adam(1e-3),
        optax.adamw(1e-3, weight_decay=0.1),
        optax.lion(1e-4, weight_decay=1e-2),
        optax.rmsprop(1e-3),
        optax.adagrad(1e-2),
        optax.nadam(1e-3),
        optax.adam(optax.cosine_decay_schedule(1e-3, 10)),
        optax.chain(optax.clip(1.0), optax.adam(1e-3)),  # elementwise clipping is fine
    ],
    ids=["sgd", "nesterov", "adam", "adamw", "lion", "rmsprop", "adagrad", "nadam", "sched", "clip"],
)
def test_elementwise_optimizers_accepted(inner):
    elementwise.check_elementwise(inner, mlp_params(jax.random.PRNGKey(0)), "all params")


@pytest.mark.parametrize(
    "inner",
    [
        optax.lamb(1e-3),
        optax.lars(1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.adamw(1e-3, weight_decay=1e-4, mask={"b": False, "w": True}),
    ],
    ids=["lamb", "lars", "clip_by_global_norm", "mask_pytree"],
)
def test_non_elementwise_rejected(inner):
    with pytest.raises(ValueError, match="not elementwise"):
        elementwise.check_elementwise(inner, small_params(), "all params")


def test_labels_buffer_probed_as_a_list_of_its_params():
    """Per-label buffers are probed on the list of their params (what a label's
    transformation sees there): adamw without a mask passes."""
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(12, 33), (33, 17)]]
    elementwise.check_elementwise(optax.adamw(1e-3, weight_decay=3e-4), shapes, "label 'decay'")


def test_probe_cost_is_capped_for_huge_models():
    shapes = ((128_000, 8192),) + ((8192, 8192),) * 4 + ((8192,),) * 8
    capped = elementwise.probe_shapes(shapes)
    assert sum(int(np.prod(s)) for s in capped) <= elementwise.PROBE_ELEMENTS
    # the structure, ranks and "large dimension" class survive the cap
    assert [len(s) for s in capped] == [len(s) for s in shapes]
    assert all(d >= elementwise.MIN_PROBE_DIM for s in capped for d in s)
    small = ((12, 33), (33,))
    assert elementwise.probe_shapes(small) == small  # real shapes below the budget

"""flax linen models whose params carry nn.with_partitioning boxes.

Handed to a step as they are, linen's own unboxing put a sharding constraint inside
the step's shard_map and failed with JAX errors that named nothing. The step unboxes
them at init: on a 1-D mesh they are plain params; on a (data, model) mesh a kernel
partitioned over "model" is tensor-parallel by its spec. Both train equal to
single-device SGD.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import require_devices
from jax.sharding import AxisType

import jaxsync

KERNEL = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
OUT = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(16, kernel_init=KERNEL)(x))
        return nn.Dense(3, kernel_init=OUT)(x)


MODEL = MLP()


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


def data(steps=2, rows=16):
    rng = np.random.default_rng(0)
    f32 = np.float32
    return [
        (rng.normal(size=(rows, 5)).astype(f32), rng.normal(size=(rows, 3)).astype(f32))
        for _ in range(steps)
    ]


def train_and_compare(mesh, mode):
    boxed = MODEL.init(jax.random.PRNGKey(0), jnp.ones((1, 5)))["params"]
    assert isinstance(boxed["Dense_0"]["kernel"], nn.Partitioned)
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh, mode)
    state = step.init(boxed)
    for b in data():
        state, _ = step(state, b)
    p = nn.unbox(boxed)
    for b in data():
        p = jax.tree.map(lambda x, g: x - 0.1 * g, p, jax.grad(loss_fn)(p, b))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), step.params(state), p
    )
    return step, state


def test_boxed_params_on_a_data_mesh(mesh8):
    for mode in ("zero", "fsdp"):
        train_and_compare(mesh8, mode)


def test_boxed_params_become_tensor_parallel_specs():
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    step, state = train_and_compare(mesh, "zero")
    kernel = step.params(state)["Dense_0"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")

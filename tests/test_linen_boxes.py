"""flax linen layers that box their params again inside the step (nn.DenseGeneral)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import train_beside_optax

import jaxsync

INIT = nn.initializers.lecun_normal()


class Attn(nn.Module):
    """A nanodo-style projection: rank-3 kernels boxed with names the mesh lacks."""

    @nn.compact
    def __call__(self, x):
        names = ("embed", "heads", "kv")
        h = nn.DenseGeneral((4, 8), kernel_init=nn.with_partitioning(INIT, names))(x)
        out = nn.DenseGeneral(
            16, axis=(-2, -1), kernel_init=nn.with_partitioning(INIT, names[1:] + names[:1])
        )
        return out(jnp.tanh(h))  # fmt: skip


MODEL = Attn()


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((MODEL.apply({"params": params}, x) - y) ** 2)


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_dense_general_s_boxed_kernels_train_as_on_one_device(mesh8, mode):
    # flax checks each param's shape by running its initializer, and DenseGeneral's
    # unboxes with a sharding constraint over ("embed", "heads", "kv"): inside the
    # step's shard_map that failed ("Resource axis: embed ... is not found in mesh").
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 32, 16))
    y = jax.random.normal(jax.random.PRNGKey(2), (3, 32, 16))
    boxed = MODEL.init(jax.random.PRNGKey(0), x[0])["params"]
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, mode)
    batches = [(x[i], y[i]) for i in range(3)]
    state, ref = train_beside_optax(step, step.init(boxed), optax.sgd(0.1), nn.unbox(boxed),
                                    loss_fn, batches)  # fmt: skip
    got = step.params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

"""The runs behind `tests/data/saved_states/` (written by an older jaxsync).

A tiny scanned MLP trained 3 steps per case; the same function re-runs them today
so a restored state can be compared against a fresh one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsync

#: mode, loss scale and optimizer of each saved case.
CASES = ("zero", "ddp", "fsdp")


def params0():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "inp": {"w": 0.3 * jax.random.normal(k[0], (8, 16))},
        "blocks": {"w": 0.2 * jax.random.normal(k[1], (2, 16, 16)), "b": jnp.zeros((2, 16))},
        "head": {"w": 0.3 * jax.random.normal(k[2], (16, 4))},
    }


def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["inp"]["w"])

    def body(h, layer):
        layer = jaxsync.tap(layer)
        return h + jnp.tanh(h @ layer["w"] + layer["b"]), None

    h, _ = jax.lax.scan(body, h, p["blocks"])
    return jnp.mean((h @ p["head"]["w"] - y) ** 2)


def batches(n=3, rows=16):
    rng = np.random.default_rng(0)
    f32 = np.float32
    return [
        (rng.normal(size=(rows, 8)).astype(f32), rng.normal(size=(rows, 4)).astype(f32))
        for _ in range(n)
    ]


def make_step(case, mesh):
    return jaxsync.train_step(
        loss_fn, optax.adamw(1e-2), mesh, mode=case, stacked="blocks",
        clip_grad_norm=1.0, loss_scale=jaxsync.DynamicLossScale(2.0**10),
    )  # fmt: skip


def run(case, mesh):
    step = make_step(case, mesh)
    state = step.init(params0())
    for b in batches():
        state, _ = step(state, b)
    return step, state

"""Data-parallel training of a small MLP with jaxsync's bucketed gradient sync.

    python examples/data_parallel_demo.py            # 8 simulated CPU devices if no GPU

Each device computes local gradients on its slice of the batch
(`jaxsync.value_and_grad`), the gradients are all-reduced bucket by bucket in
fp32 (`jaxsync.all_reduce_grads`), and plain optax applies the update.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jaxsync  # noqa: E402


def init(key, sizes=(32, 256, 256, 1)):
    params = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (a, b)) / jnp.sqrt(a), "b": jnp.zeros(b)})
    return params


def loss_fn(params, batch):
    x, y = batch
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.gelu(x)
    return jnp.mean((x[:, 0] - y) ** 2)


def main(steps: int = 200, global_batch: int = 256, bucket_size: int = 2**15) -> None:
    console = Console()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    params = init(jax.random.PRNGKey(0))
    layout = jaxsync.build_layout(params, bucket_size=bucket_size)
    console.print(f"[bold]{jax.device_count()} devices ({jax.default_backend()})[/bold]")
    console.print(layout.summary())
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    target_w = jax.random.normal(jax.random.PRNGKey(42), (32,))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))
    def step(params, opt_state, batch):
        loss, grads = jaxsync.value_and_grad(loss_fn, axis_name="data")(params, batch)
        grads = jaxsync.all_reduce_grads(grads, axis_name="data", bucket_size=bucket_size)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    table = Table("step", "loss")
    key = jax.random.PRNGKey(1)
    for i in range(steps):
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (global_batch, 32))
        y = jnp.tanh(x @ target_w / jnp.sqrt(32.0))
        params, opt_state, loss = step(params, opt_state, jaxsync.shard_batch((x, y), mesh))
        if i % 25 == 0 or i == steps - 1:
            table.add_row(str(i), f"{float(loss):.4f}")
    console.print(table)


if __name__ == "__main__":
    main()

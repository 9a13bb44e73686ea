"""Per-device memory of a fully sharded (FSDP) training step as N grows.

    python benchmarks/bench_fsdp.py              # 8 simulated CPU devices if no GPU

For N = 1, 2, 4, 8 data-parallel ranks: the compiled step's memory analysis
(arguments = param shards + Adam state + batch; temporaries = gathered units,
activations, gradients) for ``jaxsync.fully_shard`` with and without
``reshard_after_forward``, next to replicated data parallelism (params and Adam
state on every device). The per-device batch is fixed, so activations stay
constant and the sharded part shrinks as 1/N. One run, one table.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jaxsync  # noqa: E402

MiB = 2**20


def init(key, width, depth):
    ks = jax.random.split(key, 2 * depth)
    return {
        "blocks": {
            str(i): {
                "up": jax.random.normal(ks[2 * i], (width, 4 * width)) / np.sqrt(width),
                "down": jax.random.normal(ks[2 * i + 1], (4 * width, width)) / np.sqrt(4 * width),
            }
            for i in range(depth)
        }
    }


def block(i):
    def f(p, x):
        return x + jax.nn.gelu(x @ p[f"blocks.{i}.up"]) @ p[f"blocks.{i}.down"]

    return f


def mem(compiled) -> dict[str, float]:
    m = compiled.memory_analysis()
    return {
        "args": m.argument_size_in_bytes / MiB,
        "temp": m.temp_size_in_bytes / MiB,
        "out": m.output_size_in_bytes / MiB,
        "alias": m.alias_size_in_bytes / MiB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch-per-device", type=int, default=8)
    args = ap.parse_args()
    params = init(jax.random.PRNGKey(0), args.width, args.depth)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    units = [f"blocks.{i}" for i in range(args.depth)]
    adam = optax.adam(1e-3)
    rows = []
    for n in (1, 2, 4, 8):
        if n > jax.device_count():
            break
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        x = jax.device_put(
            jnp.ones((n * args.batch_per_device, args.width)), NamedSharding(mesh, P("data"))
        )
        for reshard in (False, True):
            fs = jaxsync.fully_shard(
                params, axis_name="data", units=units, mesh=mesh, reshard_after_forward=reshard
            )
            shards = fs.shard(params, mesh)
            state, sspecs = fs.init_optimizer(adam, shards, mesh)

            def loss(shards, x, fs=fs):
                for i in range(args.depth):
                    x = fs.apply(shards, f"blocks.{i}", block(i), x)
                return jnp.mean(x**2)

            @partial(jax.jit, donate_argnums=(0, 1))
            @partial(
                jax.shard_map,
                mesh=mesh,
                in_specs=(fs.specs(), sspecs, P("data")),
                out_specs=(fs.specs(), sspecs),
            )
            def step(shards, state, x, loss=loss):
                g = jax.grad(loss)(shards, x)
                u, state = adam.update(g, state, shards)
                return optax.apply_updates(shards, u), state

            c = step.lower(shards, state, x).compile()
            rows.append((f"fsdp reshard={reshard}", n, mem(c), None))

        rep = NamedSharding(mesh, P())
        p_rep = jax.device_put(params, rep)
        s_rep = jax.device_put(adam.init(params), rep)

        @partial(jax.jit, donate_argnums=(0, 1))
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
        def ddp(params, state, x):
            def loss(p, x):
                for i in range(args.depth):
                    x = block(i)(
                        {
                            jaxsync.param_name(k): v
                            for k, v in jax.tree_util.tree_flatten_with_path(p)[0]
                        },
                        x,
                    )
                return jnp.mean(x**2)

            _, g = jaxsync.value_and_grad(loss, axis_name="data")(params, x)
            g = jaxsync.all_reduce_grads(g, axis_name="data")
            u, state = adam.update(g, state, params)
            return optax.apply_updates(params, u), state

        rows.append(("replicated DDP", n, mem(ddp.lower(p_rep, s_rep, x).compile()), None))

    table = Table(
        title=f"{n_params / 1e6:.2f}M fp32 params, Adam, {args.batch_per_device} "
        f"rows x {args.width} per device ({jax.devices()[0].platform})"
    )
    for col in ("variant", "N", "arguments MiB", "temporaries MiB", "args+temp MiB", "args vs N=1"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    base = {}
    for name, n, m, _ in rows:
        total = m["args"] + m["temp"]
        base.setdefault(name, m["args"])
        table.add_row(
            name,
            str(n),
            f"{m['args']:.2f}",
            f"{m['temp']:.2f}",
            f"{total:.2f}",
            f"{m['args'] / base[name]:.3f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

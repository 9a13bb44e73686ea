"""The scanned residual-MLP benchmark of issue #12: jaxsync in-loop ZeRO vs GSPMD.

Residual tanh-MLP blocks (d=128) stacked ``[L, ...]`` and run by ``lax.scan``, AdamW,
8 simulated CPU devices. Columns: GSPMD weight-update sharding (``jax.jit`` with the
optimizer state sharded by ``NamedSharding``), the grads + ``pmean`` floor, and the
jaxsync distributed optimizer with the gradients reduce-scattered inside the
backward scan (``sync=tx``) or after it. Median step ms; one run, noisy.

    python benchmarks/bench_scan_mlp.py [--layers 8,32,96] [--steps 8]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsync  # noqa: E402

D, BATCH = 128, 64


def init(layers: int) -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    blocks = {
        "w1": jax.random.normal(k1, (layers, D, D)) / np.sqrt(D),
        "b1": jnp.zeros((layers, D)),
        "w2": jax.random.normal(k2, (layers, D, D)) / np.sqrt(D),
    }
    return jax.tree.map(np.asarray, {"blocks": blocks, "head": jnp.ones((D,))})


def loss_fn(params: dict, x: jax.Array) -> jax.Array:
    def body(h, p):
        p = jaxsync.tap(p)
        return h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"], None

    h, _ = jax.lax.scan(body, x, params["blocks"])
    return jnp.mean((h * params["head"]) ** 2)


def median_ms(step, args: tuple, steps: int) -> float:
    args = step(*args)[: len(args)]
    jax.block_until_ready(args)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        args = step(*args)[: len(args)]
        jax.block_until_ready(args)
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def gspmd(params: dict, x0: np.ndarray, inner, steps: int) -> float:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def shard_last(a):
        spec = [None] * a.ndim
        if a.ndim and a.shape[-1] % 8 == 0:
            spec[-1] = "data"
        return NamedSharding(mesh, P(*spec))

    state = inner.init(params)
    state_sh = jax.tree.map(shard_last, state)
    p_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    x_sh = NamedSharding(mesh, P("data"))

    @partial(jax.jit, donate_argnums=(0, 1), out_shardings=(p_sh, state_sh, x_sh))
    def step(p, s, x):
        g = jax.grad(loss_fn)(p, x)
        u, s = inner.update(g, s, p)
        return optax.apply_updates(p, u), s, x

    args = (jax.device_put(params, p_sh), jax.device_put(state, state_sh), jax.device_put(x0, x_sh))
    return median_ms(step, args, steps)


def sharded(params: dict, x0: np.ndarray, inner, steps: int, mode: str) -> float:
    mesh = jax.make_mesh((8,), ("data",))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    x = jax.device_put(x0, NamedSharding(mesh, P("data")))
    if mode == "floor":

        @partial(jax.jit, donate_argnums=(0,))
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
        def floor(p, x):
            _, g = jaxsync.value_and_grad(loss_fn, axis_name="data")(p, x)
            g = jax.lax.pmean(g, "data")
            return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), x

        return median_ms(floor, (p, x), steps)
    tx = jaxsync.distributed_optimizer(inner, axis_name="data", stacked="blocks")
    state, specs = tx.sharded_init(p, mesh), tx.state_specs(p, mesh)
    sync = tx if mode == "in_loop" else None

    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs, P("data")),
    )
    def step(p, s, x):
        _, g = jaxsync.value_and_grad(loss_fn, axis_name="data", sync=sync)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, x

    return median_ms(step, (p, state, x), steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="8,32,96")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    inner = optax.adamw(1e-3)
    x0 = np.asarray(jax.random.normal(jax.random.key(1), (BATCH, D)))
    print(
        f"**{jax.device_count()} x {jax.default_backend()} devices, residual tanh-MLP "
        f"blocks d={D}, scanned, AdamW, batch {BATCH}, median of {args.steps} steps**\n"
    )
    print(
        "| layers | GSPMD ms | floor ms | jaxsync ZeRO in-loop ms | vs GSPMD "
        "| jaxsync ZeRO after-loop ms | vs GSPMD |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for layers in (int(n) for n in args.layers.split(",")):
        params = init(layers)
        g = gspmd(params, x0, inner, args.steps)
        f = sharded(params, x0, inner, args.steps, "floor")
        i = sharded(params, x0, inner, args.steps, "in_loop")
        a = sharded(params, x0, inner, args.steps, "after_loop")
        print(f"| {layers} | {g:.1f} | {f:.1f} | {i:.1f} | {i / g:.2f}x | {a:.1f} | {a / g:.2f}x |")


if __name__ == "__main__":
    main()

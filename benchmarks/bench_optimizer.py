"""jaxsync's distributed optimizer against what a JAX user would write without it.

    python benchmarks/bench_optimizer.py                 # 8 simulated CPU devices if no GPU
    python benchmarks/bench_optimizer.py --width 2048 --steps 30

A bf16 MLP of a few million params, fp32 Adam with fp32 master weights, on a
1-D ``data`` mesh of all devices. Variants:

  replicated   shard_map, local grads + fp32 ``pmean``, optax Adam and fp32 master
               replicated on every device (the plain data-parallel baseline)
  gspmd        ``jax.jit`` with master and Adam state sharded over ``data`` by
               ``NamedSharding`` (XLA's own weight-update sharding)
  floor        compute the grads and all-reduce them, nothing else
  jaxsync      ``jaxsync.distributed_optimizer`` (per bucket size)

For each: per-device optimizer-state bytes (read from the arrays' addressable
shards), collectives in the compiled step (buffers and MB), compile time and
median step time, with the step-time ratio to gspmd and to floor. One run, one
table: ratios from the same run are what to quote; these machines are noisy.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jaxsync  # noqa: E402

AXIS = "data"


def init_params(width: int, depth: int, dtype=jnp.bfloat16):
    key = jax.random.PRNGKey(0)
    layers = []
    for _ in range(depth):
        key, k = jax.random.split(key)
        w = jax.random.normal(k, (width, width), jnp.float32) / jnp.sqrt(width)
        layers.append({"w": w.astype(dtype), "b": jnp.zeros((width,), dtype)})
    return layers


def loss_fn(params, batch):
    x, y = batch
    h = x
    for layer in params:
        h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    return jnp.mean(jnp.square(h.astype(jnp.float32) - y))


def state_bytes(tree, device) -> int:
    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for s in leaf.addressable_shards
        if s.device == device
    )


def bench(name, step, args, make_args, steps):
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    stats = jaxsync.collective_stats(compiled.as_text())
    out = args
    for _ in range(3):  # warm-up
        out = make_args(compiled(*out))
    jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = make_args(compiled(*out))
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return {
        "name": name,
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times),
        "collectives": stats,
    }


def collectives_cell(c: dict) -> str:
    """``"AR1:16.0, RS1:2.0"``: count and MiB per collective kind, for a table cell."""
    short = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG"}
    return ", ".join(
        f"{short[k]}{c[k].count}:{c[k].bytes / 2**20:.1f}" for k in short if c[k].count
    )


def setup(width: int, depth: int, batch_per_device: int) -> tuple:
    """``(mesh, replicated params, batch sharded over the data axis)`` on every device."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,))
    params = jax.device_put(init_params(width, depth), NamedSharding(mesh, P()))
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    batch = jax.device_put(
        (
            jax.random.normal(kx, (batch_per_device * n, width), jnp.bfloat16),
            jax.random.normal(ky, (batch_per_device * n, width), jnp.float32),
        ),
        NamedSharding(mesh, P(AXIS)),
    )
    return mesh, params, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch-per-device", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--buckets",
        type=str,
        default="none,1048576,262144",
        help="comma-separated jaxsync bucket sizes in elements ('none': one)",
    )
    args = ap.parse_args()

    n = jax.device_count()
    mesh, params, batch = setup(args.width, args.depth, args.batch_per_device)
    dev0 = jax.devices()[0]
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    n_params = sum(p.size for p in jax.tree.leaves(params))
    gb = args.batch_per_device * n
    adam = optax.adam(1e-4)
    rows, mem = [], {}

    # (a) replicated optax, fp32 master, pmean grads -------------------------------
    master = jax.device_put(jax.tree.map(lambda p: p.astype(jnp.float32), params), rep)
    opt_state = jax.device_put(adam.init(master), rep)
    mem["replicated"] = state_bytes((master, opt_state), dev0)

    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P()))
    def replicated(master, opt_state, batch):
        model = jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)
        _, g = jaxsync.value_and_grad(loss_fn, axis_name=AXIS)(model, batch)
        g = jax.tree.map(lambda x: jax.lax.pmean(x.astype(jnp.float32), AXIS), g)
        updates, opt_state = adam.update(g, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    rows.append(
        bench(
            "replicated", replicated, (master, opt_state, batch), lambda o: (*o, batch), args.steps
        )
    )

    # (b) jit + NamedSharding of master and state (XLA weight-update sharding) ----
    def shard_leaf(x):
        return jax.device_put(x, shard if x.ndim and x.shape[0] % n == 0 else rep)

    master_s = jax.tree.map(shard_leaf, jax.tree.map(lambda p: p.astype(jnp.float32), params))
    state_s = jax.tree.map(shard_leaf, adam.init(master_s))
    mem["gspmd"] = state_bytes((master_s, state_s), dev0)
    state_shardings = jax.tree.map(lambda x: x.sharding, (master_s, state_s))

    @partial(
        jax.jit,
        donate_argnums=(0, 1, 2),
        out_shardings=(jax.tree.map(lambda _: rep, params), *state_shardings),
    )
    def gspmd(params, master, opt_state, batch):
        g = jax.grad(loss_fn)(params, batch)
        g = jax.tree.map(
            lambda x, s: jax.sharding.reshard(x.astype(jnp.float32), s), g, state_shardings[0]
        )
        updates, opt_state = adam.update(g, opt_state, master)
        master = optax.apply_updates(master, updates)
        return jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), master, opt_state

    rows.append(
        bench(
            "gspmd",
            gspmd,
            (jax.tree.map(jnp.copy, params), master_s, state_s, batch),
            lambda o: (*o, batch),
            args.steps,
        )
    )

    # (c) floor: grads + all-reduce only -----------------------------------------
    @partial(jax.jit, donate_argnums=(0,))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P())
    def floor(params, batch):
        _, g = jaxsync.value_and_grad(loss_fn, axis_name=AXIS)(params, batch)
        g = jax.tree.map(lambda x: jax.lax.pmean(x.astype(jnp.float32), AXIS), g)
        # hand back params so the loop has the same shape as the others
        return jax.tree.map(
            lambda p, x: p + (0 * x[..., :1]).astype(p.dtype) if p.ndim == 2 else p, params, g
        )

    rows.append(
        bench(
            "floor",
            floor,
            (jax.tree.map(jnp.copy, params), batch),
            lambda o: (o, batch),
            args.steps,
        )
    )

    # (d) jaxsync distributed optimizer ------------------------------------------
    for b in args.buckets.split(","):
        bucket = None if b.strip().lower() == "none" else int(b)
        tx = jaxsync.distributed_optimizer(adam, axis_name=AXIS, bucket_size=bucket)
        state = tx.sharded_init(params, mesh)
        specs = tx.state_specs(params, mesh)
        name = f"jaxsync b={'one' if bucket is None else bucket}"
        nb = tx.layout(params, mesh).num_buckets
        mem[name] = state_bytes(state, dev0)

        @partial(jax.jit, donate_argnums=(0, 1))
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
        def zero(params, state, batch, tx=tx):
            _, g = jaxsync.value_and_grad(loss_fn, axis_name=AXIS)(params, batch)
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state

        row = bench(
            name,
            zero,
            (jax.tree.map(jnp.copy, params), state, batch),
            lambda o: (*o, batch),
            args.steps,
        )
        row["name"] = f"{name} ({nb} buckets)"
        mem[row["name"]] = mem.pop(name)
        rows.append(row)

    mem["floor"] = 0
    by = {r["name"]: r for r in rows}
    gs, fl = by["gspmd"]["step_ms"], by["floor"]["step_ms"]
    table = Table(
        title=(
            f"{n} x {jax.devices()[0].platform} devices, {n_params / 1e6:.2f}M bf16 params, "
            f"fp32 Adam, global batch {gb}"
        )
    )
    for col in (
        "variant",
        "state MiB/device",
        "vs replicated",
        "collectives (buffers: MiB)",
        "compile s",
        "step ms",
        "vs gspmd",
        "vs floor",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        coll = collectives_cell(r["collectives"])
        m = mem[r["name"]]
        table.add_row(
            r["name"],
            f"{m / 2**20:.2f}",
            f"{m / mem['replicated']:.3f}" if m else "-",
            coll,
            f"{r['compile_s']:.2f}",
            f"{r['step_ms']:.1f}",
            f"{r['step_ms'] / gs:.2f}x",
            f"{r['step_ms'] / fl:.2f}x",
        )
    Console(width=200).print(table)
    Console(width=200).print(
        "AR / RS / AG = all-reduce / reduce-scatter / all-gather: buffers communicated: MiB"
    )


if __name__ == "__main__":
    main()

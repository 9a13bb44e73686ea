"""Deterministic mode against the default mode: step time and bytes communicated.

    python benchmarks/bench_deterministic.py              # 8 simulated CPU devices if no GPU
    python benchmarks/bench_deterministic.py --steps 20

The model of ``bench_optimizer.py`` (a bf16 MLP of 4.2M params, fp32 Adam),
trained with the distributed optimizer (ZeRO) and with plain data parallelism
(``all_reduce_grads`` + replicated Adam), each in the default mode and with
``jaxsync.Deterministic``. With ``units`` equal to the device count each
device runs one unit (no extra memory); with twice as many it runs two, one
after the other. For each: collectives in the compiled step (kind, count,
MiB), compile time, median step time and its ratio to the default mode.
Steps run round-robin over the variants (load from other processes falls on
all alike). One run, one table: ratios from the same run are what to quote.
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from bench_optimizer import collectives_cell, loss_fn, setup  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jaxsync  # noqa: E402

AXIS = "data"


def zero_step(mesh, params, det):
    tx = jaxsync.distributed_optimizer(optax.adam(1e-4), axis_name=AXIS, deterministic=det)
    specs = tx.state_specs(params, mesh)

    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
    def step(params, state, batch):
        _, g = jaxsync.value_and_grad(loss_fn, axis_name=AXIS, deterministic=det)(params, batch)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    return step, (tx.sharded_init(params, mesh),)


def ddp_step(mesh, params, det):
    adam = optax.adam(1e-4)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    state = jax.device_put(adam.init(master), NamedSharding(mesh, P()))

    @partial(jax.jit, donate_argnums=(0, 1, 2))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS)), out_specs=(P(),) * 3)
    def step(params, master, state, batch):
        _, g = jaxsync.value_and_grad(loss_fn, axis_name=AXIS, deterministic=det)(params, batch)
        g = jaxsync.all_reduce_grads(g, axis_name=AXIS, deterministic=det)
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        updates, state = adam.update(g, state, master)
        master = optax.apply_updates(master, updates)
        return jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), master, state

    return step, (jax.device_put(master, NamedSharding(mesh, P())), state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch-per-device", type=int, default=16)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()

    n = jax.device_count()
    mesh, params, batch = setup(args.width, args.depth, args.batch_per_device)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    gb = args.batch_per_device * n
    variants = [
        ("zero", None),
        ("zero", jaxsync.Deterministic(units=n)),
        ("zero", jaxsync.Deterministic(units=2 * n)),
        ("ddp", None),
        ("ddp", jaxsync.Deterministic(units=n)),
    ]
    rows = []
    for kind, det in variants:
        make = zero_step if kind == "zero" else ddp_step
        step, state = make(mesh, params, det)
        name = f"{kind} " + ("default" if det is None else f"deterministic U={det.units}")
        t0 = time.perf_counter()
        compiled = step.lower(params, *state, batch).compile()
        rows.append(
            {
                "name": name,
                "kind": kind,
                "det": det,
                "step": compiled,
                "args": (jax.tree.map(jnp.copy, params), *state),
                "compile_s": time.perf_counter() - t0,
                "collectives": jaxsync.collective_stats(compiled.as_text()),
                "times": [],
            }
        )
    # Round-robin over the variants, so that load from other processes on the
    # machine falls on all of them alike; the median of each is reported.
    for i in range(3 + args.steps):
        for r in rows:
            t0 = time.perf_counter()
            r["args"] = jax.block_until_ready(r["step"](*r["args"], batch))
            if i >= 3:
                r["times"].append(time.perf_counter() - t0)
    for r in rows:
        r["step_ms"] = 1e3 * statistics.median(r["times"])

    base = {r["kind"]: r["step_ms"] for r in rows if r["det"] is None}
    table = Table(
        title=(
            f"{n} x {jax.devices()[0].platform} devices, {n_params / 1e6:.2f}M bf16 params, "
            f"fp32 Adam, global batch {gb}"
        )
    )
    for col in (
        "variant",
        "collectives (count: MiB)",
        "MiB moved",
        "compile s",
        "step ms",
        "ratio",
    ):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        c = r["collectives"]
        coll = collectives_cell(c)
        total = sum(c[k].bytes for k in c) / 2**20
        table.add_row(
            r["name"],
            coll,
            f"{total:.1f}",
            f"{r['compile_s']:.1f}",
            f"{r['step_ms']:.1f}",
            f"{r['step_ms'] / base[r['kind']]:.2f}x",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

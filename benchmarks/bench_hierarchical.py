"""Node-aware reduction on a multi-host GPU mesh, as XLA's cost model prices it.

    python benchmarks/bench_hierarchical.py                 # 64 x H100 over 8 hosts
    python benchmarks/bench_hierarchical.py --hosts 4 --mib 50 400

Megatron and NCCL users reduce within a host over NVLink first, then across hosts
on 1/gpus_per_host of the bytes, and a HSDP-style optimizer keeps its state sharded
inside a host and replicated across hosts. Whether that pays depends on how the
interconnect is priced, so this script asks XLA's own model (compile-only GPUs,
:func:`jaxsync.gpu_topology`, read by :func:`jaxsync.schedule_report`, both
readings) what each way of moving one gradient buffer costs, on a mesh split into
``("dcn", "ici")`` = (hosts, GPUs per host):

- ``flat``: one collective over all GPUs (what jaxsync's steps send);
- ``host first``: reduce-scatter within the host, then across hosts on 1/G of
  the bytes (all-gather: across hosts first, then within);
- ``hsdp``: reduce-scatter within the host, then all-reduce the 1/G shard across
  hosts (the state sharded per host, replicated across hosts).

Each row is one buffer of ``--mib`` MiB per GPU in fp32 and in bf16; the time is
the modeled step of a program holding that collective alone. One run, one table.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: never start CUDA

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsync  # noqa: E402

ALL = ("dcn", "ici")


def variants(g: int) -> dict[str, object]:
    """Ways of moving a flat ``[n]`` buffer; ``n`` divides by the device count."""
    rs, ag = jax.lax.psum_scatter, jax.lax.all_gather
    return {
        "reduce-scatter, flat": lambda b: rs(b, ALL, tiled=True),
        "reduce-scatter, host first": lambda b: rs(rs(b, "ici", tiled=True), "dcn", tiled=True),
        "reduce-scatter, hsdp": lambda b: jax.lax.psum(rs(b, "ici", tiled=True), "dcn"),
        "all-gather, flat": lambda b: ag(b[: b.size // g], ALL, tiled=True),
        "all-gather, hosts first": lambda b: ag(
            ag(b[: b.size // g], "dcn", tiled=True), "ici", tiled=True
        ),
        "all-reduce, flat": lambda b: jax.lax.psum(b, ALL),
        "all-reduce, host first": lambda b: ag(
            jax.lax.psum(rs(b, "ici", tiled=True), "dcn"), "ici", tiled=True
        ),
    }


def measure(hosts: int, gpus: int, mib: float, dtype) -> dict[str, tuple[float, float]]:
    mesh = jaxsync.gpu_topology(
        "h100", hosts=hosts, gpus_per_host=gpus, axes={"dcn": hosts, "ici": gpus}
    )
    n_dev = hosts * gpus
    n = int(mib * 2**20) // jnp.dtype(dtype).itemsize
    n -= n % n_dev
    x = jax.ShapeDtypeStruct((n_dev * n,), dtype, sharding=NamedSharding(mesh, P(ALL)))
    out = {}
    for name, f in variants(n_dev).items():
        body = jax.shard_map(f, mesh=mesh, in_specs=P(ALL), out_specs=P(ALL), check_vma=False)
        r = jaxsync.schedule_report(jax.jit(body).lower(x))
        out[name] = (r.step_us, r.makespan_us)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--mib", type=float, nargs="*", default=[25.0, 200.0])
    args = ap.parse_args()
    print(f"{args.hosts} hosts x {args.gpus_per_host} H100, XLA's model; jax {jax.__version__}\n")
    print("| buffer per GPU | dtype | collective | statistics us | timeline us | vs flat |")
    print("|---:|---|---|---:|---:|---:|")
    for mib in args.mib:
        for dtype in (jnp.float32, jnp.bfloat16):
            rows = measure(args.hosts, args.gpus_per_host, mib, dtype)
            for name, (stats, line) in rows.items():
                flat = rows[name.split(",")[0] + ", flat"][0]
                print(
                    f"| {mib:g} MiB | {jnp.dtype(dtype).name} | {name} | {stats:.0f} | "
                    f"{line:.0f} | {stats / flat:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

"""What reducing gradients in bf16 costs in accuracy (the ``reduce_dtype`` option).

    python benchmarks/bench_reduce_dtype.py [--devices 64]

GSPMD reduce-scatters a bf16 model's gradients in bf16; jaxsync sums them in fp32 by
default (``reduce_dtype=jnp.float32``). Inside one host it sends them in bf16 and
sums the pieces in fp32 (an all-to-all, ``sync.collectives.scatter_wire_sum``:
GSPMD's bytes); across hosts, as an fp32 ring (twice the bytes). This measures
what each costs in accuracy: the gradients of ``bench_scan``'s scanned GPT (bf16
params) on 8 simulated CPU devices, each on its own rows, are summed by
``jax.lax.psum_scatter`` in bf16 and in fp32, and compared with their exact sum
(float64 on the host). Reported: the relative L2 error
of the mean gradient, the share of elements whose bf16 value is not the correctly
rounded bf16 mean, and the largest error in bf16 ulps of the exact mean. XLA:CPU
rounds a bf16 reduction once; NCCL's ring rounds after every hop, which is
simulated on the host (in ring order) for the third row.
"""

from __future__ import annotations

import os
import sys  # noqa: E402

_N = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 8
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_N}"
    )
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from functools import partial  # noqa: E402

import bench_scan as model  # noqa: E402  (benchmarks/ is on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsync  # noqa: E402
from jaxsync._src.sync.collectives import scatter_wire_sum  # noqa: E402

AXIS = "data"


def main() -> None:
    cfg = model.Config(vocab=256, seq=128, d_model=256, heads=4, layers=4, batch_per_device=4)
    if _N > 8:  # the same global batch, fewer rows per device
        cfg = model.Config(vocab=256, seq=128, d_model=256, heads=4, layers=4, batch_per_device=1)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,))
    params = model.cast(model.init_params(cfg), jnp.bfloat16)
    tokens = np.random.default_rng(0).integers(
        0, cfg.vocab, (n * cfg.batch_per_device, cfg.seq + 1), np.int32
    )
    loss = partial(model.scanned_loss, heads=cfg.heads, dtype=jnp.bfloat16)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(AXIS),) * 4)
    def grads(params, tokens):
        _, g = jaxsync.value_and_grad(loss, axis_name=AXIS)(params, tokens)  # local grads
        flat = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(g)])
        pad = (-flat.size) % n
        flat = jnp.pad(flat, (0, pad))
        f32 = jax.lax.psum_scatter(flat.astype(jnp.float32), AXIS, tiled=True)
        bf16 = jax.lax.psum_scatter(flat.astype(jnp.bfloat16), AXIS, tiled=True)
        wire = scatter_wire_sum(flat.astype(jnp.float32), (AXIS,), jnp.bfloat16)
        return flat[None], f32, bf16, wire

    tokens = jaxsync.shard_batch(tokens, mesh, axis_name=AXIS)
    local, f32, bf16, wire = grads(jax.device_put(params, jax.NamedSharding(mesh, P())), tokens)
    size = sum(x.size for x in jax.tree.leaves(params))
    exact = np.asarray(local, np.float64).sum(0)[:size] / n
    rows = []
    # NCCL's ring reduce-scatter adds one rank's bf16 chunk per hop and rounds to
    # bf16 after each add (N - 1 roundings); XLA:CPU rounds once. Both are shown.
    local = np.asarray(local)
    ring = local[0].astype(jnp.bfloat16)
    for i in range(1, n):
        ring = (ring.astype(np.float32) + np.asarray(local[i], np.float32)).astype(jnp.bfloat16)
    sums = (
        ("fp32 psum_scatter", np.asarray(f32, np.float64)[:size]),
        ("bf16 wire, fp32 sums (all-to-all)", np.asarray(wire, np.float64)[:size]),
        ("bf16 psum_scatter (XLA:CPU)", np.asarray(bf16, np.float64)[:size]),
        ("bf16 ring, rounded per hop (NCCL's order)", np.asarray(ring, np.float64)[:size]),
    )
    for name, total in sums:
        got = total / n
        rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        # the mean in bf16, as the optimizer reads it, against the correctly rounded one
        bf = lambda x: x.astype(np.float32).astype(jnp.bfloat16).astype(np.float64)  # noqa: E731
        ulp = np.spacing(np.abs(exact).astype(np.float32)) * 2.0**16  # one bf16 ulp
        nz = exact != 0
        off = np.mean(bf(got) != bf(exact))
        worst = np.max(np.abs(got - exact)[nz] / ulp[nz])
        rows.append([name, f"{rel:.2e}", f"{off:.2%}", f"{worst:.1f}"])
    print(f"{n} devices, {size:,} bf16 gradient elements, mean of the local gradients")
    head = ["sum", "rel. L2 error vs exact", "not the rounded bf16 mean", "max error, bf16 ulps"]
    print(model.fmt_table(head, rows, 1))


if __name__ == "__main__":
    main()

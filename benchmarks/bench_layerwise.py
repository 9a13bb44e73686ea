"""Muon under data parallelism: jaxsync's whole-matrix ownership against the alternatives.

    python benchmarks/bench_layerwise.py                  # 8 simulated CPU devices if no GPU
    python benchmarks/bench_layerwise.py --width 512 --blocks 4 --steps 20

A bf16 transformer-shaped MLP stack (per block: qkv ``[d, 3d]``, out ``[d, d]``,
up ``[d, 4d]``, down ``[4d, d]`` and their biases), fp32 master weights, Muon
(``optax.contrib.muon``) on the matrices and its AdamW part on the vectors, on a
1-D ``data`` mesh of all devices. Variants:

  replicated   shard_map, local grads + fp32 ``pmean``, Muon state and fp32
               master replicated on every device (plain data parallelism)
  gspmd        ``jax.jit`` with master and Muon state sharded over ``data`` by
               ``NamedSharding`` (rows of each matrix): XLA must gather the
               matrices for every Newton-Schulz product
  jaxsync      ``jaxsync.distributed_optimizer`` with ``jaxsync.whole_matrices``:
               each matrix owned whole by one rank (LPT on Newton-Schulz cost),
               reduce-scatter to owners, Muon on whole matrices, all-gather

Per variant: median step time, the ratio to ``replicated``, optimizer-state bytes
per device (fp32 master + optimizer state, from the arrays' shards) and the
collectives of the compiled step. :func:`make_steps` builds the three steps and
their (concrete or abstract) inputs for any mesh, so a GPU-target compile can
reuse them; ``--gpu-target h100:8`` prints XLA's modeled step for 8 H100s
(compile only, no GPU needed).
"""

from __future__ import annotations

import os
import sys

if any(arg.startswith("--gpu-target") for arg in sys.argv):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: never start CUDA
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxsync  # noqa: E402

AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 256
    blocks: int = 4
    batch_per_device: int = 16
    lr: float = 0.02


@dataclasses.dataclass(frozen=True)
class Variant:
    """One step function and its inputs (arrays, or ``ShapeDtypeStruct``s with shardings).

    ``carry(outputs)`` turns a step's outputs into the next step's inputs.
    ``state_bytes``: per-device bytes of fp32 master + optimizer state.
    """

    name: str
    step: Any
    args: tuple[Any, ...]
    carry: Callable[[Any], tuple[Any, ...]]
    state_bytes: int


def init_params(cfg: Config, dtype=jnp.bfloat16) -> dict[str, Any]:
    d = cfg.width
    shapes = {"qkv": (d, 3 * d), "out": (d, d), "up": (d, 4 * d), "down": (4 * d, d)}
    key = jax.random.PRNGKey(0)
    params = {}
    for b in range(cfg.blocks):
        block = {}
        for name, (m, n) in shapes.items():
            key, k = jax.random.split(key)
            block[name] = (jax.random.normal(k, (m, n)) / math.sqrt(m)).astype(dtype)
            block[name + "_b"] = jnp.zeros((n,), dtype)
        params[f"block{b}"] = block
    return params


def loss_fn(params, batch):
    x, y = batch
    h = x.astype(jnp.float32)
    for b in range(len(params)):
        p = jax.tree.map(lambda a: a.astype(jnp.float32), params[f"block{b}"])
        d = h.shape[-1]
        qkv = h @ p["qkv"] + p["qkv_b"]
        h = h + jnp.tanh(qkv[:, :d] * qkv[:, d : 2 * d]) @ p["out"] + p["out_b"]
        h = h + jax.nn.gelu(h @ p["up"] + p["up_b"]) @ p["down"] + p["down_b"]
    return jnp.mean(jnp.square(h - y))


def muon(cfg: Config) -> optax.GradientTransformation:
    return optax.contrib.muon(cfg.lr)


def jaxsync_muon(cfg: Config) -> jaxsync.DistributedOptimizer:
    # optax.contrib.muon's AdamW part, spelled out, for the vectors
    adamw = optax.adamw(cfg.lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    return jaxsync.distributed_optimizer(
        {"muon": jaxsync.whole_matrices(muon(cfg)), "adamw": adamw},
        labels=jaxsync.muon_labels,
        axis_name=AXIS,
    )


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of ``tree`` (arrays or sharded ShapeDtypeStructs)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def make_steps(mesh: Mesh, cfg: Config, *, abstract: bool = False) -> dict[str, Variant]:
    """The three Muon steps on ``mesh`` with their inputs.

    With ``abstract=True`` nothing is allocated: the inputs are
    ``ShapeDtypeStruct``s with their shardings (``step.lower(*args)`` then
    compiles for whatever devices ``mesh`` holds).
    """
    n = mesh.shape[AXIS]
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    tx = muon(cfg)
    gb = cfg.batch_per_device * n

    def place(fn, shardings):
        """``fn()`` placed by ``shardings``; abstract: only its shapes."""
        if abstract:
            shapes = jax.eval_shape(fn)
            return jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
            )
        return jax.jit(fn, out_shardings=shardings)()

    params_fn = partial(init_params, cfg)
    params = place(params_fn, jax.tree.map(lambda _: rep, jax.eval_shape(params_fn)))
    batch = place(
        lambda: (jnp.ones((gb, cfg.width), jnp.bfloat16), jnp.ones((gb, cfg.width), jnp.float32)),
        (rows, rows),
    )
    f32 = lambda t: jax.tree.map(lambda p: p.astype(jnp.float32), t)  # noqa: E731
    out: dict[str, Variant] = {}

    # (a) replicated Muon, pmean grads -------------------------------------------
    def rep_init():
        m = f32(params_fn())
        return m, tx.init(m)

    master, state = place(rep_init, jax.tree.map(lambda _: rep, jax.eval_shape(rep_init)))

    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P()))
    def replicated(master, opt_state, batch):
        model = jax.tree.map(lambda m: m.astype(jnp.bfloat16), master)
        _, g = jaxsync.value_and_grad(loss_fn, axis_name=AXIS)(model, batch)
        g = jax.tree.map(lambda x: jax.lax.pmean(x.astype(jnp.float32), AXIS), g)
        updates, opt_state = tx.update(g, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    out["replicated"] = Variant(
        "replicated",
        replicated,
        (master, state, batch),
        lambda o: (*o, batch),
        per_device_bytes(_abstract((master, state))),
    )

    # (b) jit with master and Muon state sharded by NamedSharding ---------------------
    # Auto axes: XLA (GSPMD) decides how to run Newton-Schulz on row-sharded matrices
    # (with Explicit axes, jax asks for an out_sharding for every such matmul).
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    rep, rows = NamedSharding(auto, P()), NamedSharding(auto, P(AXIS))

    def shard_of(x):
        return rows if x.ndim and x.shape[0] % n == 0 else rep

    sh_shapes = jax.eval_shape(rep_init)
    sh_shardings = jax.tree.map(shard_of, sh_shapes)
    master_s, state_s = place(rep_init, sh_shardings)

    @partial(
        jax.jit,
        donate_argnums=(0, 1, 2),
        out_shardings=(jax.tree.map(lambda _: rep, sh_shapes[0]), *sh_shardings),
    )
    def gspmd(params, master, opt_state, batch):
        g = jax.grad(loss_fn)(params, batch)
        g = jax.tree.map(
            lambda x, s: jax.lax.with_sharding_constraint(x.astype(jnp.float32), s),
            g,
            sh_shardings[0],
        )
        updates, opt_state = tx.update(g, opt_state, master)
        master = optax.apply_updates(master, updates)
        return jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), master, opt_state

    params_s = place(params_fn, jax.tree.map(lambda _: rep, jax.eval_shape(params_fn)))
    batch_s = place(
        lambda: (jnp.ones(batch[0].shape, jnp.bfloat16), jnp.ones(batch[1].shape)), (rows, rows)
    )
    out["gspmd"] = Variant(
        "gspmd",
        gspmd,
        (params_s, master_s, state_s, batch_s),
        lambda o: (*o, batch_s),
        per_device_bytes(_abstract((master_s, state_s))),
    )

    # (c) jaxsync whole-matrix ownership ---------------------------------------------
    ztx = jaxsync_muon(cfg)
    specs = ztx.state_specs(params, mesh)
    if abstract:
        zstate = place(
            lambda: ztx.sharded_init(params_fn(), mesh),
            jax.tree.map(
                lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
            ),
        )
    else:
        zstate = ztx.sharded_init(params, mesh)

    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
    def layerwise(params, opt_state, batch):
        _, g = jaxsync.value_and_grad(loss_fn, axis_name=AXIS)(params, batch)
        updates, opt_state = ztx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    zparams = params if abstract else jax.tree.map(jnp.copy, params)
    out["jaxsync"] = Variant(
        "jaxsync",
        layerwise,
        (zparams, zstate, batch),
        lambda o: (*o, batch),
        per_device_bytes(_abstract(zstate)),
    )
    return out


def run(v: Variant, steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    compiled = v.step.lower(*v.args).compile()
    compile_s = time.perf_counter() - t0
    stats = jaxsync.collective_stats(compiled.as_text())
    args = v.args
    for _ in range(3):
        args = v.carry(compiled(*args))
    jax.block_until_ready(args)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        args = v.carry(compiled(*args))
        jax.block_until_ready(args)
        times.append(time.perf_counter() - t0)
    short = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG"}
    coll = ", ".join(
        f"{short[k]}{stats[k].count}:{stats[k].bytes / 2**20:.1f}"
        for k in short
        if k in stats and stats[k].count
    )
    return {"ms": 1e3 * statistics.median(times), "compile_s": compile_s, "coll": coll}


def gpu_table(cfg: Config, target: str) -> None:
    """The three steps compiled for ``target`` GPUs, priced by XLA's scheduler.

    Note: the owner's update is a ``lax.switch`` with one branch per rank; the
    report prices every branch, while a device runs only its own.
    """
    kind, count = target.split(":")
    mesh = jaxsync.gpu_topology(kind, hosts=1, gpus_per_host=int(count))
    print(f"{target}: d={cfg.width}, {cfg.blocks} blocks, batch {cfg.batch_per_device}/GPU")
    print(f"{'variant':<11} {'modeled ms':>10} {'exposed comm ms':>16} {'state MiB':>10} "
          f"{'peak MiB':>9}")  # fmt: skip
    for name, v in make_steps(mesh, cfg, abstract=True).items():
        r = jaxsync.schedule_report(v.step.lower(*v.args))
        exposed = sum(r.exposed_us.values()) / 1e3
        peak = r.memory.get("peak", 0) / 2**20
        print(
            f"{name:<11} {r.step_us / 1e3:>10.3f} {exposed:>16.3f} "
            f"{v.state_bytes / 2**20:>10.1f} {peak:>9.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch-per-device", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--gpu-target",
        type=str,
        default=None,
        help="e.g. 'h100:8': compile for that many GPUs (no GPU needed) and print XLA's "
        "modeled step (jaxsync.schedule_report) instead of timing on this machine",
    )
    a = ap.parse_args()
    cfg = Config(a.width, a.blocks, a.batch_per_device)
    if a.gpu_target:
        gpu_table(cfg, a.gpu_target)
        return
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,))
    variants = make_steps(mesh, cfg)
    params = variants["jaxsync"].args[0]
    rep = jaxsync.ownership_report(jaxsync_muon(cfg), params, mesh)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"{jax.default_backend()} x{n}, {n_params / 1e6:.2f}M params ({cfg.blocks} blocks, "
        f"d={cfg.width}), {len(rep.matrices)} Muon matrices; owner cost imbalance "
        f"{rep.imbalance:.3f}, memory imbalance {rep.memory_imbalance:.3f}"
    )
    results = {name: run(v, a.steps) for name, v in variants.items()}
    base = results["replicated"]["ms"]
    head = (
        f"{'variant':<11} {'ms/step':>8} {'x repl':>7} {'state MiB/dev':>14} "
        f"{'compile s':>10}  collectives (count:MiB)"
    )
    print(head)
    for name, r in results.items():
        mib = variants[name].state_bytes / 2**20
        print(
            f"{name:<11} {r['ms']:>8.2f} {r['ms'] / base:>7.2f} {mib:>14.2f} "
            f"{r['compile_s']:>10.1f}  {r['coll']}"
        )


if __name__ == "__main__":
    main()

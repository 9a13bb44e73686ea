"""Time to the first step: jaxsync's init and compile against GSPMD's, side by side.

    python benchmarks/bench_first_step.py            # 8 simulated CPU devices if no GPU
    python benchmarks/bench_first_step.py --profile  # where jaxsync zero's init goes

Each (model, method) runs in a fresh process with no compilation cache, as a new
run starts: ``init`` is the state built from the params (jaxsync: the layout, the
elementwise probe, the consistency checks and the init program; GSPMD: ``tx.init``
placed with ``NamedSharding``), ``first`` the first step including its compile,
``next`` the median of the next 10 steps (each to its loss, host batch in). Each
cell is the median of ``--repeats`` fresh processes (3: one compile on a shared
2-core machine varies by up to 1.5x), run in rounds of every method in turn;
``vs gspmd`` is the median of each round's ratio to its own GSPMD run. Models:
the example trainer's GPT (``configs/tiny.yaml``, scanned blocks, NNX), a small
flax linen MLP (3 x 256: a floor, where fixed costs are all there is), and the
nanodo-style linen decoder of ``examples/linen_port`` (the trainer issue #30
ported). GSPMD is ZeRO-1 written by hand: ``jax.jit`` with the params replicated
and AdamW's moments sharded over ``data``.
One run, one table: quote ratios from the same run.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from statistics import median  # noqa: E402

METHODS = ("gspmd", "zero", "ddp", "fsdp")
MODELS = ("gpt", "linen", "decoder")
NEXT_STEPS = 10  # the "next step" column: the median of these
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(model: str):
    """``(params or nnx module, loss_fn, batch, stacked group)`` of a model."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    rng = np.random.default_rng(0)
    if model == "gpt":
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        import gpt

        cfg = gpt.GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=2, n_heads=4)
        module = gpt.GPT(cfg, nnx.Rngs(0))
        batch = rng.integers(0, 256, size=(32, cfg.seq_len + 1)).astype(np.int32)
        return module, gpt.loss_fn, batch, "blocks"

    if model == "decoder":
        sys.path.insert(0, os.path.join(ROOT, "examples", "linen_port"))
        import optax
        from model import Config, Decoder, batches

        cfg = Config()
        net = Decoder(cfg)
        boxed = net.init(jax.random.PRNGKey(0), jnp.ones((1, cfg.seq_len), jnp.int32))
        params = nn.unbox(boxed)["params"]

        def loss_fn(p, b):
            logits = net.apply({"params": p}, b[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

        return params, loss_fn, next(batches(cfg, 64)), None

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = jnp.tanh(nn.Dense(256)(x))
            return nn.Dense(8)(x)

    net = MLP()
    params = net.init(jax.random.PRNGKey(0), jnp.ones((1, 64)))["params"]

    def loss_fn(p, b):
        return jnp.mean((net.apply({"params": p}, b[0]) - b[1]) ** 2)

    batch = (
        rng.normal(size=(64, 64)).astype(np.float32),
        rng.normal(size=(64, 8)).astype(np.float32),
    )
    return params, loss_fn, batch, None


def gspmd(params_or_module, loss_fn, mesh, tx):
    """ZeRO-1 by hand: replicated params, AdamW state sharded over data where it divides."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if isinstance(params_or_module, nnx.Module):
        graphdef, params, rest = nnx.split(params_or_module, nnx.Param, ...)
        loss = lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b)  # noqa: E731
    else:
        params, loss = params_or_module, loss_fn
    n = mesh.shape["data"]
    rep = NamedSharding(mesh, P())

    def spec(x):
        return P("data") if x.ndim and x.shape[0] % n == 0 else P()

    def init():
        p = jax.device_put(params, rep)
        state = tx.init(p)
        shard = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), state)
        return p, jax.device_put(state, shard), shard

    def make_step(shard):
        # The state's shardings pinned, so the second step reuses the first's program.
        out = (jax.tree.map(lambda _: rep, params), shard, rep)

        @partial(jax.jit, out_shardings=out, donate_argnums=(0, 1))
        def step(params, state, batch):
            batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P("data")))
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, state = tx.update(grads, state, params)
            state = jax.lax.with_sharding_constraint(state, shard)
            return optax.apply_updates(params, updates), state, value

        return step

    return init, make_step


def measure(model: str, method: str) -> dict:
    import jax
    import optax

    import jaxsync

    jax.config.update("jax_enable_compilation_cache", False)
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
    t0 = time.perf_counter()
    params, loss_fn, batch, stacked = build(model)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    t1 = time.perf_counter()
    if method == "gspmd":
        init, make_step = gspmd(params, loss_fn, mesh, tx)
        carry = init()
        jax.block_until_ready(carry[:2])
        t2 = time.perf_counter()
        step = make_step(carry[2])

        def one(carry):
            p, s, loss = step(carry[0], carry[1], batch)
            return (p, s, carry[2]), loss
    else:
        step = jaxsync.train_step(loss_fn, tx, mesh, method, stacked=stacked)
        carry = step.init(params)
        jax.block_until_ready(carry)
        t2 = time.perf_counter()
        one = partial(step, batch=batch)
    carry, loss = one(carry)
    jax.block_until_ready(loss)
    t3 = time.perf_counter()
    # Later steps: each timed to its loss, host batch in, as a training loop runs.
    times = []
    for _ in range(NEXT_STEPS):
        t = time.perf_counter()
        carry, loss = one(carry)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t)
    return {"build": t1 - t0, "init": t2 - t1, "first": t3 - t2, "next": median(times)}


def profile(model: str) -> None:
    import cProfile
    import pstats

    import jax
    import optax

    import jaxsync

    jax.config.update("jax_enable_compilation_cache", False)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    params, loss_fn, batch, stacked = build(model)
    step = jaxsync.train_step(loss_fn, optax.adamw(1e-3), mesh, "zero", stacked=stacked)
    prof = cProfile.Profile()
    prof.enable()
    state = step.init(params)
    jax.block_until_ready(state)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = [
        (ct, f"{os.path.relpath(f, ROOT)}:{ln}({fn})")
        for (f, ln, fn), (_, _, _, ct, _) in stats.stats.items()
        if os.sep + "jaxsync" + os.sep in f
    ]
    total = max(ct for (_, _, _, ct, _) in stats.stats.values())
    print(f"jaxsync zero init on {model}: {total:.2f} s; jaxsync functions by cumulative time:")
    for ct, where in sorted(rows, reverse=True)[:15]:
        print(f"  {ct:6.2f} s  {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per cell (median)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    if args.profile:
        for model in args.models:
            profile(model)
        return
    print("| model | method | init s | first step s | init + first | vs gspmd | next step ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for model in args.models:
        # Rounds of every method in turn, so that a slow spell of a shared machine
        # lands on all of them; "vs gspmd" is the median of each round's ratio to
        # that round's GSPMD (paired), the other columns the medians.
        rounds = []
        for _ in range(max(1, args.repeats)):
            rounds.append({method: one_process(model, method) for method in METHODS})
        for method in METHODS:
            col = {k: median([r[method][k] for r in rounds]) for k in ("init", "first", "next")}
            ratio = median([both(r[method]) / both(r["gspmd"]) for r in rounds])
            print(
                f"| {model} | {method} | {col['init']:.2f} | {col['first']:.2f} | "
                f"{median([both(r[method]) for r in rounds]):.2f} | {ratio:.2f}x | "
                f"{1000 * col['next']:.1f} |",
                flush=True,
            )


def one_process(model: str, method: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", model, method],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def both(run: dict) -> float:
    return run["init"] + run["first"]


if __name__ == "__main__":
    main()

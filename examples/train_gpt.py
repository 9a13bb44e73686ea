"""Train a small GPT with jaxsync's distributed optimizer (or plain DDP).

One process (8 simulated CPU devices when there is no accelerator):
    python examples/train_gpt.py --config configs/tiny.yaml

One host, N processes on 127.0.0.1 (here 2 processes x 4 CPU devices):
    python -m jaxsync.launch --nproc 2 --devices-per-proc 4 examples/train_gpt.py

N hosts: start the same command on every host with the coordinator's address,
or under SLURM / Open MPI / Kubernetes just run it (jaxsync.initialize lets JAX
detect the cluster):
    JAXSYNC_COORDINATOR=host0:1234 JAXSYNC_NUM_PROCESSES=N JAXSYNC_PROCESS_ID=i \\
        python examples/train_gpt.py --config configs/tiny.yaml

Resume from the newest complete checkpoint of a run with --resume. Metrics are
appended to <run dir>/metrics.jsonl; only process 0 prints.
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and (
    os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and "JAXSYNC_COORDINATOR" not in os.environ
):
    # No accelerator here: simulate 8 devices (set before jax is imported).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import jaxsync  # noqa: E402

STACK = "blocks"  # the scanned (stacked) layer group of gpt.GPT

AXIS = "data"
DEFAULTS = {
    "model": {
        "seq_len": 64,
        "d_model": 128,
        "n_layers": 2,
        "n_heads": 4,
        "dtype": "float32",
        "scan": True,
    },
    "train": {
        "steps": 300,
        "global_batch": 64,
        "microbatches": 1,
        "lr": 3e-3,
        "warmup": 30,
        "weight_decay": 0.1,
        "clip_grad_norm": 1.0,
        "optimizer": "zero",
        "bucket_size": None,
        "seed": 0,
    },
    "checkpoint": {"every": 100, "keep": 3, "async": True},
    "log_every": 25,
    "run_dir": "runs/tiny",
}


def load_config(path: str | None, overrides: argparse.Namespace) -> dict:
    cfg = json.loads(json.dumps(DEFAULTS))
    if path:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
        for key, value in user.items():
            if isinstance(value, dict):
                unknown = set(value) - set(cfg.get(key, {}))
                if unknown:
                    raise ValueError(f"{path}: unknown keys {sorted(unknown)} in `{key}`.")
                cfg[key].update(value)
            elif key in cfg:
                cfg[key] = value
            else:
                raise ValueError(f"{path}: unknown key `{key}`.")
    if overrides.steps is not None:
        cfg["train"]["steps"] = overrides.steps
    if overrides.run_dir is not None:
        cfg["run_dir"] = overrides.run_dir
    if overrides.checkpoint_every is not None:
        cfg["checkpoint"]["every"] = overrides.checkpoint_every
    return cfg


def build_optimizer(cfg: dict, params) -> tuple:
    """(tx, sync for value_and_grad, lr schedule). With scanned blocks the gradients
    are reduced inside the backward scan (``sync``); otherwise after it."""
    t = cfg["train"]
    stacked = STACK if cfg["model"].get("scan", True) else None
    schedule = optax.warmup_cosine_decay_schedule(0.0, t["lr"], t["warmup"], t["steps"])

    def label(path, p):  # weight decay on matrices; a stacked leaf has one more axis
        ndim = p.ndim - (jaxsync.param_name(path).startswith(STACK + ".") and stacked is not None)
        return "decay" if ndim > 1 else "no_decay"

    labels = jax.tree_util.tree_map_with_path(label, params)
    if t["optimizer"] == "zero":
        tx = jaxsync.distributed_optimizer(
            {
                "decay": optax.adamw(schedule, weight_decay=t["weight_decay"]),
                "no_decay": optax.adam(schedule),
            },
            axis_name=AXIS,
            labels=labels,
            clip_grad_norm=t["clip_grad_norm"],
            bucket_size=t["bucket_size"],
            stacked=stacked,
        )
        return tx, (tx if stacked else None), schedule
    if t["optimizer"] == "ddp":
        sync = jaxsync.DataParallel(AXIS, bucket_size=t["bucket_size"], stacked=stacked or ())
        tx = optax.chain(
            *(
                ()
                if stacked
                else (jaxsync.sync_grads(axis_name=AXIS, bucket_size=t["bucket_size"]),)
            ),
            optax.clip_by_global_norm(t["clip_grad_norm"]),
            optax.multi_transform(
                {
                    "decay": optax.adamw(schedule, weight_decay=t["weight_decay"]),
                    "no_decay": optax.adam(schedule),
                },
                labels,
            ),
        )
        return tx, (sync if stacked else None), schedule
    raise ValueError(f"train.optimizer must be 'zero' or 'ddp', got {t['optimizer']!r}.")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=None)
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    ap.add_argument(
        "--dump-params", default=None, help="write the final params to this .npz file (process 0)"
    )
    args = ap.parse_args(argv)

    info = jaxsync.initialize()
    cfg = load_config(args.config, args)
    lead = jax.process_index() == 0
    console = Console(quiet=not lead)
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    t = cfg["train"]
    run_dir = cfg["run_dir"]
    os.makedirs(run_dir, exist_ok=True)

    data = gpt.CharData(gpt.make_corpus(seed=t["seed"]), cfg["model"]["seq_len"], t["seed"])
    model_cfg = gpt.GPTConfig(vocab_size=data.vocab_size, **cfg["model"])
    model = gpt.GPT(model_cfg, nnx.Rngs(t["seed"]))
    graphdef, state = nnx.split(model, nnx.Param)
    params = jax.device_put(nnx.to_pure_dict(state), NamedSharding(mesh, P()))
    abstract_state = jax.tree.map(lambda x: x, state)

    def loss_fn(params, tokens):
        # Under in-loop sync the stacked blocks arrive as jaxsync's view, which the
        # scanned block body taps; the module itself is merged from plain arrays.
        blocks = params.get(STACK) if model_cfg.scan else None
        if isinstance(blocks, jaxsync.LayerStack):
            params = {**params, STACK: blocks.params}
        st = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(st, params)
        return gpt.loss_fn(nnx.merge(graphdef, st), tokens, blocks)

    tx, sync, schedule = build_optimizer(cfg, params)
    zero = t["optimizer"] == "zero"
    if zero:
        opt_state = tx.sharded_init(params, mesh)
        specs = tx.state_specs(params, mesh)
    else:
        opt_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
        specs = jax.tree.map(lambda _: P(), opt_state)

    micro = t["microbatches"]
    if t["global_batch"] % (micro * jax.device_count()):
        raise ValueError(
            f"train.global_batch={t['global_batch']} must divide into {micro} microbatches "
            f"over {jax.device_count()} devices."
        )
    batch_spec = P(None, AXIS) if micro > 1 else P(AXIS)

    @partial(jax.jit, donate_argnums=(0, 1))
    @partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, batch_spec), out_specs=(P(), specs, P())
    )
    def train_step(params, opt_state, tokens):
        if micro > 1:
            loss, grads = jaxsync.accumulate_grads(
                loss_fn, params, tokens, axis_name=AXIS, sync=sync
            )
        else:
            loss, grads = jaxsync.value_and_grad(loss_fn, axis_name=AXIS, sync=sync)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

    ckpt = jaxsync.Checkpointer(
        os.path.join(run_dir, "checkpoints"),
        max_to_keep=cfg["checkpoint"]["keep"],
        async_save=cfg["checkpoint"]["async"],
    )
    start = 0
    if args.resume:
        r = ckpt.restore(
            params_like=params,
            tx=tx if zero else None,
            opt_state_like=None if zero else opt_state,
            mesh=mesh,
        )
        params, opt_state, start = r.params, r.opt_state, int(r.meta["data_position"])
        console.print(f"resumed from step {r.step} (next batch {start}) in {ckpt.directory}")

    console.print(
        f"jaxsync GPT: {sum(p.size for p in jax.tree.leaves(params)):,} params "
        f"({model_cfg.dtype}), {jax.device_count()} devices on {info.num_processes} "
        f"process(es) [{jax.default_backend()}], optimizer={t['optimizer']}, "
        f"global batch {t['global_batch']} x {model_cfg.seq_len} tokens"
    )
    if zero and lead:
        console.print(tx.layout(params, mesh).summary())

    per_proc = t["global_batch"] // jax.process_count()
    rows = slice(jax.process_index() * per_proc, (jax.process_index() + 1) * per_proc)
    tokens_per_step = t["global_batch"] * model_cfg.seq_len
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    loss = None
    history = []
    progress = Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
        console=console,
        disable=not lead,
    )
    with progress:
        task = progress.add_task("train", total=t["steps"], completed=start, loss="-", tps="-")
        tick, last_logged = time.perf_counter(), start
        for step in range(start, t["steps"]):
            local = data.batch(step, t["global_batch"], rows)
            if micro > 1:
                local = local.reshape(micro, -1, local.shape[-1])
            batch = jaxsync.shard_batch(local, mesh, axis_name=AXIS, batch_axis=int(micro > 1))
            params, opt_state, loss = train_step(params, opt_state, batch)
            done = step + 1
            if done % cfg["log_every"] == 0 or done == t["steps"]:
                loss_v = float(loss)
                now = time.perf_counter()
                tps = tokens_per_step * (done - last_logged) / (now - tick)
                tick, last_logged = now, done
                record = {
                    "step": done,
                    "loss": loss_v,
                    "tokens_per_s": tps,
                    "lr": float(schedule(step)),
                }
                if zero:
                    record["grad_norm"] = float(opt_state.metrics.grad_norm)
                    record["skipped_steps"] = int(opt_state.metrics.skipped_steps)
                history.append(record)
                if lead:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                progress.update(task, completed=done, loss=f"{loss_v:.3f}", tps=f"{tps:,.0f}")
                if not console.is_terminal:
                    console.print(f"step {done}: loss {loss_v:.4f}, {tps:,.0f} tok/s")
            else:
                progress.update(task, completed=done)
            if done % cfg["checkpoint"]["every"] == 0 or done == t["steps"]:
                ckpt.save(
                    done,
                    params=params,
                    opt_state=opt_state,
                    tx=tx if zero else None,
                    mesh=mesh,
                    meta={"data_position": done, "config": cfg},
                )
    ckpt.close()
    if args.dump_params and lead:
        flat = {
            jaxsync.param_name(p): np.asarray(x.addressable_data(0))
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        }
        np.savez(args.dump_params, **flat)
    if history:
        console.print(
            f"done: loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}; "
            f"metrics in {metrics_path}"
        )
    return {"params": params, "history": history}


if __name__ == "__main__":
    main()

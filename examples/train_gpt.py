"""Train a small GPT with jaxsync's distributed optimizer (or plain DDP).

It learns Python's own standard library, byte by byte (text_data.py: real text
that ships with every Python, no download), with whole files held out for the
validation loss it logs every eval.every steps.

One process (8 simulated CPU devices when there is no accelerator):
    python examples/train_gpt.py --config configs/tiny.yaml

One host, N processes on 127.0.0.1 (here 2 processes x 4 CPU devices):
    python -m jaxsync.launch --nproc 2 --devices-per-proc 4 examples/train_gpt.py

N hosts: start the same command on every host with the coordinator's address,
or under SLURM / Open MPI / Kubernetes just run it (jaxsync.initialize lets JAX
detect the cluster):
    JAXSYNC_COORDINATOR=host0:1234 JAXSYNC_NUM_PROCESSES=N JAXSYNC_PROCESS_ID=i \\
        python examples/train_gpt.py --config configs/tiny.yaml

Resume from the newest complete checkpoint of a run with --resume (the config
must be the one the run was saved with, unless --allow-config-change). A fresh
run refuses a run dir that already holds a run, unless --overwrite (which
deletes its checkpoints and metrics). Metrics are appended to
<run dir>/metrics.jsonl (train loss, learning rate, grad/update/param norms every
log_every steps, val_loss every eval.every steps), the config and data in run.json,
and the loss curves are plotted to loss.png at the end (plot_metrics.py re-makes it);
only process 0 prints and writes them. The run stops with an error after
train.max_consecutive_skips steps in a row were skipped for non-finite
gradients (it would otherwise go on without training).
"""

from __future__ import annotations

import os
import sys

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/proc/driver/nvidia"):
    # No NVIDIA driver: run on the CPU without trying the CUDA plugin, which `make`
    # installs for compile-only GPU targets and which cannot start here.
    os.environ["JAX_PLATFORMS"] = "cpu"
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and (
    os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and "JAXSYNC_COORDINATOR" not in os.environ
):
    # No accelerator here: simulate 8 devices (set before jax is imported).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402
import text_data  # noqa: E402

import jaxsync  # noqa: E402

STACK = "blocks"  # the scanned (stacked) layer group of gpt.GPT

AXIS = "data"
DEFAULTS = {
    "model": {
        "seq_len": 128,
        "d_model": 128,
        "n_layers": 2,
        "n_heads": 4,
        "dtype": "float32",
        "scan": True,
    },
    "train": {
        "steps": 600,
        "global_batch": 32,
        "microbatches": 1,
        "lr": 3e-3,
        "warmup": 30,
        "weight_decay": 0.1,
        "clip_grad_norm": 1.0,
        "optimizer": "zero",
        "bucket_size": None,
        "seed": 0,
        "max_consecutive_skips": 50,
    },
    "data": {"max_bytes": 4_000_000, "val_fraction": 0.1},
    "eval": {"every": 50, "batches": 8},
    "checkpoint": {"every": 200, "keep": 3, "async": True},
    # Silent faults: every copy of the replicated state compared bit for bit every
    # `replica_check_every` steps (0: never); `rerun`: a skipped or spiking step run
    # again to tell a transient fault from a numerical event (a host read per step).
    # `straggler_every`: the processes compare their loops' host time every that many
    # steps (jaxsync.Stragglers; 0: never), naming a slow one.
    "integrity": {
        "replica_check_every": 100,
        "rerun": False,
        "loss_jump": None,
        "straggler_every": 0,
    },
    "log_every": 25,
    "run_dir": "runs/tiny",
}


# Keys that may change when a run is resumed: where and how often it writes, how
# the gradients are bucketed (checkpoints reshard), and the skip guard.
RESUMABLE_CHANGES = {
    "run_dir",
    "log_every",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.async",
    "train.bucket_size",
    "train.max_consecutive_skips",
    "eval.every",
    "eval.batches",
    "integrity.replica_check_every",
    "integrity.rerun",
    "integrity.loss_jump",
    "integrity.straggler_every",
}


class ConfigError(ValueError):
    """A config value the trainer cannot run with; the message names the key."""


class RunStopped(RuntimeError):
    """The run cannot go on (e.g. every step is skipped); the message says why."""


def _kind(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check(cfg: dict, sources: dict[str, str]) -> None:
    """Checks every value's type and range, naming the key and where it came from."""

    def fail(key: str, what: str, value) -> None:
        hint = ""
        if isinstance(value, str) and value.replace("e", "").replace("-", "").isdigit():
            hint = " (YAML reads 3e-3 as a string: write 3.0e-3)"
        raise ConfigError(
            f"{sources.get(key, 'config')}: `{key}` must be {what}, got {_kind(value)}{hint}."
        )

    def get(key: str):
        section, _, name = key.rpartition(".")
        return (cfg[section] if section else cfg)[name]

    def integer(key: str, low: int) -> None:
        v = get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            fail(key, f"an integer >= {low}", v)

    def number(key: str, *, positive: bool, none: bool = False) -> None:
        v = get(key)
        if none and v is None:
            return
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        if not ok or (positive and not v > 0) or (not positive and v < 0):
            what = "a number > 0" if positive else "a number >= 0"
            fail(key, what + (" or null" if none else ""), v)

    for key in ("model.seq_len", "model.d_model", "model.n_layers", "model.n_heads"):
        integer(key, 1)
    if cfg["model"]["dtype"] not in ("float32", "bfloat16", "float16"):
        fail("model.dtype", "one of float32, bfloat16, float16", cfg["model"]["dtype"])
    for key in ("train.steps", "train.global_batch", "train.microbatches"):
        integer(key, 1)
    integer("train.warmup", 0)
    integer("train.seed", 0)
    integer("train.max_consecutive_skips", 0)
    number("train.lr", positive=True)
    number("train.weight_decay", positive=False)
    number("train.clip_grad_norm", positive=True, none=True)
    if cfg["train"]["bucket_size"] is not None:
        integer("train.bucket_size", 1)
    if cfg["train"]["optimizer"] not in ("zero", "ddp"):
        fail("train.optimizer", "'zero' or 'ddp'", cfg["train"]["optimizer"])
    integer("data.max_bytes", 1)
    v = cfg["data"]["val_fraction"]
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1:
        fail("data.val_fraction", "a number between 0 and 1 (the share held out)", v)
    integer("eval.every", 1)
    integer("eval.batches", 1)
    integer("checkpoint.every", 1)
    integer("checkpoint.keep", 1)
    if not isinstance(cfg["model"].get("scan", True), bool):
        fail("model.scan", "true (scanned blocks) or false (unrolled)", cfg["model"]["scan"])
    if not isinstance(cfg["checkpoint"]["async"], bool):
        fail("checkpoint.async", "true or false", cfg["checkpoint"]["async"])
    integer("log_every", 1)
    integer("integrity.replica_check_every", 0)
    v = cfg["integrity"]["straggler_every"]
    if v != 0:
        integer("integrity.straggler_every", 2)
    if not isinstance(cfg["integrity"]["rerun"], bool):
        fail("integrity.rerun", "true or false", cfg["integrity"]["rerun"])
    lj = cfg["integrity"]["loss_jump"]
    if lj is not None and (isinstance(lj, bool) or not isinstance(lj, int | float) or lj <= 1):
        fail("integrity.loss_jump", "a number > 1 or null", lj)
    if not isinstance(cfg["run_dir"], str) or not cfg["run_dir"]:
        fail("run_dir", "a directory name", cfg["run_dir"])
    t = cfg["train"]
    if t["warmup"] >= t["steps"]:  # the cosine decay after the warmup needs a step
        raise ConfigError(
            f"`train.warmup`={t['warmup']} ({sources.get('train.warmup', 'config')}) must be "
            f"< `train.steps`={t['steps']} ({sources.get('train.steps', 'config')}): the "
            "warmup is part of the learning-rate schedule over all steps. Lower the warmup "
            "or raise the steps."
        )
    if cfg["model"]["d_model"] % cfg["model"]["n_heads"]:
        raise ConfigError(
            f"`model.d_model`={cfg['model']['d_model']} must be a multiple of "
            f"`model.n_heads`={cfg['model']['n_heads']}."
        )


def load_config(path: str | None, overrides: argparse.Namespace) -> dict:
    """DEFAULTS, updated by the YAML file at ``path`` and the command line; checked."""
    cfg = json.loads(json.dumps(DEFAULTS))
    sources = {}
    if path:
        with open(path) as f:
            user = yaml.safe_load(f) or {}
        if not isinstance(user, dict):
            raise ConfigError(f"{path}: must be a mapping of sections, got {_kind(user)}.")
        for key, value in user.items():
            if isinstance(cfg.get(key), dict):
                if not isinstance(value, dict):
                    raise ConfigError(
                        f"{path}: `{key}` must be a mapping of keys (e.g. `{key}: "
                        f"{{{next(iter(cfg[key]))}: ...}}`), got {_kind(value)}; its keys "
                        f"are {sorted(cfg[key])}."
                    )
                unknown = set(value) - set(cfg[key])
                if unknown:
                    raise ConfigError(
                        f"{path}: unknown keys {sorted(unknown)} in `{key}`; known: "
                        f"{sorted(cfg[key])}."
                    )
                cfg[key].update(value)
                sources.update({f"{key}.{k}": path for k in value})
            elif key in cfg:
                cfg[key] = value
                sources[key] = path
            else:
                raise ConfigError(f"{path}: unknown key `{key}`; known: {sorted(cfg)}.")
    if overrides.steps is not None:
        cfg["train"]["steps"] = overrides.steps
        sources["train.steps"] = "--steps"
    if overrides.run_dir is not None:
        cfg["run_dir"] = overrides.run_dir
        sources["run_dir"] = "--run-dir"
    if overrides.checkpoint_every is not None:
        cfg["checkpoint"]["every"] = overrides.checkpoint_every
        sources["checkpoint.every"] = "--checkpoint-every"
    _check(cfg, sources)
    return cfg


def _flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_changes(saved: dict, now: dict) -> list[str]:
    """Keys whose value differs between a saved run's config and this one."""
    a, b = _flat(saved), _flat(now)
    return [
        f"  {k}: saved {a.get(k)!r}, now {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k not in RESUMABLE_CHANGES and a.get(k) != b.get(k)
    ]


def prepare_run_dir(run_dir: str, *, resume: bool, overwrite: bool, lead: bool) -> None:
    """Refuses to start a fresh run over an old one; ``overwrite`` deletes the old one."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    old = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    old_metrics = os.path.exists(metrics)
    if not resume and not overwrite and (old or old_metrics):
        held = [f"checkpoints {old}"] if old else []
        held += ["metrics.jsonl"] if old_metrics else []
        raise ConfigError(
            f"run dir {run_dir} already holds a run ({', '.join(held)}). Pass --resume to "
            "continue it, --overwrite to delete its checkpoints and metrics and start "
            "over, or --run-dir to start in another directory."
        )
    if overwrite and lead:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        if old_metrics:
            os.remove(metrics)
        for stale in ("loss.png", "run.json"):
            if os.path.exists(os.path.join(run_dir, stale)):
                os.remove(os.path.join(run_dir, stale))
    os.makedirs(run_dir, exist_ok=True)
    if jax.process_count() > 1:  # nobody writes before process 0 has cleaned up
        multihost_utils.sync_global_devices("train_gpt: run dir ready")


def build_step(cfg: dict, mesh) -> tuple:
    """(jaxsync.train_step, lr schedule). AdamW on matrices, Adam on the rest
    (``labels``); with scanned blocks each layer's gradient is reduced inside the
    backward scan (``stacked``), otherwise after it."""
    t = cfg["train"]
    if t["optimizer"] not in ("zero", "ddp"):
        raise ConfigError(f"`train.optimizer` must be 'zero' or 'ddp', got {t['optimizer']!r}.")
    stacked = STACK if cfg["model"].get("scan", True) else None
    schedule = optax.warmup_cosine_decay_schedule(0.0, t["lr"], t["warmup"], t["steps"])

    def labels(params):  # weight decay on matrices; a stacked leaf has one more axis
        def one(path, p):
            layered = stacked is not None and jaxsync.param_name(path).startswith(STACK + ".")
            return "decay" if p.ndim - layered > 1 else "no_decay"

        return jax.tree_util.tree_map_with_path(one, params)

    step = jaxsync.train_step(
        gpt.loss_fn,
        {
            "decay": optax.adamw(schedule, weight_decay=t["weight_decay"]),
            "no_decay": optax.adam(schedule),
        },
        mesh,
        mode=t["optimizer"],
        axis_name=AXIS,
        labels=labels,
        microbatches=t["microbatches"],
        clip_grad_norm=t["clip_grad_norm"],
        bucket_size=t["bucket_size"],
        stacked=stacked,
        # update and param norms and the rate each update used, in state.metrics
        metrics=jaxsync.TrainerMetrics(learning_rate=schedule),
    )
    return step, schedule


RESUME_CHANGED = (
    "--resume: the run in {run_dir} was saved with another config (saved vs now):\n"
    "{changes}\nResume with the config it was saved with, or pass --allow-config-change "
    "to go on with the new one (the saved params and optimizer state are kept; the data "
    "position and learning-rate schedule follow the new config from step {step})."
)
SKIPPING = (
    "stopping at step {step}: the last {n} steps were all skipped because their gradients "
    "were not finite (train.max_consecutive_skips={limit}); the loss scale is now "
    "{scale:g} and the loss {loss}. The run is not training any more: look for NaN/Inf "
    "in the data or the model, lower train.lr, or resume from the last complete "
    "checkpoint ({latest}) with other settings."
)


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
        "--overwrite",
        action="store_true",
        help="delete the run dir's checkpoints and metrics and start over",
    )
    ap.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: go on with a config that differs from the saved run's",
    )
    ap.add_argument(
        "--dump-params", default=None, help="write the final params to this .npz file (process 0)"
    )
    args = ap.parse_args(argv)
    if args.resume and args.overwrite:
        ap.error("--resume continues the run in the run dir and --overwrite deletes it: pick one.")
    if args.allow_config_change and not args.resume:
        ap.error("--allow-config-change only applies to --resume.")

    cfg = load_config(args.config, args)  # before any JAX work: bad configs fail at once
    data = load_data(cfg)
    info = jaxsync.initialize()
    lead = jax.process_index() == 0
    console = Console(quiet=not lead)
    prepare_run_dir(cfg["run_dir"], resume=args.resume, overwrite=args.overwrite, lead=lead)
    with jaxsync.Checkpointer(
        os.path.join(cfg["run_dir"], "checkpoints"),
        max_to_keep=cfg["checkpoint"]["keep"],
        async_save=cfg["checkpoint"]["async"],
    ) as ckpt:
        if args.resume:
            meta = ckpt.read_meta()
            saved = meta.get("config")
            changes = config_changes(saved, cfg) if saved is not None else []
            if meta.get("data") not in (None, corpus_id(data)):  # another Python's stdlib
                changes.append(f"  data: saved {meta['data']}, now {corpus_id(data)}")
            if changes and not args.allow_config_change:
                raise ConfigError(
                    RESUME_CHANGED.format(
                        run_dir=cfg["run_dir"], changes="\n".join(changes), step=ckpt.latest_step()
                    )
                )
            if changes:
                console.print(
                    "resuming with a changed config:\n" + "\n".join(changes), markup=False
                )
        return train(cfg, args, info, ckpt, console, data)


def load_data(cfg: dict) -> text_data.StdlibText:
    """The stdlib corpus the config asks for; a config error if a split is too small."""
    try:
        return text_data.StdlibText(
            cfg["model"]["seq_len"],
            cfg["train"]["seed"],
            max_bytes=cfg["data"]["max_bytes"],
            val_fraction=cfg["data"]["val_fraction"],
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def corpus_id(data: text_data.StdlibText) -> dict:
    """What identifies the training text across machines (not where it was read)."""
    return {k: v for k, v in data.describe().items() if k != "root"}


def train(
    cfg: dict,
    args: argparse.Namespace,
    info,
    ckpt,
    console: Console,
    data: text_data.StdlibText,
) -> dict:
    lead = jax.process_index() == 0
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    t = cfg["train"]
    run_dir = cfg["run_dir"]

    model_cfg = gpt.GPTConfig(vocab_size=data.vocab_size, **cfg["model"])
    model = gpt.GPT(model_cfg, nnx.Rngs(t["seed"]))
    graphdef, abstract = nnx.split(model, nnx.Param)

    micro = t["microbatches"]
    if t["global_batch"] % (micro * jax.device_count()):
        raise ConfigError(
            f"`train.global_batch`={t['global_batch']} must divide into {micro} microbatches "
            f"(`train.microbatches`) over {jax.device_count()} devices: make it a multiple "
            f"of {micro * jax.device_count()}."
        )
    # The whole step (shard_map, specs, donation, batch placement, the NNX split
    # and merge) is jaxsync.train_step's; the state is global and sharded.
    train_step, schedule = build_step(cfg, mesh)
    state = train_step.init(model)
    tx = train_step.optimizer(state)
    zero = t["optimizer"] == "zero"

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P())
    def eval_step(params, batches):
        """Mean loss over the fixed validation batches ``(n, batch, seq_len + 1)``."""
        st = jax.tree.map(lambda x: x, abstract)
        nnx.replace_by_pure_dict(st, params)
        model = nnx.merge(graphdef, st)
        losses = jax.lax.map(lambda tokens: gpt.loss_fn(model, tokens), batches)
        return jax.lax.pmean(jnp.mean(losses), AXIS)

    start = 0
    if args.resume:
        # The whole TrainState: params, optimizer state, loss scale and skip counters,
        # on this run's mesh (any data-parallel size).
        r = ckpt.restore_state(train_step, state)
        state = r.state
        start = int(r.meta["data_position"])
        console.print(f"resumed from step {r.step} (next batch {start}) in {ckpt.directory}")

    # The params' shapes, from the module (no collective: train_step.params(state)
    # gathers, so every process would have to call it).
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(abstract)
    )
    console.print(
        f"jaxsync GPT: {sum(p.size for p in jax.tree.leaves(shapes)):,} params "
        f"({model_cfg.dtype}), {jax.device_count()} devices on {info.num_processes} "
        f"process(es) [{jax.default_backend()}], optimizer={t['optimizer']}, "
        f"global batch {t['global_batch']} x {model_cfg.seq_len} tokens"
    )
    about = data.describe()
    console.print(
        f"data: {about['corpus']}, {about['train_bytes']:,} bytes in {about['train_files']} "
        f"files to train on, {about['val_bytes']:,} bytes in {about['val_files']} files "
        f"held out; val loss every {cfg['eval']['every']} steps on "
        f"{cfg['eval']['batches']} x {t['global_batch']} sequences",
        highlight=False,
    )
    if zero and lead:
        console.print(tx.layout(shapes, mesh).summary())

    per_proc = t["global_batch"] // jax.process_count()
    rows = slice(jax.process_index() * per_proc, (jax.process_index() + 1) * per_proc)
    val_batches = jaxsync.shard_batch(
        data.val_batches(cfg["eval"]["batches"], t["global_batch"], rows),
        mesh,
        axis_name=AXIS,
        batch_axis=1,
    )
    tokens_per_step = t["global_batch"] * model_cfg.seq_len
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    # Resumed from an older checkpoint than the last record (a run that died between
    # a log and its next checkpoint): the steps after it are run, and logged, again.
    earlier = trim_metrics(metrics_path, start) if args.resume and lead else []
    if lead:
        with open(os.path.join(run_dir, "run.json"), "w") as f:
            json.dump(
                {
                    "config": cfg,
                    "data": about,
                    "params": int(sum(p.size for p in jax.tree.leaves(shapes))),
                    "devices": jax.device_count(),
                    "processes": jax.process_count(),
                    "backend": jax.default_backend(),
                    "python": sys.version.split()[0],
                    "jax": jax.__version__,
                },
                f,
                indent=1,
            )
    loss = None
    history = []
    skips, limit = 0, t["max_consecutive_skips"]

    def count_skip(step: int, skipped: jax.Array, loss: jax.Array) -> None:
        nonlocal skips
        skips = skips + 1 if bool(skipped) else 0
        if limit and skips >= limit:
            scale = float(state.loss_scale.scale)
            raise RunStopped(
                SKIPPING.format(
                    step=step,
                    n=skips,
                    limit=limit,
                    scale=scale,
                    loss=float(loss),
                    latest=ckpt.latest_step(),
                )
            )

    progress = Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s"),
        TimeRemainingColumn(),
        console=console,
        disable=not lead,
    )
    with progress:
        task = progress.add_task(
            "train", total=t["steps"], completed=start, loss="-", val="-", tps="-"
        )
        tick, last_logged = time.perf_counter(), start
        previous = None  # the last step's skip flag, read one step late: no wait on the device
        integrity = cfg["integrity"]
        run_step = train_step
        if integrity["rerun"]:  # a suspicious step run again (jaxsync.Rerun)
            run_step = jaxsync.Rerun(train_step, loss_jump=integrity["loss_jump"])
        reruns = run_step
        if integrity["straggler_every"]:  # slow processes named (jaxsync.Stragglers)
            run_step = jaxsync.Stragglers(run_step, every=integrity["straggler_every"])
        checks, seen, rerun_seen = [], 0, 0  # integrity reports not logged yet
        for step in range(start, t["steps"]):
            # this process's rows of the global batch; the step places them
            state, loss = run_step(state, data.batch(step, t["global_batch"], rows))
            # a copy: the next step is given (donated) the state before this is read
            skipped = jnp.copy(state.metrics.skipped)
            done = step + 1
            if previous is not None:
                count_skip(*previous)
            previous = (done, skipped, loss)
            every = integrity["replica_check_every"]
            if every and (done % every == 0 or done == t["steps"]):
                replicas = jaxsync.replica_check(train_step, state)
                if not replicas.ok:  # diverged copies: a hardware fault, never train on
                    if lead:  # in the metrics too, where plot_metrics.py marks it
                        seen_now = [*checks, f"step {done}: {replicas}"]
                        found = {"step": done, "loss": float(loss), "replica_check": seen_now}
                        with open(metrics_path, "a") as f:
                            f.write(json.dumps(found) + "\n")
                    raise RunStopped(f"step {done}: {replicas}")
                checks.append(f"step {done}: {replicas}")
            # and after step 1: where training starts from (ln 256 for a uniform guess)
            evaluate = done % cfg["eval"]["every"] == 0 or done in (1, t["steps"])
            if evaluate or done % cfg["log_every"] == 0:
                loss_v = float(loss)
                now = time.perf_counter()
                tps = tokens_per_step * (done - last_logged) / (now - tick)
                record = {
                    "step": done,
                    "loss": loss_v,
                    "tokens_per_s": tps,
                    # the rate the last applied update used (after a skipped step
                    # optax's count, and so the schedule, lag the loop's step)
                    "lr": float(state.metrics.learning_rate),
                }
                if evaluate:
                    record["val_loss"] = float(eval_step(train_step.params(state), val_batches))
                record["grad_norm"] = float(state.metrics.grad_norm)  # the same in both modes
                record["update_norm"] = float(state.metrics.update_norm)
                record["param_norm"] = float(state.metrics.param_norm)
                record["skipped_steps"] = int(state.metrics.skipped_steps)
                # What the integrity checks found since the last record (the record
                # stays one line per logged step, as readers of metrics.jsonl expect).
                if integrity["rerun"]:  # the steps run again since the last record
                    record["reruns"] = [str(r) for r in reruns.reports[rerun_seen:]]
                    rerun_seen = len(reruns.reports)
                if checks:
                    record["replica_check"], checks = checks, []
                if integrity["straggler_every"] and len(run_step.reports) > seen:
                    record["stragglers"] = [str(r) for r in run_step.reports[seen:]]
                    seen = len(run_step.reports)
                history.append(record)
                if lead:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                val = f"{record['val_loss']:.3f}" if evaluate else None
                progress.update(task, completed=done, loss=f"{loss_v:.3f}", tps=f"{tps:,.0f}")
                if val:
                    progress.update(task, val=val)
                if not console.is_terminal:
                    console.print(
                        f"step {done}: loss {loss_v:.4f}"
                        + (f", val_loss {val}" if val else "")
                        + f", {tps:,.0f} tok/s"
                    )
                tick, last_logged = time.perf_counter(), done  # throughput leaves out eval
            else:
                progress.update(task, completed=done)
            if done % cfg["checkpoint"]["every"] == 0 or done == t["steps"]:
                ckpt.save_state(
                    train_step,
                    state,
                    step=done,
                    meta={"data_position": done, "config": cfg, "data": corpus_id(data)},
                )
        if previous is not None:
            count_skip(*previous)
    ckpt.wait()
    if args.dump_params:
        final = train_step.params(state)  # a collective (it gathers): every process calls it
        flat = {
            jaxsync.param_name(p): np.asarray(x.addressable_data(0))
            for p, x in jax.tree_util.tree_flatten_with_path(final)[0]
        }
        if lead:
            np.savez(args.dump_params, **flat)
    plot = write_plot(metrics_path, console) if lead and history else None
    if history:
        run = earlier + history  # the whole run's first record, not this session's
        vals = [r["val_loss"] for r in run if "val_loss" in r]
        console.print(
            f"done: loss {run[0]['loss']:.3f} -> {run[-1]['loss']:.3f}, val_loss "
            f"{vals[0]:.3f} -> {vals[-1]:.3f}; metrics in {metrics_path}"
            + (f", plot in {plot}" if plot else ""),
            highlight=False,
        )
    return {"params": train_step.params(state), "history": history, "plot": plot}


def trim_metrics(path: str, upto: int) -> list[dict]:
    """The records of ``path`` up to step ``upto`` (the checkpoint resumed from); the
    file keeps only those, so that it stays one record per logged step."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if r.get("step", 0) <= upto]
    if len(kept) < len(records):
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(path + ".tmp", path)
    return kept


def write_plot(metrics_path: str, console: Console) -> str | None:
    """loss.png next to the metrics; a note instead if matplotlib is not installed."""
    try:
        import plot_metrics
    except ImportError as e:  # matplotlib comes with jaxsync[examples]
        console.print(f"no plot: {e} (pip install 'jaxsync[examples]')", markup=False)
        return None
    return plot_metrics.plot(metrics_path)


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, RunStopped, FileNotFoundError, jaxsync.CheckpointMismatchError) as e:
        # What the user has to fix, without a traceback through the trainer.
        Console(stderr=True).print(f"error: {e}", highlight=False, markup=False)
        sys.exit(2 if isinstance(e, ConfigError) else 1)

"""The headline benchmark: training steps compiled for H100 clusters, priced by XLA.

    python benchmarks/bench_gpu.py                       # 8 x H100, Llama-style 1.1B
    python benchmarks/bench_gpu.py --size 7b --hosts 8   # 64 x H100, Llama-style 7.2B
    python benchmarks/bench_gpu.py --quick               # a small model (smoke run)
    python benchmarks/bench_gpu.py --model gpt --size 8b --hosts 8   # the GPT, 6.7B

No GPU is needed: every step is lowered from ``jax.ShapeDtypeStruct``s against a
compile-only mesh (:func:`jaxsync.gpu_topology`) and compiled by XLA's GPU
pipeline; :func:`jaxsync.schedule_report` reads the latency-hiding scheduler's
model of it. The figures are XLA's model of an H100 program, not measurements.

The models are written the way large JAX models are: pre-norm blocks stacked
``[L, ...]`` and run by ``lax.scan`` over a ``jax.checkpoint``-ed body, bf16
compute. ``--model gpt`` (``bench_scan``'s): token and position embedding, causal
attention, GELU MLP, LM head. ``--model llama`` (``llama.py``): RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU MLP, untied head. Every method runs
AdamW with clipping at global norm 1.0:

  replicated   shard_map; fp32 params replicated, bf16 model, ``lax.pmean`` of the grads
  gspmd_zero1  ``jax.jit``; bf16 params replicated, fp32 master and AdamW state sharded
               by ``NamedSharding`` (XLA's weight-update sharding)
  gspmd_fsdp   ``jax.jit``; fp32 master and AdamW state sharded, bf16 model cast from it
  jaxsync_ddp  ``train_step(mode="ddp", stacked="blocks")``, fp32 params (bf16 model)
  jaxsync_zero ``train_step(mode="zero", stacked="blocks")``, bf16 params, fp32 master
  jaxsync_zero_bf16rs  the same with ``reduce_dtype=bf16`` (gradients reduced in bf16,
               as GSPMD does)
  jaxsync_zero_keep  the same with ``reshard_after_forward=False``: each layer gathered
               once per step, in the forward, and kept for the backward
  jaxsync_fsdp ``train_step(mode="fsdp", stacked="blocks")``, bf16 compute policy
  jaxsync_fsdp_bf16rs  the same with the policy's ``reduce_dtype=bf16``
  jaxsync_fsdp_keep  the same, the layer body's remat keeping each gathered layer
               (``save_only_these_names("jaxsync_gathered_layer")``): one gather per
               layer per step, in the forward; ZeRO-1's param memory during the step,
               and the params' all-gather deferred into the next step's forward

Columns: the modeled step by XLA's scheduler statistics (ms) and its ratio to the
baseline of the same kind (ddp vs replicated, zero vs gspmd_zero1, fsdp vs
gspmd_fsdp); the same by the scheduler's timeline, XLA's second reading; the step
repriced (``ScheduleReport.repriced_us``: the scheduled order walked again with each
asynchronous op that is not a collective at its bytes over the GPU's memory
bandwidth, where XLA charges a flat 5000 cycles), its ratio to the timeline, and how
many such ops run per step; the exposed communication's share of the step; the
efficiency, the communication bound (:func:`jaxsync.communication_bound`: one GPU's
rows alone plus its 1/N of AdamW, against a bf16 reduce-scatter and all-gather of
the params) over the step, on both readings; the share of the step priced by XLA's
own cost model (the pricing twin leaves almost nothing to the roofline); bytes each
GPU sends per step (ring algorithms) against the ring bound of an fp32 all-reduce of
the gradients, 2S(N-1)/N; arguments and temporaries per GPU, their sum against the
baseline's (XLA's buffer assignment: exact), and whether it fits the GPU's memory;
the bytes each GPU's kernels read and write per step (:func:`jaxsync.hbm_bytes`:
loop bodies per iteration, collectives excluded; exact for the program) against the
baseline's. The bound prices plain AdamW (clipping is one more elementwise pass).
Each method is compiled twice: with XLA's defaults and with the collective flags of
JAX's GPU performance guide (:data:`jaxsync.GPU_PERFORMANCE_OPTIONS`).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs: never start CUDA

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scan  # noqa: E402
import llama  # noqa: E402
from bench_scan import cast, fmt_table  # noqa: E402

import jaxsync  # noqa: E402

AXIS = "data"
F32, BF16 = jnp.float32, jnp.bfloat16
SIZES = {  # the GPT's (bench_gpu_real reads it): d_model, heads, layers, seq, vocab, rows/GPU
    "quick": (512, 8, 4, 512, 8192, 2),
    "1b": (2048, 16, 16, 2048, 32768, 4),
    "8b": (4096, 32, 32, 2048, 32768, 2),
}


@dataclasses.dataclass(frozen=True)
class Model:
    """A benchmarked model: its module (``Config``, ``device_params(cfg)``,
    ``scanned_loss``), its configs by size, the ``scanned_loss`` keywords a config
    gives, and its tensor-parallel split (leaf name -> spec over "model")."""

    name: str
    module: object
    sizes: dict
    loss_kw: object
    tp_specs: dict


def _gpt(d, heads, layers, seq, vocab, rows):
    return bench_scan.Config(vocab=vocab, seq=seq, d_model=d, heads=heads, layers=layers,
                             batch_per_device=rows)  # fmt: skip


#: Megatron's split over "model": column-parallel qkv, MLP up/gate and head (their
#: output dim), row-parallel attention out and MLP down (their input dim), and the
#: vocab-parallel token embedding (its vocab dim: the compiler partitions the lookup,
#: so no GPU holds the whole table or its whole gradient).
COLUMN, ROW = P(None, None, "model"), P(None, "model", None)
MEGATRON = {"wo": ROW, "w_up": COLUMN, "w_down": ROW, "w": P(None, "model"),
            "tok": P("model", None)}  # fmt: skip
MODELS = {
    "gpt": Model("GPT", bench_scan, {k: _gpt(*v) for k, v in SIZES.items()},
                 lambda cfg: {"heads": cfg.heads},
                 {**MEGATRON, "wqkv": COLUMN, "b_up": P(None, "model")}),
    "llama": Model("Llama", llama, llama.SIZES,
                   lambda cfg: {"heads": cfg.heads, "kv_heads": cfg.kv_heads},
                   {**MEGATRON, "wq": COLUMN, "wk": COLUMN, "wv": COLUMN, "w_gate": COLUMN}),
}  # fmt: skip


def model_of(cfg) -> Model:
    """The model a config belongs to (the functions below take configs of any model)."""
    return next(m for m in MODELS.values() if isinstance(cfg, m.module.Config))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: object  # jitted step
    args: tuple  # ShapeDtypeStructs with shardings


def param_shapes(cfg, dtype) -> dict:
    """The model's ``device_params`` tree, as ShapeDtypeStructs (nothing allocated)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype),
        jax.eval_shape(lambda: model_of(cfg).module.device_params(cfg)),
    )


def tx():
    return optax.adamw(1e-4, weight_decay=0.01)


def clipped():
    return optax.chain(optax.clip_by_global_norm(1.0), tx())


def loss_fn(cfg, constrain=None, remat_policy=None):
    m = model_of(cfg)
    return partial(m.module.scanned_loss, **m.loss_kw(cfg), dtype=BF16, constrain=constrain,
                   remat_policy=remat_policy)  # fmt: skip


def put(tree, sharding):
    shard = sharding if callable(sharding) else (lambda _: sharding)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard(x)), tree)


def tp_spec(path, mesh, specs) -> P:
    """The tensor-parallel spec of a leaf (replicated on a mesh without "model")."""
    if "model" not in mesh.axis_names:
        return P()
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return specs.get(keys[-1], P()) if keys else P()


def with_tp(mesh, cfg=None):
    """ShapeDtypeStructs carrying their tensor-parallel sharding (replicated over data):
    ``cfg``'s model's split (None: the GPT's, as bench_gpu_real calls it)."""
    specs = (model_of(cfg) if cfg is not None else MODELS["gpt"]).tp_specs
    return lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, tp_spec(path, mesh, specs))
        ), tree,
    )  # fmt: skip


def gspmd_sharding(cfg, mesh, stacked_keys=("blocks",), data=True):
    """GSPMD's ZeRO placement: the TP spec, plus the data axis on the largest free dim."""
    n = mesh.shape[AXIS]
    specs = model_of(cfg).tp_specs

    def one(path, x):
        stacked = any(f"['{k}']" in jax.tree_util.keystr(path) for k in stacked_keys)
        spec = list(tp_spec(path, mesh, specs)) + [None] * x.ndim
        free = [i for i in range(1 if stacked else 0, x.ndim)
                if spec[i] is None and x.shape[i] % n == 0]  # fmt: skip
        if data and free:
            spec[max(free, key=lambda i: x.shape[i])] = AXIS
        return NamedSharding(mesh, P(*spec[: x.ndim]))

    return lambda tree: jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.tree_util.tree_map_with_path(one, tree), tree,
    )  # fmt: skip


def baselines(cfg, mesh, tokens) -> list[Case]:
    rep = NamedSharding(mesh, P())
    batch = jax.ShapeDtypeStruct(tokens, jnp.int32, sharding=NamedSharding(mesh, P(AXIS)))
    act = NamedSharding(mesh, P(AXIS))
    gloss = loss_fn(cfg, lambda x: jax.lax.with_sharding_constraint(x, act))
    opt = clipped()
    shard = gspmd_sharding(cfg, mesh)
    tp = with_tp(mesh, cfg)
    master = shard(param_shapes(cfg, F32))
    opt_state = shard(jax.eval_shape(opt.init, master))
    msh, osh = (jax.tree.map(lambda x: x.sharding, t) for t in (master, opt_state))

    # replicated: optax on every GPU, one pmean per grad leaf
    lfn = loss_fn(cfg)

    @partial(jax.jit, donate_argnums=(0,))
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()))
    def replicated(state, tokens):
        params, opt_state = state
        model_p = jax.lax.pcast(cast(params, BF16), (AXIS,), to="varying")
        loss, g = jax.value_and_grad(lfn)(model_p, tokens)
        g = jax.lax.pmean(cast(g, F32), AXIS)
        updates, opt_state = opt.update(g, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jax.lax.pmean(loss, AXIS)

    rparams = put(param_shapes(cfg, F32), rep)
    rstate = (rparams, put(jax.eval_shape(opt.init, rparams), rep))

    # bf16 params replicated over data, with the TP split on a (data, model) mesh
    zstate = (tp(param_shapes(cfg, BF16)), master, opt_state)
    psh = jax.tree.map(lambda x: x.sharding, zstate[0])

    @partial(jax.jit, donate_argnums=(0,), out_shardings=((psh, msh, osh), rep))
    def gspmd_zero1(state, tokens):
        params, master, opt_state = state
        loss, g = jax.value_and_grad(gloss)(params, tokens)
        g = jax.lax.with_sharding_constraint(cast(g, F32), msh)
        updates, opt_state = opt.update(g, opt_state, master)
        master = optax.apply_updates(master, updates)
        return (cast(master, BF16), master, opt_state), loss

    @partial(jax.jit, donate_argnums=(0,), out_shardings=((msh, osh), rep))
    def gspmd_fsdp(state, tokens):
        master, opt_state = state
        loss, g = jax.value_and_grad(lambda m, t: gloss(cast(m, BF16), t))(master, tokens)
        g = jax.lax.with_sharding_constraint(g, msh)
        updates, opt_state = opt.update(g, opt_state, master)
        return (optax.apply_updates(master, updates), opt_state), loss

    # data parallel with the TP split (2-D meshes): optax state sharded like the params
    dsh = gspmd_sharding(cfg, mesh, data=False)
    dmaster = dsh(param_shapes(cfg, F32))
    dstate = (dmaster, dsh(jax.eval_shape(opt.init, dmaster)))
    dshard = tuple(jax.tree.map(lambda x: x.sharding, t) for t in dstate)

    @partial(jax.jit, donate_argnums=(0,), out_shardings=(dshard, rep))
    def gspmd_ddp(state, tokens):
        params, opt_state = state
        loss, g = jax.value_and_grad(gloss)(cast(params, BF16), tokens)
        updates, opt_state = opt.update(cast(g, F32), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    if "model" in mesh.axis_names:
        return [
            Case("gspmd_ddp", gspmd_ddp, (dstate, batch)),
            Case("gspmd_zero1", gspmd_zero1, (zstate, batch)),
            Case("gspmd_fsdp", gspmd_fsdp, ((master, opt_state), batch)),
        ]
    return [
        Case("replicated", replicated, (rstate, batch)),
        Case("gspmd_zero1", gspmd_zero1, (zstate, batch)),
        Case("gspmd_fsdp", gspmd_fsdp, ((master, opt_state), batch)),
    ]


def jaxsync_cases(cfg, mesh, tokens) -> list[Case]:
    batch = jax.ShapeDtypeStruct(tokens, jnp.int32)
    policy = jaxsync.MixedPrecision(param_dtype=BF16)
    bf16rs = jaxsync.MixedPrecision(param_dtype=BF16, reduce_dtype=BF16)
    keep = jax.checkpoint_policies.save_only_these_names("jaxsync_gathered_layer")
    variants = [  # name, mode, param dtype, options, remat policy
        ("jaxsync_ddp", "ddp", F32, {}, None),
        # the fp32 params read in bf16, cast once per step as the replicated baseline
        # casts them: fewer bytes, and on several GPUs the bf16 copy held beside the
        # fp32 gradients (8 x H100, 1.1B: 22564 against 20691 MiB)
        ("jaxsync_ddp_cast", jaxsync.DDP(param_dtype=BF16), F32, {}, None),
        ("jaxsync_ddp_bf16rs", "ddp", F32, {"reduce_dtype": BF16}, None),
        ("jaxsync_zero", "zero", BF16, {}, None),
        ("jaxsync_zero_bf16rs", "zero", BF16, {"reduce_dtype": BF16}, None),
        ("jaxsync_zero_keep", "zero", BF16, {"reshard_after_forward": False}, None),
        ("jaxsync_fsdp", "fsdp", F32, {"policy": policy}, None),
        ("jaxsync_fsdp_bf16rs", "fsdp", F32, {"policy": bf16rs}, None),
        ("jaxsync_fsdp_keep", "fsdp", F32, {"policy": policy}, keep),
    ]
    out = []
    for name, mode, dtype, kw, remat in variants:
        step = jaxsync.train_step(
            loss_fn(cfg, remat_policy=remat), tx(), mesh, mode=mode, stacked="blocks",
            clip_grad_norm=1.0, **kw,
        )  # fmt: skip
        shapes = with_tp(mesh, cfg)(param_shapes(cfg, dtype))
        out.append(Case(name, step, (step.abstract_state(shapes), batch)))
    return out


def ring_bytes(report: jaxsync.ScheduleReport, n: int) -> float:
    """Bytes each GPU sends per step under ring algorithms, from the collectives' results."""
    per = {
        "all-reduce": lambda b: 2 * b * (n - 1) / n,
        "reduce-scatter": lambda b: b * (n - 1),
        "all-gather": lambda b: b * (n - 1) / n,
        "all-to-all": lambda b: b * (n - 1) / n,  # all but its own piece
    }
    return sum(per.get(c.kind, lambda b: b)(c.bytes) * c.runs for c in report.collectives)


REFERENCE = {"jaxsync_ddp": "replicated", "jaxsync_ddp_cast": "replicated",
             "jaxsync_ddp_bf16rs": "replicated",
             "jaxsync_zero": "gspmd_zero1", "jaxsync_zero_bf16rs": "gspmd_zero1",
             "jaxsync_zero_keep": "gspmd_zero1",
             "jaxsync_fsdp": "gspmd_fsdp", "jaxsync_fsdp_bf16rs": "gspmd_fsdp",
             "jaxsync_fsdp_keep": "gspmd_fsdp"}  # fmt: skip


def ref_name(name: str, reports: dict) -> str:
    """The baseline a method is read against (a 2-D mesh's DDP: GSPMD's data parallel)."""
    ref = REFERENCE.get(name, "")
    return ref if ref in reports else ("gspmd_ddp" if name.startswith("jaxsync_ddp") else "")


def held(report: jaxsync.ScheduleReport) -> int:
    """Arguments + temporaries per GPU: what the step holds at once."""
    return report.memory["arguments"] + report.memory["temps"]


def exact_table(cases: list, options: dict) -> list[str]:
    """One GPU: memory per GPU and kernel bytes per step of each compiled program (no
    collective, so XLA writes no schedule to time), each against its reference."""
    got = {}
    for case in cases:
        compiled = case.fn.lower(*case.args).compile(compiler_options=options)
        stats = compiled.memory_analysis()
        got[case.name] = (
            stats.argument_size_in_bytes,
            stats.temp_size_in_bytes,
            jaxsync.hbm_bytes(compiled.as_text()).total,
        )
        print(f"  {case.name}: compiled", flush=True)
    rows = []
    for name, (args_b, temps, traffic) in got.items():
        ref = got.get(ref_name(name, got))
        rows.append([
            name, f"{args_b / 2**20:.0f}", f"{temps / 2**20:.0f}",
            f"{(args_b + temps) / (ref[0] + ref[1]):.2f}x" if ref else "",
            f"{traffic / 1e9:.1f}", f"{traffic / ref[2]:.2f}x" if ref else "",
        ])  # fmt: skip
    head = ["method", "args MiB", "temps MiB", "vs ref", "HBM GB", "vs ref"]
    table = fmt_table(head, rows, 1)
    label = "XLA defaults" if not options else "GPU performance flags"
    print(f"\n{label} (one GPU: exact measures only):\n{table}\n", flush=True)
    return [f"{label} (one GPU: exact measures only):", "", table, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument(
        "--size", default="1b", help="gpt: quick/1b/8b; llama: quick/1b/3b/7b, held out 1b128k/8b"
    )
    ap.add_argument("--quick", action="store_true", help="--size quick")
    ap.add_argument("--gpu", default="h100", choices=sorted(jaxsync.GPUS))
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: a (data, model) mesh, TP specs on the params",
    )
    ap.add_argument("--only", default="", help="comma-separated method names")
    ap.add_argument("--flags", choices=("both", "default", "perf"), default="both")
    ap.add_argument("--out", default="", help="also write the table (markdown) here")
    args = ap.parse_args()
    size = "quick" if args.quick else args.size
    m = MODELS[args.model]
    if size not in m.sizes:
        ap.error(f"--size for --model {args.model}: one of {', '.join(m.sizes)}, not {size!r}")
    cfg = m.sizes[size]
    rows, seq = cfg.batch_per_device, cfg.seq
    total = args.hosts * args.gpus_per_host
    axes = {AXIS: total // args.tp, "model": args.tp} if args.tp > 1 else None
    mesh = jaxsync.gpu_topology(
        args.gpu, hosts=args.hosts, gpus_per_host=args.gpus_per_host, axes=axes
    )
    gpu = jaxsync.GPUS[args.gpu]
    n = mesh.shape[AXIS]
    nparams = sum(x.size for x in jax.tree.leaves(param_shapes(cfg, F32)))
    tokens = (n * rows, seq + 1)  # rows per data rank (a TP group shares its rows)
    cases = baselines(cfg, mesh, tokens) + jaxsync_cases(cfg, mesh, tokens)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c.name in keep]
    flag_sets = {"default": {}, "perf": dict(jaxsync.GPU_PERFORMANCE_OPTIONS)}
    if args.flags != "both":
        flag_sets = {args.flags: flag_sets[args.flags]}
    gqa = f" heads={cfg.heads}/{cfg.kv_heads} ffn={cfg.ffn}" if m is MODELS["llama"] else ""
    ring = 2 * 4 * nparams / args.tp * (n - 1) / n  # a TP group's GPU holds ~1/tp
    title = (
        f"{mesh.size} x {jaxsync.GPUS[args.gpu].name} {dict(mesh.shape)}, "
        f"{m.name} d={cfg.d_model} L={cfg.layers}{gqa} seq={seq} vocab={cfg.vocab}, "
        f"{nparams / 1e9:.2f}B params, {rows} rows/GPU, AdamW + clip; jax {jax.__version__}"
    )
    print(title, flush=True)
    lines = [title, ""]
    for flag_name, options in flag_sets.items():
        bound = None
        if args.tp == 1:  # the data-parallel bound: one GPU's rows alone + 1/N of AdamW
            one = jax.ShapeDtypeStruct((rows, seq + 1), jnp.int32)
            bound = jaxsync.communication_bound(
                loss_fn(cfg), param_shapes(cfg, BF16), one, tx(), mesh, options=options
            )
            lines += [f"{flag_name}: {bound}", ""]
            print(f"  [{flag_name}] {bound}", flush=True)
        if n == 1:  # no collective: XLA schedules nothing, only the exact measures stand
            lines += exact_table(cases, options)
            continue
        reports = {}
        for case in cases:
            t0 = time.perf_counter()
            lowered = case.fn.lower(*case.args)
            reports[case.name] = jaxsync.schedule_report(lowered, options=options)
            print(f"  [{flag_name}] {case.name}: compiled in {time.perf_counter() - t0:.0f} s, "
                  f"{reports[case.name].step_us / 1e3:.2f} ms", flush=True)  # fmt: skip
        head = ["method", "step ms", "vs ref", "timeline ms", "vs ref", "repriced ms",
                "repriced / timeline", "async ops", "exposed %",
                "of bound", "of bound (timeline)", "XLA-priced", "sent / ring bound",
                "args MiB", "temps MiB", "vs ref", "fits", "HBM GB", "vs ref"]  # fmt: skip
        rows_out = []
        counted = {name: jaxsync.hbm_bytes(r.hlo_text) for name, r in reports.items()}
        traffic = {name: c.total for name, c in counted.items()}
        for name, r in reports.items():
            ref = reports.get(ref_name(name, reports))
            rows_out.append([
                name, f"{r.step_us / 1e3:.2f}",
                f"{r.step_us / ref.step_us:.2f}x" if ref else "",
                f"{r.makespan_us / 1e3:.2f}",
                f"{r.makespan_us / ref.makespan_us:.2f}x" if ref else "",
                f"{r.repriced_us / 1e3:.2f}", f"{r.repriced_us / r.makespan_us:.2f}",
                f"{sum(a.runs for a in r.async_ops)}",
                f"{r.exposed_total_us / r.step_us:.1%}",
                f"{bound.efficiency(r):.0%}" if bound else "",
                f"{bound.efficiency(r, 'timeline'):.0%}" if bound else "",
                f"{r.xla_share:.1%}", f"{ring_bytes(r, n) / ring:.2f}",
                f"{r.memory['arguments'] / 2**20:.0f}", f"{r.memory['temps'] / 2**20:.0f}",
                f"{held(r) / held(ref):.2f}x" if ref else "",
                "yes" if r.memory["peak"] <= gpu.memory_bytes else "**no**",
                f"{traffic[name] / 1e9:.1f}",
                f"{traffic[name] / traffic[ref_name(name, reports)]:.2f}x" if ref else "",
            ])  # fmt: skip
        label = "XLA defaults" if not options else "GPU performance flags"
        table = fmt_table(head, rows_out, 1)
        remat = [f"{name}: {c.rematerialized / 1e9:.1f} GB of its kernel bytes in kernels XLA "
                 "rematerialized (its memory estimate before scheduling passed 80% of the GPU)"
                 for name, c in counted.items() if c.rematerialized]  # fmt: skip
        lines += [f"{label}:", "", table, "", *remat]
        print(f"\n{label}:\n{table}\n" + "".join(f"{x}\n" for x in remat), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines))


if __name__ == "__main__":
    main()

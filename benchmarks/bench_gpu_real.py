"""Measured step times on this machine's GPUs, beside XLA's model of the same program.

    python benchmarks/bench_gpu_real.py --size 1b     # on a machine with NVIDIA GPUs
    python benchmarks/bench_gpu_real.py --quick       # a small model (smoke run)

``bench_gpu.py`` prices steps for GPU clusters that nobody here has, from XLA's
latency-hiding scheduler (and jaxsync's roofline for the computations it skips).
This script checks that pricing where GPUs are at hand. Each method of
``bench_gpu`` (same GPT, same AdamW + clipping, same shardings) runs in its own
process on a mesh of the local GPUs and is:

- compiled for the real devices with :data:`jaxsync.SCHEDULE_OPTIONS` (cuBLAS
  matmuls, the scheduler's dump on); the table gives that executable's modeled
  step (``model ms``) and its measured one (``measured ms``: the mean of
  ``--steps`` steps dispatched back to back, best of 3 rounds, after 2 warm-ups),
  and the model repriced (``repriced ms``: ``ScheduleReport.repriced_us``, each
  asynchronous op that is not a collective at its bytes over the GPU's memory
  bandwidth instead of XLA's flat 5000 cycles; ``async ops``: how many run per step);
- compiled again with XLA's defaults (autotuned Triton matmuls), what a user
  runs (``defaults ms``);
- compiled for a compile-only mesh of the same size from jaxsync's own target
  config (:func:`jaxsync.gpu_topology`, ``--target``): the figure ``bench_gpu``
  would print for this mesh (``target ms``).

Memory: the allocator's peak over the process (``peak MiB``: state, batch and
the step's temporaries, and whatever building the state needed) against XLA's
``arguments + temporaries`` of the executable (``model MiB``).

One GPU checks the compute side of the model only: a 1-device program has no
collectives, so no communication is priced or measured. It ran on one H100 on
2026-11-26 and on one H200 on 2026-11-27 (docs/gpu.md); on CPU devices the measured
columns work, the modeled ones need a GPU.

``--model llama`` runs ``bench_gpu``'s Llama-style decoder (default: the GPT);
``--defaults-only`` only what a user runs (XLA's defaults); ``--profile DIR`` profiles
each executable and writes its kernels' times per run by HLO instruction to
``DIR/<model>_<method>[_modeled].json`` (run with ``XLA_FLAGS=
--xla_gpu_enable_command_buffer=`` so the profile sees each kernel, not the CUDA graph
that holds it), and sets the *calibrated* model beside the measured step: the modeled
executable's schedule walked again with those times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
_platforms = os.environ.get("JAX_PLATFORMS")
import bench_gpu  # noqa: E402  (sets JAX_PLATFORMS=cpu for its compile-only runs)
import bench_scan as model  # noqa: E402

if _platforms is None:  # this script runs on the GPUs, and so do its children
    os.environ.pop("JAX_PLATFORMS", None)

import jaxsync  # noqa: E402
from jaxsync._src.gpu.schedule import compile_scheduled  # noqa: E402

#: bench_gpu's 1-D methods: its baselines first, then every jaxsync variant.
METHODS = tuple(dict.fromkeys([*bench_gpu.REFERENCE.values(), *bench_gpu.REFERENCE]))


def config(name: str, size: str):
    """``bench_gpu``'s config of the model (``gpt`` or ``llama``) at that size, and its rows."""
    cfg = bench_gpu.MODELS[name].sizes[size]
    return cfg, cfg.batch_per_device


def cases(cfg, mesh, tokens) -> dict:
    both = bench_gpu.baselines(cfg, mesh, tokens) + bench_gpu.jaxsync_cases(cfg, mesh, tokens)
    return {c.name: c for c in both}


def real_state(name: str, case, cfg, mesh) -> object:
    """The method's state from one set of initial params, placed as the step expects."""
    params = bench_gpu.model_of(cfg).module.device_params(cfg)
    opt = bench_gpu.clipped()
    if name.startswith("jaxsync"):  # init places it (and keys its plan by the placement)
        dtype = jax.tree.leaves(case.args[0].params)[0].dtype
        shapes = bench_gpu.with_tp(mesh, cfg)(model.cast(params, dtype))
        return case.fn.init(jax.device_put(model.cast(params, dtype),
                                           jax.tree.map(lambda x: x.sharding, shapes)))  # fmt: skip
    if name == "gspmd_zero1":
        state = (model.cast(params, jnp.bfloat16), params, opt.init(params))
    else:  # replicated, gspmd_fsdp
        state = (params, opt.init(params))
    want = case.args[0]
    if jax.tree.map(lambda x: x.shape, state) != jax.tree.map(lambda x: x.shape, want):
        raise ValueError(f"{name}: the state built here is not the one the step takes")
    return jax.device_put(state, jax.tree.map(lambda w: w.sharding, want))


def compile_modeled(lowered, gpu: str, dump_dir: str | None = None):
    """The executable compiled with the schedule dump on, and XLA's model of it (None
    for a program that is not a GPU one: nothing is modeled there)."""
    if jax.devices()[0].platform != "gpu":
        return lowered.compile(), None
    return compile_scheduled(lowered, gpu=gpu, dump_dir=dump_dir)


def calibrated(dump_dir: str, compiled, gpu: str, table: dict):
    """XLA's schedule of the modeled executable (its dump), walked again with its
    kernels at their measured times: the calibrated model, with no second compile."""
    from jaxsync._src.gpu.read import read_schedule
    from jaxsync._src.gpu.schedule import _schedule_text

    text = _schedule_text(dump_dir)
    twin = _schedule_text(os.path.join(dump_dir, "pricing_twin"))
    if text is None:
        text, twin = twin, None
    return read_schedule(text, compiled.memory_analysis(), jaxsync.GPUS[gpu], twin, table)


def calibration_gaps(dump_dir: str, runs_path: str) -> dict:
    """Where the profile and the calibrated walk part (``repricing.unwalked``): each
    profiled op's time per step beyond what the walk charges it, largest first, with
    the computation that holds it; ``unwalked_ms`` sums them."""
    from jaxsync._src.gpu.read import _Program
    from jaxsync._src.gpu.repricing import unwalked
    from jaxsync._src.gpu.schedule import _schedule_text

    prog = _Program(_schedule_text(dump_dir))
    with open(runs_path) as f:
        table = json.load(f)
    per_step = {op: row["us_per_step"] for op, row in table.items()}
    per_run = {op: row["us_per_step"] / row["runs"] for op, row in table.items()}
    gaps = unwalked(per_step, per_run, prog.comps, prog.runs)
    where = {i.one("name"): c.one("name") for c in prog.comps.values()
             for i in c.all("instructions")}  # fmt: skip
    top = sorted(gaps.items(), key=lambda kv: -abs(kv[1]))[:20]
    return {"unwalked_ms": sum(gaps.values()) / 1e3,
            "top": [[round(us / 1e3, 3), op, where.get(op, "?"), table[op]["runs"],
                     table[op]["launches"]] for op, us in top]}  # fmt: skip


def keep_schedule(dump_dir: str, stem: str) -> None:
    """The schedule dump (and its pricing twin's) beside the kernel table, to read later."""
    import shutil

    from jaxsync._src.gpu.schedule import _schedule_text

    for sub, suffix in (("", ".schedule.txt"), ("pricing_twin", ".twin.schedule.txt")):
        text = _schedule_text(os.path.join(dump_dir, sub))
        if text is not None:
            with open(stem + suffix, "w") as f:
                f.write(text)
    shutil.rmtree(dump_dir, ignore_errors=True)


def kernel_times(fn, state, batch, where: str, name: str, steps: int = 3) -> tuple[dict, object]:
    """The GPU kernels' time per step, from a profile of ``steps`` steps: the total, and
    the ops by HLO instruction (``hlo_op``), largest first. The whole table is written
    to ``where/<name>.json`` (``{instruction: microseconds per step}``: what
    ``schedule_report(kernel_times=...)`` takes, for the executable profiled)."""
    import glob
    import shutil
    import tempfile

    from jax._src.lib import _profile_data

    state, loss = fn(state, batch)  # a warm-up outside the profile
    jax.block_until_ready((state, loss))
    tmp = tempfile.mkdtemp()
    with jax.profiler.trace(tmp):
        for _ in range(steps):
            state, loss = fn(state, batch)
        jax.block_until_ready((state, loss))
    ops: dict[str, float] = {}
    launches: dict[tuple[str, str], int] = {}
    seen: set[str] = set()  # the stats the kernel events carry (what names the op)
    lines: dict[str, float] = {}
    for path in glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True):
        for plane in _profile_data.ProfileData.from_file(path).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                events = list(line.events)
                busy = sum(e.duration_ns for e in events) / 1e3
                lines[line.name] = lines.get(line.name, 0.0) + busy
                if not line.name.startswith("Stream"):
                    continue
                for e in events:
                    stats = dict(e.stats)
                    seen.update(list(stats)[:20])
                    op = str(stats.get("hlo_op") or e.name)
                    ops[op] = ops.get(op, 0.0) + e.duration_ns / 1e3
                    launches[(op, e.name)] = launches.get((op, e.name), 0) + 1
    shutil.rmtree(tmp, ignore_errors=True)
    per_step = {k: v / steps for k, v in sorted(ops.items(), key=lambda kv: -kv[1])}
    # microseconds per run (a loop body's kernel runs once per iteration), as
    # schedule_report's table wants them; an op of several kernels: their sum (its
    # runs: the most launches of any one of its kernels)
    runs = {k: 1 for k in ops}
    for (op, _), count in launches.items():
        runs[op] = max(runs[op], count // steps)
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, f"{name}.json"), "w") as f:
        json.dump({k: v / runs[k] for k, v in per_step.items()}, f)
    with open(os.path.join(where, f"{name}.runs.json"), "w") as f:  # what the table came from
        json.dump({op: {"us_per_step": us, "runs": runs[op],
                        "launches": {k: c / steps for (o, k), c in launches.items() if o == op}}
                   for op, us in per_step.items()}, f)  # fmt: skip
    return {"kernel_ms": sum(per_step.values()) / 1e3,
            "lines_ms": {k: v / steps / 1e3 for k, v in lines.items()},
            "stats": sorted(seen), "ops": len(per_step),
            "top": list(per_step.items())[:25]}, state  # fmt: skip


def time_steps(fn, state, batch, steps: int) -> tuple[float, object]:
    """Mean ms per step, best of 3 rounds of ``steps`` back-to-back steps."""
    for _ in range(2):
        state, loss = fn(state, batch)
    jax.block_until_ready((state, loss))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, loss = fn(state, batch)
        jax.block_until_ready((state, loss))
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best, state


def one(name: str, mname: str, size: str, steps: int, gpu: str, target: str,
        modeled: bool = True, profile: str = "") -> dict:
    cfg, rows = config(mname, size)
    devices = jax.devices()
    mesh = Mesh(np.asarray(devices), (bench_gpu.AXIS,))  # Auto axes, as gpu_topology's
    n = mesh.size
    tokens_shape = (n * rows, cfg.seq + 1)
    case = cases(cfg, mesh, tokens_shape)[name]
    tokens = jax.device_put(
        jax.random.randint(jax.random.PRNGKey(1), tokens_shape, 0, cfg.vocab, jnp.int32),
        NamedSharding(mesh, P(bench_gpu.AXIS)),
    )
    state = real_state(name, case, cfg, mesh)
    out = {"method": name, "devices": n, "device": devices[0].device_kind}

    report = None
    if modeled:
        import tempfile

        dump = tempfile.mkdtemp()
        t0 = time.perf_counter()
        modeled_fn, report = compile_modeled(case.fn.lower(state, tokens), gpu, dump)
        out["compile_s"] = time.perf_counter() - t0
        out["measured_ms"], state = time_steps(modeled_fn, state, tokens, steps)
        if report is not None and profile:  # the model with the kernels' measured times
            out["modeled_kernels"], state = kernel_times(modeled_fn, state, tokens, profile,
                                                         f"{mname}_{name}_modeled")  # fmt: skip
            with open(os.path.join(profile, f"{mname}_{name}_modeled.json")) as f:
                cal = calibrated(dump, modeled_fn, gpu, json.load(f))
            out["calibrated_ms"] = cal.repriced_us / 1e3
            out["calibrated_share"] = cal.measured_share
            out["calibration_gaps"] = calibration_gaps(
                dump, os.path.join(profile, f"{mname}_{name}_modeled.runs.json"))
            keep_schedule(dump, os.path.join(profile, f"{mname}_{name}_modeled"))
    if report is not None:
        out["model_ms"] = report.step_us / 1e3
        out["makespan_ms"] = report.makespan_us / 1e3
        out["repriced_ms"] = report.repriced_us / 1e3
        out["async_ops"] = sum(a.runs for a in report.async_ops)
        out["roofline_ms"] = report.roofline_us / 1e3
        out["model_mib"] = (report.memory["arguments"] + report.memory["temps"]) / 2**20
    t0 = time.perf_counter()
    default_fn = case.fn.lower(state, tokens).compile()
    out.setdefault("compile_s", time.perf_counter() - t0)
    mem = default_fn.memory_analysis()
    if mem is not None:
        out["defaults_mib"] = (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / 2**20
    out["defaults_ms"], state = time_steps(default_fn, state, tokens, steps)
    if profile:
        out["kernels"], state = kernel_times(default_fn, state, tokens, profile, f"{mname}_{name}")
    stats = devices[0].memory_stats() or {}
    out["peak_mib"] = stats.get("peak_bytes_in_use", 0) / 2**20
    del state
    if target and jaxsync.gpu_target_available():
        try:
            tmesh = jaxsync.gpu_topology(target, hosts=1, gpus_per_host=n)
            tcase = cases(cfg, tmesh, tokens_shape)[name]
            tr = jaxsync.schedule_report(tcase.fn.lower(*tcase.args))
            out["target_ms"] = tr.step_us / 1e3
            out["target_repriced_ms"] = tr.repriced_us / 1e3
            out["target_mib"] = (tr.memory["arguments"] + tr.memory["temps"]) / 2**20
        except Exception as e:  # the twin is a cross-check; the measurement stands alone
            out["target_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    flops = 6 * cfg_params(cfg) * tokens_shape[0] * cfg.seq / n
    out["tflops"] = flops / (out["defaults_ms"] / 1e3) / 1e12
    return out


def cfg_params(cfg) -> int:
    init = bench_gpu.model_of(cfg).module.device_params
    return sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init(cfg))))


def table(rows: list[dict]) -> str:
    head = ["method", "measured ms", "model ms", "model / measured", "makespan ms",
            "makespan / measured", "repriced ms", "repriced / measured", "calibrated ms",
            "calibrated / measured", "async ops",
            "of it roofline ms",
            "target ms", "defaults ms", "kernels ms", "6ND TFLOP/s", "peak MiB", "model MiB",
            "defaults MiB",
            "target MiB", "compile s"]  # fmt: skip

    def f(r, k, fmt="{:.2f}"):
        return fmt.format(r[k]) if k in r else "-"

    body = []
    for r in rows:
        ratio = f"{r['model_ms'] / r['measured_ms']:.2f}" if "model_ms" in r else "-"
        span = f"{r['makespan_ms'] / r['measured_ms']:.2f}" if "makespan_ms" in r else "-"
        rep = f"{r['repriced_ms'] / r['measured_ms']:.2f}" if "repriced_ms" in r else "-"
        cal = (f"{r['calibrated_ms'] / r['measured_ms']:.2f}" if "calibrated_ms" in r
               else "-")  # fmt: skip
        body.append([r["method"], f(r, "measured_ms"), f(r, "model_ms"), ratio,
                     f(r, "makespan_ms"), span, f(r, "repriced_ms"), rep,
                     f(r, "calibrated_ms"), cal,
                     f(r, "async_ops", "{:d}"),
                     f(r, "roofline_ms"), f(r, "target_ms"), f(r, "defaults_ms"),
                     f(r.get("kernels", {}), "kernel_ms"),
                     f(r, "tflops", "{:.0f}"), f(r, "peak_mib", "{:.0f}"),
                     f(r, "model_mib", "{:.0f}"), f(r, "defaults_mib", "{:.0f}"),
                     f(r, "target_mib", "{:.0f}"),
                     f(r, "compile_s", "{:.0f}")])  # fmt: skip
    return model.fmt_table(head, body, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(bench_gpu.MODELS), default="gpt")
    ap.add_argument("--size", default="1b", help="gpt: quick/1b/8b; llama: quick/1b/7b")
    ap.add_argument("--quick", action="store_true", help="--size quick")
    ap.add_argument("--only", default="", help="comma-separated method names")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gpu", default="h200", choices=sorted(jaxsync.GPUS),
                    help="the local GPU's jaxsync.GpuSpec (the roofline's peaks)")  # fmt: skip
    ap.add_argument("--target", default="h200", help="compile-only twin ('' to skip)")
    ap.add_argument("--defaults-only", action="store_true",
                    help="only XLA's default compile (no modeled executable, no twin)")
    ap.add_argument("--profile", default="",
                    help="profile the default executable; kernel tables go to this folder")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help="also write the table (markdown) here")
    args = ap.parse_args()
    size = "quick" if args.quick else args.size
    names = args.only.split(",") if args.only else list(METHODS)
    if args.child:
        print(json.dumps(one(names[0], args.model, size, args.steps, args.gpu, args.target,
                             not args.defaults_only, args.profile)), flush=True)  # fmt: skip
        return
    rows = []
    for name in names:  # a process each: a clean allocator peak, nothing left over
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--size", size,
               "--only", name, "--steps", str(args.steps), "--gpu", args.gpu,
               "--target", args.target, "--profile", args.profile]  # fmt: skip
        cmd += ["--defaults-only"] if args.defaults_only else []
        res = subprocess.run(cmd, capture_output=True, text=True)
        last = (res.stdout.strip().splitlines() or [""])[-1]
        if res.returncode != 0 or not last.startswith("{"):
            print(f"{name}: failed\n{res.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads(last))
        brief = {k: v for k, v in rows[-1].items() if k not in ("kernels", "modeled_kernels")}
        for k in ("kernels", "modeled_kernels"):
            brief[k] = {a: b for a, b in rows[-1].get(k, {}).items() if a != "top"}
        print(f"  {name}: {json.dumps(brief)}", flush=True)
    if not rows:
        sys.exit(1)
    cfg, _ = config(args.model, size)
    title = (f"{rows[0]['devices']} x {rows[0]['device']}, {bench_gpu.MODELS[args.model].name} "
             f"d={cfg.d_model} L={cfg.layers} "
             f"seq={cfg.seq} vocab={cfg.vocab}, {cfg_params(cfg) / 1e9:.2f}B params, "
             f"{cfg.batch_per_device} rows/GPU; jax {jax.__version__}")  # fmt: skip
    text = f"{title}\n\n{table(rows)}\n"
    print("\n" + text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()

"""XLA's own model of a GPU step: modeled time, exposed communication, overlap.

For a GPU program (compiled for a real GPU, or for compile-only devices from
:func:`jaxsync.gpu_topology`), XLA's latency-hiding scheduler orders every
computation against a cost model (the analytical speed-of-light estimator) and can
dump what it decided: per instruction a modeled start and end time, and per
computation its total time and the time each collective kind left exposed
("wasted": nothing to overlap it with). :func:`schedule_report` compiles with that
dump on and turns it into one step's figures:

- a loop body is priced once per iteration (its trip count, nested loops
  multiplied); an iteration XLA peeled out of a loop sits in the caller and is
  counted there, once. A ``conditional`` costs its dearest branch.
- The scheduler skips computations with nothing asynchronous in them (the forward
  loop of a ZeRO step, a whole one-GPU program). Those are priced by XLA too:
  :func:`schedule_report` compiles a *pricing twin* of the program (:mod:`twin`)
  whose every loop body carries a tiny probe collective, so that the scheduler
  prices the same kernels with the same cost model; the probe's own cost is left
  out. Only a kernel the twin cannot price (a loop inside a region manual over
  some mesh axes only) falls back to a roofline of the target GPU, and the report
  keeps that share apart (``roofline_us``).
- XLA charges an asynchronous op that is not a collective (a dynamic slice on
  another stream) a flat 5000 cycles; ``repriced_us`` walks the schedule again
  with each at its bytes over the GPU's memory bandwidth, and with measured
  kernel times where ``kernel_times`` gives them (:mod:`repricing`).

These are models of a program, not measurements of a GPU.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

import jax

from ..core.validate import check_bool
from ..core.xla_names import pipelined
from .read import read_schedule, skipped_computations
from .repricing import kernel_table, profile_text
from .target import GPUS, GpuSpec
from .timings import ScheduleReport
from .twin import pricing_twin

# Turn the latency-hiding scheduler on, price with the analytical estimator, dump.
# Matmuls go to cuBLAS: without a GPU, XLA cannot autotune Triton gemm tiles and
# falls back to a placeholder tiling (16x8, 2 warps) that its cost model prices
# at up to ~50x the tuned kernel (seen on jax 0.10.2), which would swamp the
# step with an artefact of compiling without a device.
CUBLAS_GEMMS: Mapping[str, Any] = {"xla_gpu_enable_triton_gemm": False}
SCHEDULE_OPTIONS: Mapping[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_analytical_sol_latency_estimator": True,
    "xla_dump_latency_hiding_schedule": True,
    **CUBLAS_GEMMS,
}
# The collective flags of JAX's GPU performance guide: pipeline the loop-carried
# collectives across iterations and combine small ones (thresholds in bytes).
# (The pipelining options spelled for the installed XLA: core.xla_names.)
GPU_PERFORMANCE_OPTIONS: Mapping[str, Any] = {
    **pipelined("all_gather", True),
    **pipelined("reduce_scatter", True),
    **pipelined("all_reduce", True),
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 134217728,
    "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
}

_PGLE = "xla_gpu_pgle_profile_file_or_directory_path"
_NO_SCHEDULE = (
    "schedule_report: XLA wrote no latency-hiding schedule for this program. It needs a "
    "GPU program (lower the step for a GPU mesh, e.g. jaxsync.gpu_topology('h100')) and an "
    "XLA that knows `xla_dump_latency_hiding_schedule` (jaxlib {version} here); "
    "the program's platform is {platform!r}."
)


def schedule_report(
    lowered: Any,
    *,
    options: Mapping[str, Any] | None = None,
    gpu: GpuSpec | str | None = None,
    dump_dir: str | None = None,
    twin: bool = True,
    kernel_times: Mapping[str, float] | str | os.PathLike | None = None,
) -> ScheduleReport:
    """Compiles ``lowered`` with XLA's schedule dump on and reads its model of the step.

    Args:
      lowered: a ``jax.stages.Lowered`` for a GPU (``jax.jit(f).lower(...)``,
        :meth:`jaxsync.TrainStep.lower`).
      options: extra XLA compile options, e.g. :data:`GPU_PERFORMANCE_OPTIONS`
        (:data:`SCHEDULE_OPTIONS` are always added). An option this XLA does not
        know is an error naming it.
      gpu: the GPU for the roofline (a :class:`jaxsync.GpuSpec` or a key of
        :data:`jaxsync.GPUS`); default: read off the program's target config.
      dump_dir: keep XLA's dump here (default: a temporary directory).
      twin: price what the scheduler skipped with the pricing twin (a second
        compile, only when something was skipped); ``False``: with the roofline.
      kernel_times: measured kernel times for the repriced reading
        (``report.repriced_us``): ``{HLO instruction name: microseconds per run}``
        (names as in ``report.hlo_text``; a ``fingerprint::`` prefix is dropped), or
        the path of an XLA profile in text form (``costs { name: "fusion.3" cost_us:
        41.5 }``, what ``jax.experimental.profiler.get_profiled_instructions_proto``
        writes). Each kernel it names takes its measured time instead of XLA's;
        ``report.measured_share`` says how much of the step that covers. XLA's
        profile-guided latency estimator reads the same table
        (``xla_gpu_pgle_profile_file_or_directory_path``), so its scheduler orders
        and prices the program with those times too, and ``step_us`` and
        ``makespan_us`` are its readings with them.

    Returns:
      A :class:`ScheduleReport`.

    Example:
      >>> report = jaxsync.schedule_report(step.lower(state, batch))
      >>> print(report.step_us, report.exposed_us)
      >>> print(report.makespan_us, report.repriced_us)  # XLA's timeline; repriced
    """
    return compile_scheduled(
        lowered, options=options, gpu=gpu, dump_dir=dump_dir, twin=twin, kernel_times=kernel_times
    )[1]


def compile_scheduled(
    lowered: Any,
    *,
    options: Mapping[str, Any] | None = None,
    gpu: GpuSpec | str | None = None,
    dump_dir: str | None = None,
    twin: bool = True,
    kernel_times: Mapping[str, float] | str | os.PathLike | None = None,
) -> tuple[Any, ScheduleReport]:
    """:func:`schedule_report`, and the executable it modeled (to run it on real GPUs
    and set its measured step beside the model: ``benchmarks/bench_gpu_real.py``)."""
    if not hasattr(lowered, "compile"):
        raise TypeError(
            "schedule_report needs a `jax.stages.Lowered` (jax.jit(f).lower(...) or "
            f"TrainStep.lower(...)), got {type(lowered).__name__}."
        )
    options, dump_dir = _check_args(options, gpu, dump_dir, twin)
    table = kernel_table(kernel_times)
    opts = {**SCHEDULE_OPTIONS, **options}
    with tempfile.TemporaryDirectory() as tmp:
        where = dump_dir or tmp
        if table and _PGLE not in opts:
            # XLA's profile-guided latency estimator schedules with the same table
            # (kernels it names; the rest keep the cost model's price).
            opts[_PGLE] = os.path.join(tmp, "jaxsync_kernel_times.pbtxt")
            with open(opts[_PGLE], "w") as f:
                f.write(profile_text(table))
        compiled = _compile(lowered, {**opts, "xla_dump_to": where})
        text = _schedule_text(where)
        twin_text = None
        # Nothing scheduled at all (no collective anywhere), or some computations
        # skipped: price them with the twin.
        made = (
            pricing_twin(lowered) if twin and (text is None or skipped_computations(text)) else None
        )
        if made is not None:
            twin_dir = os.path.join(where, "pricing_twin")
            _compile(made[0], {**opts, "xla_dump_to": twin_dir})
            twin_text = _schedule_text(twin_dir)
        if text is None:
            text, twin_text = twin_text, None
        if text is None:
            platform = getattr(getattr(compiled, "_executable", None), "platform", "?")
            raise RuntimeError(_NO_SCHEDULE.format(version=jax.__version__, platform=platform))
        spec = _gpu(gpu, where)
    report = read_schedule(text, compiled.memory_analysis(), spec, twin_text, table)
    return compiled, dataclasses.replace(report, hlo_text=compiled.as_text())


def _check_args(
    options: Any, gpu: Any, dump_dir: Any, twin: Any
) -> tuple[dict[str, Any], str | None]:
    """The arguments' checks, before anything is compiled: ``(options, dump_dir)``."""
    check_bool(twin, "twin")
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise TypeError(
            "schedule_report: `options` must be a mapping of XLA option names to values, "
            "e.g. `options=jaxsync.GPU_PERFORMANCE_OPTIONS` or "
            f"`{{'xla_gpu_enable_latency_hiding_scheduler': True}}`; got "
            f"{type(options).__name__} {options!r}."
        )
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise TypeError(
            f"schedule_report: `options` keys must be XLA option names (str), got {bad[0]!r}."
        )
    if gpu is not None and not isinstance(gpu, GpuSpec | str):
        raise TypeError(f"`gpu` must be one of {sorted(GPUS)} or a GpuSpec, got {gpu!r}.")
    if isinstance(gpu, str) and gpu not in GPUS:
        raise ValueError(f"`gpu` must be one of {sorted(GPUS)} or a GpuSpec, got {gpu!r}.")
    if dump_dir is None:
        return dict(options), None
    if not isinstance(dump_dir, str | os.PathLike):
        raise TypeError(f"`dump_dir` must be a directory path (str), got {dump_dir!r}.")
    dump_dir = os.fspath(dump_dir)
    try:
        os.makedirs(dump_dir, exist_ok=True)
        # XLA writes its dump there and fails without a word when it cannot.
        with tempfile.TemporaryFile(dir=dump_dir):
            pass
    except OSError as e:
        raise ValueError(
            f"schedule_report: `dump_dir` {dump_dir!r} cannot be written "
            f"({type(e).__name__}: {e.strerror or e}); XLA writes its schedule dump there. "
            "Pass a directory you can write to, or leave `dump_dir` out (a temporary one)."
        ) from None
    return dict(options), dump_dir


def _schedule_text(where: str) -> str | None:
    files = sorted(glob.glob(os.path.join(where, "*.schedule.txt")), key=os.path.getmtime)
    if not files:
        return None
    with open(files[-1]) as f:
        return f.read()


def _compile(lowered: Any, options: dict[str, Any]) -> Any:
    # A program loaded from the persistent compilation cache is not compiled, so
    # XLA would dump no schedule: compile this one afresh.
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return lowered.compile(compiler_options=options)
    except Exception as e:  # jax raises JaxRuntimeError; keep its text
        m = re.search(r"No such compile option: '([\w.]+)'", str(e))
        if m is None:
            raise
        raise ValueError(
            f"XLA option `{m.group(1)}` is not known to this XLA (jaxlib {jax.__version__}); "
            "flag names change across releases: drop it or rename it for this version."
        ) from e
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)


def _gpu(gpu: GpuSpec | str | None, dump: str) -> GpuSpec:
    if isinstance(gpu, GpuSpec):
        return gpu
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"`gpu` must be one of {sorted(GPUS)} or a GpuSpec, got {gpu!r}.")
        return GPUS[gpu]
    name = ""
    for path in glob.glob(os.path.join(dump, "*gpu_target_config.pbtxt")):
        with open(path) as f:
            m = re.search(r'device_description_str: "([^"]*)"', f.read())
        name = m.group(1) if m else name
    by_name = {s.name: s for s in GPUS.values()}
    if name not in by_name:
        raise ValueError(
            f"schedule_report: the program targets {name or 'an unknown GPU'!r}, which has no "
            f"jaxsync.GpuSpec; pass `gpu=` (a key of {sorted(GPUS)} or your own GpuSpec)."
        )
    return by_name[name]

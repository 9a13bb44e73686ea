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
- The scheduler skips computations with nothing asynchronous in them (on
  jax 0.10.2, e.g. the forward loop body of a ZeRO step); those are priced here
  with a roofline of the target GPU (each kernel at the larger of its FLOPs at
  peak tensor throughput and its operand + result bytes at peak memory
  bandwidth), reported apart as ``roofline_us`` so the reader sees how much of
  the figure is XLA's model and how much ours.

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

from .gpu_target import GPUS, GpuSpec
from .roofline import compute_times, dot_flops, is_compute, roofline, shape_bytes
from .textproto import Message, parse

# Turn the latency-hiding scheduler on, price with the analytical estimator, dump.
# Matmuls go to cuBLAS: without a GPU, XLA cannot autotune Triton gemm tiles and
# falls back to a placeholder tiling (16x8, 2 warps) that its cost model prices
# at up to ~50x the tuned kernel (seen on jax 0.10.2), which would swamp the
# step with an artefact of compiling without a device.
SCHEDULE_OPTIONS: Mapping[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_analytical_sol_latency_estimator": True,
    "xla_dump_latency_hiding_schedule": True,
    "xla_gpu_enable_triton_gemm": False,
}
# The collective flags of JAX's GPU performance guide: pipeline the loop-carried
# collectives across iterations and combine small ones (thresholds in bytes).
GPU_PERFORMANCE_OPTIONS: Mapping[str, Any] = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 134217728,
    "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
}

_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HOTSPOTS = 25
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_NO_SCHEDULE = (
    "schedule_report: XLA wrote no latency-hiding schedule for this program. It needs a "
    "GPU program (lower the step for a GPU mesh, e.g. jaxsync.gpu_topology('h100')) and an "
    "XLA that knows `xla_dump_latency_hiding_schedule` (jaxlib {version} here); "
    "the program's platform is {platform!r}."
)


@dataclasses.dataclass(frozen=True)
class CollectiveTiming:
    """One asynchronous collective as the scheduler placed it.

    Attributes:
      name: the ``*-start`` (or ``async-start``) instruction.
      kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``, ...
      computation: the computation it sits in.
      runs: how many times it runs per step (loop trip counts multiplied).
      bytes: result bytes of one run.
      modeled_us: its own modeled duration, start to done.
      overlap_us: modeled compute time scheduled between its start and its done.
      overlap_ops: number of compute instructions scheduled there.
      is_sync: XLA's ``is_sync`` (run as a blocking collective, no overlap possible).
    """

    name: str
    kind: str
    computation: str
    runs: int
    bytes: int
    modeled_us: float
    overlap_us: float
    overlap_ops: int
    is_sync: bool


@dataclasses.dataclass(frozen=True)
class Hotspot:
    """One costly instruction: its modeled time per run and runs per step."""

    name: str
    opcode: str
    computation: str
    us: float
    runs: int
    op_name: str

    @property
    def total_us(self) -> float:
        return self.us * self.runs


@dataclasses.dataclass(frozen=True)
class ComputationTiming:
    """One computation's modeled time per run, and how often it runs per step.

    ``source`` is ``"xla"`` (the scheduler's ``total_cycles``) or ``"roofline"``;
    ``span_us`` is the scheduler's makespan of it (the roofline figure where skipped).
    """

    name: str
    runs: int
    own_us: float
    source: str
    exposed_us: Mapping[str, float]
    span_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """A GPU step as XLA's latency-hiding scheduler modeled it; times in microseconds.

    Attributes:
      step_us: the modeled step: every computation's own time times its runs.
      roofline_us: the part of ``step_us`` priced by the roofline (computations the
        scheduler skipped), not by XLA.
      roofline_scale: the factors applied to those roofline figures, for matmul
        kernels and for the rest: XLA's modeled time of the same class of kernels
        in the scheduled computations over their roofline.
      exposed_us: per collective kind, the time it runs with nothing to overlap.
      computations: every priced computation.
      collectives: every asynchronous collective.
      memory: ``memory_analysis()`` per device, bytes: ``arguments``, ``outputs``,
        ``aliased``, ``temps`` and ``peak`` (arguments + outputs - aliased + temps).
      device: the GPU the program was compiled for.
      hotspots: the costliest compute instructions of the scheduled computations
        (time x runs), dearest first: where to look for the step's cost.
      hlo_text: the compiled module (``jaxsync.overlap_report(report.hlo_text)``
        says where each collective sits).
    """

    step_us: float
    roofline_us: float
    roofline_scale: tuple[float, float]
    exposed_us: Mapping[str, float]
    computations: tuple[ComputationTiming, ...]
    collectives: tuple[CollectiveTiming, ...]
    memory: Mapping[str, int]
    device: str
    hotspots: tuple[Hotspot, ...] = ()
    hlo_text: str = dataclasses.field(default="", repr=False)

    @property
    def exposed_total_us(self) -> float:
        return sum(self.exposed_us.values())

    @property
    def makespan_us(self) -> float:
        """The step by the scheduler's own timeline, a second reading of XLA's model.

        ``step_us`` is XLA's scheduler statistics: the final order replayed, each
        instruction's cost added and each async op's remaining latency waited for.
        The dumped timeline is the makespan the scheduler built its order on, from
        its dependency graph. They mostly differ by up to a third, either way, but
        not always: a 6.7B fp32 DDP step on 64 x H100 reads 200.8 ms in the
        statistics and 474.1 ms on the timeline, whose per-layer all-reduces run one
        after another. Read both before trusting a ratio.
        """
        return sum(c.span_us * c.runs for c in self.computations)

    def collective_bytes(self, kind: str | None = None) -> int:
        """Bytes moved per step (result bytes x runs), of one kind or all."""
        return sum(c.bytes * c.runs for c in self.collectives if kind in (None, c.kind))

    def summary(self) -> str:
        """A plain-text account: step, exposure by kind, memory, loops."""
        lines = [
            f"{self.device}: modeled step {self.step_us / 1e3:.3f} ms "
            f"({self.roofline_us / 1e3:.3f} ms of it by roofline, matmuls x"
            f"{self.roofline_scale[0]:.2f}, other kernels x{self.roofline_scale[1]:.2f}), "
            "exposed communication "
            f"{self.exposed_total_us / 1e3:.3f} ms ({self.exposed_total_us / self.step_us:.1%})",
        ]
        lines.append(f"  on the scheduler's timeline: {self.makespan_us / 1e3:.3f} ms")
        for kind, us in sorted(self.exposed_us.items()):
            lines.append(f"  exposed {kind}: {us / 1e3:.3f} ms")
        m = self.memory
        lines.append(
            f"  memory per device: args {m['arguments'] / 2**20:.1f} MiB, temps "
            f"{m['temps'] / 2**20:.1f} MiB, peak {m['peak'] / 2**20:.1f} MiB"
        )
        for c in self.computations:
            if c.runs > 1 or c.source == "roofline":
                lines.append(f"  {c.name}: {c.own_us / 1e3:.3f} ms x {c.runs} ({c.source})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def schedule_report(
    lowered: Any,
    *,
    options: Mapping[str, Any] | None = None,
    gpu: GpuSpec | str | None = None,
    dump_dir: str | None = None,
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

    Returns:
      A :class:`ScheduleReport`.

    Example:
      >>> report = jaxsync.schedule_report(step.lower(state, batch))
      >>> print(report.step_us, report.exposed_us)
    """
    return compile_scheduled(lowered, options=options, gpu=gpu, dump_dir=dump_dir)[1]


def compile_scheduled(
    lowered: Any,
    *,
    options: Mapping[str, Any] | None = None,
    gpu: GpuSpec | str | None = None,
    dump_dir: str | None = None,
) -> tuple[Any, ScheduleReport]:
    """:func:`schedule_report`, and the executable it modeled (to run it on real GPUs
    and set its measured step beside the model: ``benchmarks/bench_gpu_real.py``)."""
    if not hasattr(lowered, "compile"):
        raise TypeError(
            "schedule_report needs a `jax.stages.Lowered` (jax.jit(f).lower(...) or "
            f"TrainStep.lower(...)), got {type(lowered).__name__}."
        )
    opts = {**SCHEDULE_OPTIONS, **(options or {})}
    with tempfile.TemporaryDirectory() as tmp:
        where = dump_dir or tmp
        compiled = _compile(lowered, {**opts, "xla_dump_to": where})
        files = sorted(glob.glob(os.path.join(where, "*.schedule.txt")), key=os.path.getmtime)
        if not files:
            platform = getattr(getattr(compiled, "_executable", None), "platform", "?")
            raise RuntimeError(_NO_SCHEDULE.format(version=jax.__version__, platform=platform))
        with open(files[-1]) as f:
            text = f.read()
        spec = _gpu(gpu, where)
    report = read_schedule(text, compiled.memory_analysis(), spec)
    return compiled, dataclasses.replace(report, hlo_text=compiled.as_text())


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


# ----------------------------------------------------------------------- reading
def read_schedule(text: str, memory: Any, gpu: GpuSpec) -> ScheduleReport:
    """The report from a ``*.schedule.txt`` dump and ``compiled.memory_analysis()``."""
    proto = parse(text)
    module = proto.one("hlo_module")
    comps = {c.one("id"): c for c in module.all("computations")}
    by_name = {c.one("name"): c for c in comps.values()}
    insts = {i.one("id"): i for c in comps.values() for i in c.all("instructions")}
    scheds = {s.one("computation_id"): s for s in proto.all("computation_schedules")}
    entry = by_name[module.one("entry_computation_name")]
    runs: dict[int, int] = {}
    _count_runs(entry, 1, comps, insts, runs)
    timings, colls, skipped, hot = [], [], [], []
    step = 0.0
    exposed: dict[str, float] = {}
    busy_sum, roof_sum = [0.0, 0.0], [0.0, 0.0]  # per class: [matmuls, the rest]
    for cid, n in runs.items():
        comp, sched = comps[cid], scheds.get(cid)
        if sched is None:
            skipped.append((comp, n))
            continue
        stats = sched.one("scheduler_statistics", Message())
        per_us = float(sched.one("cycles_per_microsecond", 1))
        own = float(stats.one("total_cycles", 0.0)) / per_us
        waste = {
            k.removesuffix("_wasted_cycles").replace("_", "-"): float(v[-1]) * n
            for k, v in stats.items()
            if k.endswith("_wasted_cycles") and k != "total_wasted_cycles" and v[-1]
        }  # fmt: skip
        colls += _collectives(comp, sched, comps, insts, n)
        hot += _hotspots(comp, sched, insts, n)
        for cls, (busy, roof) in enumerate(compute_times(comp, sched, comps, insts, gpu)):
            busy_sum[cls] += busy
            roof_sum[cls] += roof
        step += own * n
        for k, v in waste.items():
            exposed[k] = exposed.get(k, 0.0) + v
        span = max((e.one("end_timestamp_cycles", 0.0) for e in sched.all("instructions")),
                   default=0.0) / per_us  # fmt: skip
        timings.append(ComputationTiming(comp.one("name"), n, own, "xla", waste, span))
    # Skipped computations: the roofline, scaled per kernel class (matmuls, the
    # rest) by what XLA's model charges over the roofline for the same class in
    # the scheduled ones (launch costs, efficiency); 1 where a class is unseen.
    scale = tuple(b / r if r > 0 else 1.0 for b, r in zip(busy_sum, roof_sum, strict=True))
    priced = 0.0
    for comp, n in skipped:
        own = 0.0
        for inst in comp.all("instructions"):
            flops = dot_flops(inst, comps, insts)
            own += scale[0 if flops else 1] * roofline(inst, comps, insts, gpu)
        priced += own * n
        timings.append(ComputationTiming(comp.one("name"), n, own, "roofline", {}, own))
    step += priced
    mem = {
        "arguments": memory.argument_size_in_bytes,
        "outputs": memory.output_size_in_bytes,
        "aliased": memory.alias_size_in_bytes,
        "temps": memory.temp_size_in_bytes,
    }
    mem["peak"] = mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temps"]
    return ScheduleReport(
        step_us=step, roofline_us=priced, roofline_scale=scale, exposed_us=exposed,
        computations=tuple(timings), collectives=tuple(colls), memory=mem, device=gpu.name,
        hotspots=tuple(sorted(hot, key=lambda h: -h.total_us)[:_HOTSPOTS]),
    )  # fmt: skip


def _count_runs(comp: Message, n: int, comps, insts, runs: dict[int, int]) -> None:
    """Runs per step of ``comp`` and of every loop body, branch or call below it.

    Fusions and async wrappers are priced inside their caller's instruction.
    A conditional's branches are all counted (the report then says "up to").
    """
    cid = comp.one("id")
    runs[cid] = runs.get(cid, 0) + n
    for inst in comp.all("instructions"):
        op = inst.one("opcode")
        called = inst.all("called_computation_ids")
        if op == "while":  # called: (body, condition)
            m = _TRIPS.search(inst.one("backend_config", "") or "")
            trips = int(m.group(1)) if m else 1
            _count_runs(comps[called[0]], n * trips, comps, insts, runs)
            for cond in called[1:]:
                _count_runs(comps[cond], n * (trips + 1), comps, insts, runs)
        elif op == "call":
            for c in called:
                _count_runs(comps[c], n, comps, insts, runs)
        elif op == "conditional":
            for c in called:  # every branch counted: an upper bound
                _count_runs(comps[c], n, comps, insts, runs)


def _hotspots(comp: Message, sched: Message, insts, n: int) -> list[Hotspot]:
    out = []
    for e in sched.all("instructions"):
        inst = insts[e.one("id")]
        if is_compute(inst.one("opcode")):
            us = e.one("end_timestamp_cycles", 0.0) - e.one("start_timestamp_cycles", 0.0)
            meta = inst.one("metadata", Message())
            out.append(Hotspot(inst.one("name"), inst.one("opcode"), comp.one("name"), us, n,
                               meta.one("op_name", "")))  # fmt: skip
    return out


def _collectives(comp: Message, sched: Message, comps, insts, n: int) -> list[CollectiveTiming]:
    """Every async collective of a scheduled computation, with what overlaps it."""
    order = [insts[e.one("id")] for e in sched.all("instructions")]
    times = [
        (e.one("start_timestamp_cycles", 0.0), e.one("end_timestamp_cycles", 0.0))
        for e in sched.all("instructions")
    ]
    out = []
    for k, inst in enumerate(order):
        op = inst.one("opcode")
        kind = _wrapped_kind(inst, comps) if op == "async-start" else op.removesuffix("-start")
        if kind not in _KINDS or not op.endswith("-start"):
            continue
        done = next(
            (j for j in range(k + 1, len(order))
             if order[j].one("opcode").endswith("-done")
             and inst.one("id") in order[j].all("operand_ids")),
            None,
        )  # fmt: skip
        if done is None:
            continue
        compute = [j for j in range(k + 1, done) if is_compute(order[j].one("opcode"))]
        config = (inst.one("backend_config", "") or "").replace(" ", "")
        out.append(CollectiveTiming(
            name=inst.one("name"), kind=kind, computation=comp.one("name"), runs=n,
            bytes=shape_bytes(order[done].one("shape")),
            modeled_us=times[done][1] - times[k][0],
            overlap_us=sum(times[j][1] - times[j][0] for j in compute),
            overlap_ops=len(compute),
            is_sync='"is_sync":true' in config,
        ))  # fmt: skip
    return out


def _wrapped_kind(inst: Message, comps) -> str:
    """The collective an ``async-start`` wraps (its called computation holds it)."""
    for c in inst.all("called_computation_ids"):
        for i in comps[c].all("instructions"):
            if i.one("opcode") in _KINDS:
                return i.one("opcode")
    return ""

"""Reading XLA's latency-hiding schedule dump into a :class:`~jaxsync.ScheduleReport`.

Loop bodies are priced once per iteration (nested trip counts multiplied), a
``conditional`` at its dearest branch, and computations the scheduler skipped at
the roofline of the target GPU (:mod:`roofline`).
"""

from __future__ import annotations

import re
from typing import Any

from .roofline import compute_times, dot_flops, is_compute, roofline, shape_bytes
from .target import GpuSpec
from .textproto import Message, parse
from .timings import CollectiveTiming, ComputationTiming, Hotspot, ScheduleReport

_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HOTSPOTS = 25
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
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

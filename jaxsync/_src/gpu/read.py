"""Reading XLA's latency-hiding schedule dump into a :class:`~jaxsync.ScheduleReport`.

Loop bodies are priced once per iteration (nested trip counts multiplied), a
``conditional`` at its dearest branch. Computations the scheduler skipped are
priced from the pricing twin's dump (:mod:`twin`), where XLA scheduled the same
kernels; what the twin does not hold falls back to the roofline of the target GPU
(:mod:`roofline`), and the report says how much.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .repricing import lift_to_callers, walk
from .roofline import compute_times, dot_flops, is_compute, roofline, shape_bytes
from .target import GpuSpec
from .textproto import Message, parse
from .timings import AsyncTiming, CollectiveTiming, ComputationTiming, Hotspot, ScheduleReport
from .twin import PROBE

_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HOTSPOTS = 25
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


# ----------------------------------------------------------------------- reading
def read_schedule(
    text: str,
    memory: Any,
    gpu: GpuSpec,
    twin_text: str | None = None,
    kernel_times: Mapping[str, float] | None = None,
) -> ScheduleReport:
    """The report from a ``*.schedule.txt`` dump and ``compiled.memory_analysis()``.

    ``twin_text``: the dump of the program's pricing twin (:mod:`twin`); it prices
    the computations the scheduler skipped here. Without it, or for a kernel the
    twin does not hold, the scaled roofline does. ``kernel_times``: measured
    microseconds per run by instruction name, for the repriced reading
    (:mod:`repricing`).
    """
    prog = _Program(text)
    twin = _Twin(_Program(twin_text)) if twin_text else None
    table = lift_to_callers(dict(kernel_times or {}), prog.comps, prog.runs)
    timings, colls, skipped, hot, asyncs = [], [], [], [], []

    def repriced(comp: Message, sched: Message, n: int, skip=lambda _: False, where=prog):
        walked, measured, ops = walk(sched, where.insts, where.comps, gpu.memory_bandwidth, table,
                                     skip)  # fmt: skip
        asyncs.extend(AsyncTiming(start.one("name"), comp.one("name"), n, nbytes, xla, us)
                      for start, nbytes, xla, us in ops)  # fmt: skip
        return walked, measured

    step = 0.0
    exposed: dict[str, float] = {}
    busy_sum, roof_sum = [0.0, 0.0], [0.0, 0.0]  # per class: [matmuls, the rest]
    for cid, n in prog.runs.items():
        comp, sched = prog.comps[cid], prog.scheds.get(cid)
        if sched is None:
            skipped.append((comp, n))
            continue
        if any(is_probe(prog.insts[e.one("id")]) for e in sched.all("instructions")):
            # The twin read alone (XLA scheduled nothing of the program itself): its
            # computations hold no collective of the program's, only the probe's.
            _, price, gaps = probe_free(sched, prog)
            own = sum(price.values())
            step += own * n
            hot += [h for h in _hotspots(comp, sched, prog.insts, n) if PROBE not in h.op_name]
            walked, measured = repriced(comp, sched, n, is_probe)
            timings.append(ComputationTiming(comp.one("name"), n, own, "xla", {}, own + gaps, own,
                                             walked, measured))  # fmt: skip
            continue
        stats = sched.one("scheduler_statistics", Message())
        per_us = float(sched.one("cycles_per_microsecond", 1))
        own = float(stats.one("total_cycles", 0.0)) / per_us
        waste = {
            k.removesuffix("_wasted_cycles").replace("_", "-"): float(v[-1]) * n
            for k, v in stats.items()
            if k.endswith("_wasted_cycles") and k != "total_wasted_cycles" and v[-1]
        }  # fmt: skip
        colls += _collectives(comp, sched, prog.comps, prog.insts, n)
        hot += _hotspots(comp, sched, prog.insts, n)
        for cls, (busy, roof) in enumerate(compute_times(comp, sched, prog.comps, prog.insts, gpu)):
            busy_sum[cls] += busy
            roof_sum[cls] += roof
        step += own * n
        for k, v in waste.items():
            exposed[k] = exposed.get(k, 0.0) + v
        walked, measured = repriced(comp, sched, n)
        timings.append(ComputationTiming(comp.one("name"), n, own, "xla", waste, _span(sched),
                                         _walk(sched, prog.insts), walked, measured))  # fmt: skip
    # Skipped computations: the twin's price where it holds the same kernels; else
    # the roofline, scaled per kernel class (matmuls, the rest) by what XLA's model
    # charges over the roofline for the same class in the scheduled ones (launch
    # costs, efficiency); 1 where a class is unseen.
    scale = tuple(b / r if r > 0 else 1.0 for b, r in zip(busy_sum, roof_sum, strict=True))
    by_roofline = 0.0
    for comp, n in skipped:
        own, span, rest = twin.price(comp, prog) if twin else (0.0, 0.0, comp.all("instructions"))
        if twin and not rest:
            hot += twin.hotspots(comp, prog, n)
        roof = sum(
            scale[0 if dot_flops(i, prog.comps, prog.insts) else 1]
            * roofline(i, prog.comps, prog.insts, gpu)
            for i in rest
        )  # fmt: skip
        by_roofline += roof * n
        source = "roofline" if roof and not own else ("xla+roofline" if roof else "xla")
        step += (own + roof) * n
        # Where the twin's copy of it holds a non-collective async op (XLA scheduled
        # it there only), walk that copy; else its walk is its kernels' sum, each
        # kernel the table names at its measured time.
        found = twin.matched(comp) if twin and not rest else None
        before = len(asyncs)
        walked, measured = repriced(comp, found, n, is_probe, twin.prog) if found else (0.0, 0.0)
        if len(asyncs) == before:
            swap = [(table[i.one("name")], twin.kernel.get(_kernel_key(i)) if twin else None, i)
                    for i in comp.all("instructions") if i.one("name") in table
                    and is_compute(i.one("opcode"))]  # fmt: skip
            measured = sum(us for us, _, _ in swap)
            walked = own + roof + sum(us - (was if was is not None else scale[
                0 if dot_flops(i, prog.comps, prog.insts) else 1] * roofline(
                    i, prog.comps, prog.insts, gpu)) for us, was, i in swap)  # fmt: skip
        timings.append(ComputationTiming(comp.one("name"), n, own + roof, source, {},
                                         span + roof, own + roof, walked, measured))  # fmt: skip
    mem = {
        "arguments": memory.argument_size_in_bytes,
        "outputs": memory.output_size_in_bytes,
        "aliased": memory.alias_size_in_bytes,
        "temps": memory.temp_size_in_bytes,
    }
    mem["peak"] = mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temps"]
    return ScheduleReport(
        step_us=step, roofline_us=by_roofline, roofline_scale=scale, exposed_us=exposed,
        computations=tuple(timings), collectives=tuple(colls), memory=mem, device=gpu.name,
        hotspots=tuple(sorted(hot, key=lambda h: -h.total_us)[:_HOTSPOTS]),
        async_ops=tuple(asyncs), bandwidth=gpu.memory_bandwidth, kernel_table=len(table),
    )  # fmt: skip


def skipped_computations(text: str) -> int:
    """How many computations of a dump run in the step without a schedule."""
    prog = _Program(text)
    return sum(cid not in prog.scheds for cid in prog.runs)


class _Program:
    """A parsed schedule dump: computations, instructions, schedules, runs per step."""

    def __init__(self, text: str):
        proto = parse(text)
        module = proto.one("hlo_module")
        self.comps = {c.one("id"): c for c in module.all("computations")}
        by_name = {c.one("name"): c for c in self.comps.values()}
        self.insts = {i.one("id"): i for c in self.comps.values() for i in c.all("instructions")}
        self.scheds = {s.one("computation_id"): s for s in proto.all("computation_schedules")}
        self.runs: dict[int, int] = {}
        entry = by_name[module.one("entry_computation_name")]
        _count_runs(entry, 1, self.comps, self.insts, self.runs)


class _Twin:
    """Prices from the pricing twin's schedule, its probe's own instructions left out.

    A skipped computation takes the price of the twin computation holding the same
    kernels (compared by opcode, shape and ``op_name``; kernels the twin adds, such
    as a copy of the loop counter, are not charged); failing that, each kernel the
    price of the same kernel anywhere in the twin.
    """

    def __init__(self, prog: _Program):
        self.prog = prog
        self.comps: list[tuple[Counter, dict, float, Message, Message]] = []
        self.kernel: dict[tuple, float] = {}
        for cid, sched in prog.scheds.items():
            kernels, price, gaps = probe_free(sched, prog)
            for key, us in price.items():
                self.kernel.setdefault(key, us / kernels[key])
            self.comps.append((kernels, price, gaps, prog.comps[cid], sched))

    def _match(self, comp: Message):
        want = Counter(_kernel_key(i) for i in comp.all("instructions")
                       if is_compute(i.one("opcode")))  # fmt: skip
        fits = [c for c in self.comps if not want - c[0]]
        return (
            (min(fits, key=lambda c: sum((c[0] - want).values())), want) if fits else (None, want)
        )

    def price(self, comp: Message, prog: _Program) -> tuple[float, float, list[Message]]:
        """(XLA-priced time, its timeline span, the kernels the twin does not hold)."""
        found, want = self._match(comp)
        if found is not None:
            kernels, price, gaps, _, _ = found
            own = sum(price[k] / kernels[k] * n for k, n in want.items())
            return own, own + gaps, []
        own, rest = 0.0, []
        for inst in comp.all("instructions"):
            if not is_compute(inst.one("opcode")):
                continue
            us = self.kernel.get(_kernel_key(inst))
            if us is None:
                rest.append(inst)
            else:
                own += us
        return own, own, rest

    def matched(self, comp: Message) -> Message | None:
        """The schedule of the twin computation holding ``comp``'s kernels, if any."""
        found, _ = self._match(comp)
        return found[4] if found is not None else None

    def hotspots(self, comp: Message, prog: _Program, n: int) -> list[Hotspot]:
        found, want = self._match(comp)
        if found is None:
            return []
        return [h for h in _hotspots(found[3], found[4], self.prog.insts, n)
                if PROBE not in h.op_name]  # fmt: skip


def probe_free(sched: Message, prog: _Program) -> tuple[Counter, dict[tuple, float], float]:
    """A twin computation's own kernels (counted by key), their summed price, and the
    timeline's gaps between its own instructions; the probe's instructions and the
    time they sit in those gaps are left out."""
    per_us = float(sched.one("cycles_per_microsecond", 1))
    times = [
        (e.one("start_timestamp_cycles", 0.0) / per_us, e.one("end_timestamp_cycles", 0.0) / per_us,
         prog.insts[e.one("id")])
        for e in sched.all("instructions")
    ]  # fmt: skip
    own = [(a, b) for a, b, i in times if not is_probe(i)]
    first, last = min(a for a, _ in own), max(b for _, b in own)
    gaps = (
        last
        - first
        - sum(b - a for a, b in own)
        - sum(b - a for a, b, i in times if is_probe(i) and first <= a and b <= last)
    )
    kernels: Counter = Counter()
    price: dict[tuple, float] = {}
    for a, b, inst in times:
        if is_probe(inst) or not is_compute(inst.one("opcode")):
            continue
        key = _kernel_key(inst)
        kernels[key] += 1
        price[key] = price.get(key, 0.0) + b - a
    return kernels, price, max(gaps, 0.0)


def is_probe(inst: Message) -> bool:
    """An instruction of the pricing twin's probe (not of the program)."""
    return PROBE in inst.one("metadata", Message()).one("op_name", "")


def _kernel_key(inst: Message) -> tuple:
    meta = inst.one("metadata", Message())
    return (inst.one("opcode"), _shape_key(inst.one("shape")), meta.one("op_name", ""))


def _shape_key(shape: Message | None) -> tuple:
    if shape is None:
        return ()
    subs = shape.all("tuple_shapes")
    if subs:
        return tuple(_shape_key(s) for s in subs)
    return (shape.one("element_type"), tuple(shape.all("dimensions")))


def _span(sched: Message) -> float:
    per_us = float(sched.one("cycles_per_microsecond", 1))
    ends = (e.one("end_timestamp_cycles", 0.0) for e in sched.all("instructions"))
    return max(ends, default=0.0) / per_us


def _walk(sched: Message, insts) -> float:
    """XLA's statistics rule replayed on the dumped (scheduled) order, in microseconds.

    XLA's ``LatencyHidingStatistics`` walks an order adding each instruction's cost
    and, at an async done, what is left of the start-to-done latency; it walks the
    order from before the scheduler moved the collectives, so ``total_cycles`` does
    not read the dumped schedule. This walk does. The dump holds no latency, so each
    pair's span on the timeline (the start's end to the done's end) stands for it.
    The scheduler's latency edge makes the span at least the latency: where the
    scheduler waited on it, the span is the latency (0.1 us over the statistics' own
    on a reduce-scatter alone, ``tests/test_readings.py``); where compute fills the
    span, the wait is nil for either. Only a span stretched by something else and
    not filled would read high.
    """
    per_us = float(sched.one("cycles_per_microsecond", 1))
    now, at = 0.0, {}  # instruction id -> (walk time after it, its timeline end)
    for e in sched.all("instructions"):
        inst, end = insts[e.one("id")], e.one("end_timestamp_cycles", 0.0)
        now += end - e.one("start_timestamp_cycles", 0.0)
        operands = inst.all("operand_ids")
        if inst.one("opcode").endswith("-done") and operands and operands[0] in at:
            t, start_end = at[operands[0]]
            now += max(0.0, (end - start_end) - (now - t))
        at[inst.one("id")] = (now, end)
    return now / per_us


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

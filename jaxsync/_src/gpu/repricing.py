"""Repricing XLA's schedule: asynchronous copies at their bytes, kernels at measured times.

XLA's GPU cost model has no rule for an asynchronous op that is not a collective
(a dynamic slice run on another stream, such as reading one layer's saved
activations out of an ``[L, ...]`` stack): its latency estimator falls back to a
flat 5000 cycles, 5 ms on the H100 target, where the copy takes tens of
microseconds. On the one-GPU 0.94B GPT that charge was 240 of the 322 ms XLA
modeled (docs/gpu.md). Here such an op is priced at the bytes it moves, read plus
written, over the target GPU's memory bandwidth, the rate XLA's cost model
itself gives memory-bound kernels of the same target; the step is then walked
again on the scheduled order (:func:`walk`), each done waiting for what is left
of its op's time since its start, so the compute the schedule put between them
still hides it.

A table of measured kernel times (``{instruction name: microseconds per run}``,
or the text of an XLA profile, ``costs { name: ... cost_us: ... }``, the format
of its profile-guided latency estimator) replaces the modeled duration of every
kernel it names in the same walk.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from .roofline import is_compute, shape_bytes
from .textproto import Message, parse

COLLECTIVES = frozenset({
    "all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute",
    "collective-broadcast", "ragged-all-to-all", "send", "recv",
})  # fmt: skip
_SLICES = frozenset({"dynamic-slice", "slice"})
_HOST = 5  # XLA's memory space of pinned host memory in a layout
_BAD_TABLE = (
    "`kernel_times` must map HLO instruction names (str) to measured microseconds per "
    "run (a number >= 0), or be the path of an XLA profile in text form "
    '(`costs {{ name: "fusion.3" cost_us: 41.5 }}`); got {got}.'
)


def wrapped(start: Message, comps: Mapping[int, Message]) -> list[Message]:
    """The instructions an async start runs (through nested calls)."""
    out, todo = [], list(start.all("called_computation_ids"))
    while todo:
        for inst in comps[todo.pop()].all("instructions"):
            if inst.one("opcode") in ("call", "async-start"):
                todo += inst.all("called_computation_ids")
            out.append(inst)
    return out


def is_collective(start: Message, comps: Mapping[int, Message]) -> bool:
    """Whether an async start is a collective's (a ``*-start`` of one, or an
    ``async-start`` wrapping one)."""
    op = start.one("opcode")
    if op != "async-start":
        return op.removesuffix("-start") in COLLECTIVES
    return any(i.one("opcode").removesuffix("-start") in COLLECTIVES for i in wrapped(start, comps))


def on_host(start: Message, done: Message, insts: Mapping[int, Message]) -> bool:
    """Whether the op moves data to or from host memory (not HBM's bandwidth: left
    as XLA priced it)."""
    shapes = [done.one("shape")] + [insts[o].one("shape") for o in start.all("operand_ids")
                                    if o in insts]  # fmt: skip
    return any(_memory_space(s) == _HOST for s in shapes)


def _memory_space(shape: Message | None) -> int:
    if shape is None:
        return 0
    subs = shape.all("tuple_shapes")
    if subs:
        return max((_memory_space(s) for s in subs), default=0)
    return int(shape.one("layout", Message()).one("memory_space", 0) or 0)


def async_bytes(start: Message, done: Message, comps, insts) -> int:
    """Bytes an asynchronous non-collective op reads and writes in HBM.

    Each kernel it runs counts its result written and its operands read, a slice
    at the part it takes (``dynamic-slice``, ``slice``, or a fusion whose every use
    of an operand slices it) and an in-place ``dynamic-update-slice`` at its
    update, read and written; an op running no kernel (a copy) reads and writes
    its result.
    """
    kernels = [i for i in wrapped(start, comps) if _kernel(i)]
    if not kernels:
        return 2 * shape_bytes(done.one("shape"))
    return sum(_kernel_bytes(k, comps, insts) for k in kernels)


def _kernel(inst: Message) -> bool:
    return is_compute(inst.one("opcode"))


def _kernel_bytes(inst: Message, comps, insts) -> int:
    op = inst.one("opcode")
    out = shape_bytes(inst.one("shape"))
    operands = [insts[o] for o in inst.all("operand_ids") if o in insts]
    if op in _SLICES:
        return 2 * out
    if op == "dynamic-update-slice" and len(operands) > 1:
        return 2 * shape_bytes(operands[1].one("shape"))
    reads = [shape_bytes(o.one("shape")) for o in operands]
    if op == "fusion":
        body = [i for c in inst.all("called_computation_ids") for i in comps[c].all("instructions")]
        users: dict[int, list[Message]] = {}
        for i in body:
            for o in i.all("operand_ids"):
                users.setdefault(o, []).append(i)
        params = {int(i.one("parameter_number", 0)): i for i in body
                  if i.one("opcode") == "parameter"}  # fmt: skip
        for k, p in params.items():
            uses = users.get(p.one("id"), [])
            if (
                k < len(reads)
                and uses
                and all(
                    u.one("opcode") in _SLICES and u.all("operand_ids")[0] == p.one("id")
                    for u in uses
                )
            ):
                reads[k] = min(reads[k], sum(shape_bytes(u.one("shape")) for u in uses))
            elif (
                k < len(reads)
                and uses
                and all(
                    u.one("opcode") == "dynamic-update-slice"
                    and u.all("operand_ids")[0] == p.one("id")
                    for u in uses
                )
            ):  # updated in place: none of it read, only the updates written
                reads[k] = 0
                for u in uses:
                    update = insts.get(u.all("operand_ids")[1])
                    out -= shape_bytes(u.one("shape")) - shape_bytes(
                        update.one("shape") if update is not None else None
                    )
    return sum(reads) + max(out, 0)


# ---------------------------------------------------------------- kernel times
def kernel_table(kernel_times: Any) -> dict[str, float]:
    """``kernel_times`` as ``{instruction name: microseconds}``: a mapping as given,
    or an XLA profile's text (a path, or the text itself). A profile's
    ``fingerprint::name`` keeps the name."""
    if kernel_times is None:
        return {}
    if isinstance(kernel_times, str | os.PathLike):
        text = os.fspath(kernel_times)
        if os.path.isfile(text):
            with open(text) as f:
                text = f.read()
        try:
            costs = parse(text).all("costs")
        except Exception:  # noqa: BLE001  (the message below says what is wanted)
            costs = None
        if not costs:
            raise ValueError(_BAD_TABLE.format(got=f"{os.fspath(kernel_times)[:80]!r}"))
        kernel_times = {c.one("name", ""): float(c.one("cost_us", 0.0)) for c in costs}
    if not isinstance(kernel_times, Mapping):
        raise TypeError(_BAD_TABLE.format(got=type(kernel_times).__name__))
    table = {}
    for name, us in kernel_times.items():
        ok = isinstance(us, int | float) and not isinstance(us, bool)
        if not isinstance(name, str) or not ok or not math.isfinite(us) or us < 0:
            raise ValueError(_BAD_TABLE.format(got=f"{name!r}: {us!r}"))
        table[name.rsplit("::", 1)[-1]] = float(us)
    return table


def profile_text(table: Mapping[str, float]) -> str:
    """``table`` as an XLA profile's text (what its profile-guided latency estimator reads)."""
    return "".join(
        f"costs {{ name: {json.dumps(name)} cost_us: {us!r} }}\n" for name, us in table.items()
    )


# ------------------------------------------------------------------------ walk
def lift_to_callers(
    table: Mapping[str, float], comps: Mapping[int, Message], runs: Mapping[int, int]
) -> dict[str, float]:
    """``table`` with each time the profile gave an instruction inside a called
    computation (a fusion's, an async op's) charged to the instruction that runs it in
    one of the computations ``runs`` names (those the step runs).

    A profile names a kernel by the HLO instruction that launched it. Where XLA
    wraps a kernel in a computation of its own (on JAX 0.11 a cuBLAS matmul reading
    a layer out of a stacked param sits inside a ``dynamic-slice-fusion``; an
    asynchronous copy inside its ``async_computation``) that instruction is not in
    any schedule: on the 1.1B Llama-style step on one H200 the walk missed 38-57 ms
    of a 215-219 ms step so. The times of what one instruction runs are summed, per run.
    """
    lift = _lifter(comps, runs)
    out: dict[str, float] = {}
    for name, us in table.items():
        at = lift(name)
        out[at] = out.get(at, 0.0) + us
    return out


def unwalked(
    per_step: Mapping[str, float],
    per_run: Mapping[str, float],
    comps: Mapping[int, Message],
    runs: Mapping[int, int],
) -> dict[str, float]:
    """Per profiled op, the microseconds per step its profile holds beyond what a walk
    of the step charges it (its time per run, lifted to the instruction the step runs,
    times that instruction's runs): where a calibrated model and the profile part.
    ``per_step``: the profile's total per step; ``per_run``: the table the walk reads."""
    lift = _lifter(comps, runs)
    count: dict[str, int] = {}
    for cid, n in runs.items():
        for inst in comps[cid].all("instructions"):
            count[inst.one("name")] = count.get(inst.one("name"), 0) + n
    return {op: us - per_run.get(op, 0.0) * count.get(lift(op), 0) for op, us in per_step.items()}


def _lifter(comps: Mapping[int, Message], runs: Mapping[int, int]) -> Callable[[str], str]:
    """Maps an instruction's name to that of the instruction the step runs for it: its
    own where a computation the step runs holds it, else its caller's (transitively)."""
    walked = {i.one("name") for cid in runs for i in comps[cid].all("instructions")}
    home = {i.one("name"): c.one("id") for c in comps.values() for i in c.all("instructions")}
    caller = {cid: i.one("name") for c in comps.values() for i in c.all("instructions")
              for cid in i.all("called_computation_ids")}  # fmt: skip

    def lift(name: str) -> str:
        seen = set()
        while name not in walked and home.get(name) in caller and name not in seen:
            seen.add(name)
            name = caller[home[name]]
        return name

    return lift


def walk(
    sched: Message,
    insts: Mapping[int, Message],
    comps: Mapping[int, Message],
    bandwidth: float,
    table: Mapping[str, float],
    skip: Callable[[Message], bool] = lambda _: False,
) -> tuple[float, float, list[tuple[Message, int, float, float]]]:
    """One computation walked on its scheduled order, repriced; in microseconds.

    Each instruction takes its modeled duration, or the measured one where
    ``table`` names it; at each async done the walk waits for what is left of its
    op's time since its start. A collective's time is its start-to-done span on
    XLA's timeline, as in :attr:`ScheduleReport.walk_us`: XLA's scheduler works from
    the end of a computation back and places a start once its latency is covered
    unless other work is ready, so time left idle inside a collective's span is time
    its latency still needed, even where a repriced op's span holds it too
    (``tests/test_async_pricing.py``). A non-collective op's time (in device
    memory) is its bytes over ``bandwidth``. ``skip``: instructions left out (the
    pricing twin's probe).

    Returns ``(walked, measured, repriced)``: the walk, the part of it priced from
    ``table``, and per repriced op ``(start, bytes, XLA's span, repriced time)``.
    """
    per_us = float(sched.one("cycles_per_microsecond", 1))
    rows = [
        (insts[e.one("id")], e.one("start_timestamp_cycles", 0.0) / per_us,
         e.one("end_timestamp_cycles", 0.0) / per_us)
        for e in sched.all("instructions")
    ]  # fmt: skip
    rows = [r for r in rows if not skip(r[0])]
    where = {inst.one("id"): k for k, (inst, _, _) in enumerate(rows)}
    pairs = {}  # done's row -> (its start's row, XLA's span, the start, a collective's?)
    for k, (inst, _, end) in enumerate(rows):
        ops = inst.all("operand_ids")
        if inst.one("opcode").endswith("-done") and ops and ops[0] in where:
            start, _, start_end = rows[where[ops[0]]]
            pairs[k] = (where[ops[0]], start_end, end, is_collective(start, comps))
    need, repriced = {}, []  # done's row -> the op's time from its start's end
    for k, (s, start_end, end, coll) in pairs.items():
        start, done = rows[s][0], rows[k][0]
        if not coll and not on_host(start, done, insts):
            nbytes = async_bytes(start, done, comps, insts)
            price = table.get(start.one("name"), nbytes / bandwidth * 1e6)
            repriced.append((start, nbytes, end - start_end, price))
            need[k] = price + rows[k][2] - rows[k][1]  # and the done's own duration
        else:
            need[k] = end - start_end
    now, measured, at = 0.0, 0.0, {}
    for k, (inst, a, b) in enumerate(rows):
        us = table.get(inst.one("name")) if _kernel(inst) else None
        measured += us or 0.0
        now += b - a if us is None else us
        if k in need:
            now = max(now, at[pairs[k][0]] + need[k])
        at[k] = now
    return now, measured, repriced

"""What is live at a program's memory peak: each buffer, its shape and what made it.

``compiled.memory_analysis()`` gives four totals (arguments, outputs, aliased,
temporaries); when a step does not fit, or holds more than its GSPMD counterpart,
the question is *which* buffers. XLA answers it in its own dumps: buffer assignment
writes the byte range each value got in the temporary allocation
(``*-buffer-assignment.txt``) and the live range of every value over the scheduled
program (``*-live-range.txt``). :func:`memory_report` compiles with those dumps on,
finds the moment the packed temporaries cover the most bytes (what sizes the
allocation), and names each buffer live then by its shape and the jax operation
that made it (the ``op_name`` XLA keeps from the jaxpr:
``jit(step)/shard_map/transpose(jvp())/while/body/...``), beside the arguments by
their paths (``state.opt_state.master[1]``). XLA's own "peak" section of the
live-range dump counts values without their packing, and on a 64-GPU FSDP step it
read 4.8 GB where 7.6 GB were allocated; this one reads 7.5.

Exact for the compiled program on any backend XLA dumps for (GPU, including the
compile-only targets of :func:`jaxsync.gpu_topology`, and CPU): these are XLA's
own figures, not a model.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any, NamedTuple

_RANGE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+),(?: page \d+,)? (.*)$")  # page: XLA 0.12+
_PARAMETER = re.compile(r"parameter (\d+), shape \|([^|]*)\|")
_NOT_TEMP = re.compile(r"parameter|constant|thread-local|output shape")
_STEP = re.compile(r"^\s+(\d+):(\S+)$", re.M)
# A loop's carried values are written `<id while.3{2} (phi) @0>`: the buffer of a stack
# a forward loop writes and a backward loop reads is live through them.
_VALUE = re.compile(
    r"^\s*value: <\d+ (\S+?)(\{[\d,]*\})?( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)"
)
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')

_NO_DUMP = (
    "memory_report: XLA wrote no live-range dump for this program (jaxlib {version}); "
    "it needs an XLA that writes `*-live-range.txt` under `xla_dump_to`."
)


class PeakBuffer(NamedTuple):
    """One buffer live at the peak.

    Attributes:
      name: XLA's value (instruction and tuple index), e.g. ``fusion.12{0}``.
      shape: its shape and dtype, e.g. ``bf16[22,2048,5632]``.
      bytes: its size.
      made_by: the jax operation that made it (XLA's ``op_name``), or the
        argument's path for an argument.
      argument: whether it is one of the program's arguments (parameters).
      live_from, live_to: for a temporary, the operations (``op_name``, else XLA's
        instruction) where its live range begins and ends: why it is still held.
        A buffer made in the forward (``jvp()/...``) and last read in the backward
        (``transpose(jvp())/...``) is held across everything between; empty for
        an argument.
    """

    name: str
    shape: str
    bytes: int
    made_by: str
    argument: bool
    live_from: str = ""
    live_to: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """A compiled program's memory, and what is live at its peak.

    Attributes:
      arguments, outputs, aliased, temps: bytes, as ``memory_analysis()`` gives them
        (``aliased``: outputs written into donated arguments).
      peak: bytes live at the peak: the temporaries then live (at the offsets
        XLA packed them into, overlaps counted once) plus the arguments;
        ``arguments + temps`` can be a little above it (gaps in the packing).
      peak_at: the instruction at the peak.
      buffers: every buffer live at the peak, largest first.
    """

    arguments: int
    outputs: int
    aliased: int
    temps: int
    peak: int
    peak_at: str
    buffers: tuple[PeakBuffer, ...]

    @property
    def total(self) -> int:
        """Arguments plus temporaries: what the program holds per device at once."""
        return self.arguments + self.temps

    def by_origin(self, depth: int | None = None) -> dict[str, int]:
        """Bytes live at the peak grouped by what made them, largest first; ``depth``
        keeps that many trailing parts of each ``op_name`` (None: all of it)."""
        out: dict[str, int] = {}
        for b in self.buffers:
            key = b.made_by if depth is None else "/".join(b.made_by.split("/")[-depth:])
            out[key] = out.get(key, 0) + b.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def table(self, top: int = 15, ranges: bool = False) -> str:
        """The ``top`` largest buffers live at the peak, one line each; ``ranges``:
        under each temporary, the operations its live range runs from and to."""
        mib = 2**20
        lines = [
            f"arguments {self.arguments / mib:.0f} MiB + temporaries {self.temps / mib:.0f} MiB "
            f"= {self.total / mib:.0f} MiB; live at the peak ({self.peak_at}): "
            f"{self.peak / mib:.0f} MiB",
        ]
        for b in self.buffers[:top]:
            kind = "arg " if b.argument else "temp"
            lines.append(f"  {b.bytes / mib:9.1f} MiB  {kind}  {b.shape:28s}  {b.made_by}")
            if ranges and not b.argument:
                lines.append(f"  {'':>9}      live from {b.live_from}")
                lines.append(f"  {'':>9}             to {b.live_to}")
        rest = self.buffers[top:]
        if rest:
            lines.append(f"  {sum(b.bytes for b in rest) / mib:9.1f} MiB  in {len(rest)} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def memory_report(lowered: Any, *, options: Mapping[str, Any] | None = None) -> MemoryReport:
    """Compiles ``lowered`` with XLA's buffer dumps on and names what is live at the peak.

    Args:
      lowered: a ``jax.stages.Lowered`` (``jax.jit(f).lower(...)``,
        :meth:`jaxsync.TrainStep.lower`), for any backend: a GPU mesh from
        :func:`jaxsync.gpu_topology` gives the H100's exact figures without a GPU.
      options: extra XLA compile options (the program is compiled with them, so
        the report is of that program). By default matmuls go to cuBLAS, as in
        :func:`jaxsync.schedule_report`: without a GPU, XLA's Triton gemm fusions get
        placeholder tiles, and their buffers are not the ones a GPU would hold (the
        quick Llama ZeRO step on 2 x H100: 119 MiB of temporaries with them, 101
        without); so the report explains the memory ``schedule_report`` and
        ``bench_gpu`` give. Pass ``{"xla_gpu_enable_triton_gemm": True}`` for the
        other program.

    Returns:
      A :class:`MemoryReport`; ``print(report)`` shows the largest buffers.

    Example:
      >>> report = jaxsync.memory_report(step.lower(state, batch))
      >>> print(report.table(10))
      >>> report.by_origin(depth=2)
    """
    from .schedule import CUBLAS_GEMMS, _compile  # the same fresh compile as the schedule

    if not hasattr(lowered, "compile"):
        raise TypeError(
            "memory_report needs a `jax.stages.Lowered` (jax.jit(f).lower(...) or "
            f"TrainStep.lower(...)), got {type(lowered).__name__}."
        )
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            f"memory_report: `options` must be a mapping of XLA option names to values, "
            f"got {type(options).__name__}."
        )
    with tempfile.TemporaryDirectory() as where:
        opts = {**CUBLAS_GEMMS, **(options or {}), "xla_dump_to": where}
        compiled = _compile(lowered, opts)
        live = _newest(where, "*after_optimizations-live-range.txt")
        if live is None:
            import jax

            raise RuntimeError(_NO_DUMP.format(version=jax.__version__))
        stem = live[: -len("-live-range.txt")]
        texts = [_read(live), _read(stem + "-buffer-assignment.txt"), _read(stem + ".txt")]
    return read_memory(*texts, compiled.memory_analysis())


def read_memory(live: str, assignment: str, hlo: str, stats: Any) -> MemoryReport:
    """A :class:`MemoryReport` from XLA's dumps of one program: its live ranges, its
    buffer assignment, its optimized HLO text and its ``memory_analysis()``.

    The peak is where the temporaries, at the offsets buffer assignment packed them
    into, cover the most bytes at once (what sets the size of the temporary
    allocation, gaps aside); the arguments are live throughout and listed with it.
    """
    ranges = {n: (int(a), int(b)) for n, a, b in _RANGE.findall(live.split("BufferLiveRange")[-1])}
    steps = dict((int(i), name) for i, name in _STEP.findall(live.split("BufferLiveRange")[0]))
    instrs = {name: rest for name, rest in _INSTR.findall(hlo)}
    temps, args, shapes, phis = _values(assignment)
    timed = [(v, ranges[v[0]]) for v in temps if v[0] in ranges]
    if not timed and not args:
        raise ValueError("memory_report: the buffer-assignment dump names no buffers.")
    at, best = 0, -1
    for t in sorted({a for _, (a, _) in timed}):  # the union only grows where one starts
        covered = _covered(sorted((off, off + size) for (_, size, off), (a, b) in timed
                                  if a <= t <= b))  # fmt: skip
        if covered > best:
            at, best = t, covered
    # One entry per buffer: the values live now at one offset are one buffer passed on
    # (a stack written by a loop, then carried by it).
    held: dict[tuple[int, int], tuple[str, int, int]] = {}
    for v, (a, b) in timed:
        if a <= at <= b:
            held.setdefault((v[2], v[1]), v)
    live_now = list(held.values())

    def made_by(name: str) -> str:
        op = _OP_NAME.search(instrs.get(name.split("{")[0], ""))
        return op.group(1) if op else name

    def buffer(name: str, size: int, offset: int) -> PeakBuffer:
        here = [(*ranges[v[0]], v[0] in phis, v[0]) for v, _ in timed if v[1:] == (size, offset)]
        chain = _chain((*ranges[name], name in phis, name), here)
        ends = [
            made_by(steps[t]) if t in steps else str(t)
            for t in (chain[0][0], max(c[1] for c in chain))
        ]
        # named by the last value written into the buffer (a loop's phi names no operation)
        writers = [c for c in chain if not c[2] and c[0] <= at]
        name = writers[-1][3] if writers else name
        return PeakBuffer(name, shapes.get(name, "").split("{")[0], size, made_by(name),
                          False, *ends)  # fmt: skip

    buffers = [buffer(*v) for v in live_now]
    params = _entry_parameters(hlo)
    buffers += [
        PeakBuffer(f"parameter({i})", shape, size, params.get(i, f"parameter({i})"), True)
        for i, size, shape in args
    ]
    buffers.sort(key=lambda b: -b.bytes)
    return MemoryReport(
        arguments=stats.argument_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        aliased=stats.alias_size_in_bytes,
        temps=stats.temp_size_in_bytes,
        peak=max(best, 0) + sum(size for _, size, _ in args),
        peak_at=steps.get(at, str(at)),
        buffers=tuple(buffers),
    )


def _values(assignment: str) -> tuple[list, list, dict[str, str], set[str]]:
    """From the buffer-assignment dump: the temporaries ``(value, bytes, offset)``, the
    arguments ``(parameter number, bytes, shape)``, every value's shape, and the names
    of the values a loop carries (XLA's phis)."""
    temps, args, shapes, phis = [], [], {}, set()
    kind = None
    for line in assignment.splitlines():
        head = _ALLOCATION.match(line)
        if head:
            size, what = int(head.group(2)), head.group(3)
            param = _PARAMETER.match(what)
            kind = "temp" if "preallocated-temp" in what or not _NOT_TEMP.search(what) else None
            if param:
                args.append((int(param.group(1)), size, param.group(2)))
            continue
        v = _VALUE.match(line)
        if v is None:
            if line and not line.startswith(" "):
                kind = None  # past the allocations
            continue
        name = v.group(1) + (v.group(2) or "{}")
        shapes[name] = v.group(6)
        if kind == "temp":
            temps.append((name, int(v.group(4)), int(v.group(5))))
            if v.group(3):
                phis.add(name)
    return temps, args, shapes, phis


def _entry_parameters(hlo: str) -> dict[int, str]:
    """The entry computation's parameter number -> its ``op_name`` (the argument's path)."""
    entry = hlo[hlo.find("\nENTRY ") :] if "\nENTRY " in hlo else ""
    out = {}
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        m = re.search(r"\sparameter\((\d+)\)", line)
        if m:
            op = _OP_NAME.search(line)
            name = _INSTR.match(line)
            out[int(m.group(1))] = op.group(1) if op else (name.group(1) if name else "")
    return out


def _chain(now: tuple, others: list[tuple]) -> list[tuple]:
    """The values ``(start, end, is a phi, name)`` one buffer live at the peak is made
    of, by start: ``now`` and the values at its place that a loop passes it on through,
    transitively (a stack a forward loop writes and a backward loop carries is several
    values end to end, joined by the loops' phis). Two plain values in one place (an
    elementwise op written over its input) stay apart."""
    chain = [now]
    grown = True
    while grown:
        grown = False
        for o in others:
            if o not in chain and any(
                o[0] <= c[1] and o[1] >= c[0] and (o[2] or c[2]) for c in chain
            ):
                chain.append(o)
                grown = True
    return sorted(chain)


def _covered(intervals: list[tuple[int, int]]) -> int:
    """Bytes covered by sorted ``[start, end)`` intervals, overlaps counted once."""
    total, end = 0, -1
    for a, b in intervals:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _newest(where: str, pattern: str) -> str | None:
    files = sorted(glob.glob(os.path.join(where, pattern)), key=os.path.getmtime)
    return files[-1] if files else None


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()

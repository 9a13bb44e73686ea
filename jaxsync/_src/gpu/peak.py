"""What is live at a program's memory peak: each buffer, its shape and what made it.

``compiled.memory_analysis()`` gives four totals (arguments, outputs, aliased,
temporaries); when a step does not fit, or holds more than its GSPMD counterpart,
the question is *which* buffers. XLA answers it in its own dumps: after buffer
assignment it writes the live range of every value over the scheduled program
(``*-live-range.txt``) with the values live at its peak, and the byte ranges it
packed them into (``*-buffer-assignment.txt``). :func:`memory_report` compiles
with that dump on and reads it back, naming each buffer live at the peak by its
shape and the jax operation that made it (the ``op_name`` XLA keeps from the
jaxpr: ``jit(step)/shard_map/transpose(jvp())/while/body/...``, or the argument's
path, ``state.opt_state.master[1]``).

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

_PEAK = re.compile(r"^\s+Live ranges at (\d+) \(peak\):\n((?:\s+\S+: \d+ bytes.*\n)+)", re.M)
_LIVE = re.compile(r"^\s+(\S+?)(\{[\d,]*\}): (\d+) bytes", re.M)
_STEP = re.compile(r"^\s+(\d+):(\S+)$", re.M)
_VALUE = re.compile(
    r"^\s*value: <\d+ (\S+?)(\{[\d,]*\})? @\d+> \(size=\d+,offset=\d+\): (\S+)", re.M
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
    """

    name: str
    shape: str
    bytes: int
    made_by: str
    argument: bool


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """A compiled program's memory, and what is live at its peak.

    Attributes:
      arguments, outputs, aliased, temps: bytes, as ``memory_analysis()`` gives them
        (``aliased``: outputs written into donated arguments).
      peak: bytes live at XLA's peak (arguments included), by the live ranges of
        the scheduled program; ``arguments + temps`` can be above it, since the
        temporaries are packed into one allocation with gaps.
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

    def table(self, top: int = 15) -> str:
        """The ``top`` largest buffers live at the peak, one line each."""
        mib = 2**20
        lines = [
            f"arguments {self.arguments / mib:.0f} MiB + temporaries {self.temps / mib:.0f} MiB "
            f"= {self.total / mib:.0f} MiB; live at the peak ({self.peak_at}): "
            f"{self.peak / mib:.0f} MiB",
        ]
        for b in self.buffers[:top]:
            kind = "arg " if b.argument else "temp"
            lines.append(f"  {b.bytes / mib:9.1f} MiB  {kind}  {b.shape:28s}  {b.made_by}")
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
        the report is of that program).

    Returns:
      A :class:`MemoryReport`; ``print(report)`` shows the largest buffers.

    Example:
      >>> report = jaxsync.memory_report(step.lower(state, batch))
      >>> print(report.table(10))
      >>> report.by_origin(depth=2)
    """
    from .schedule import _compile  # the same fresh compile the schedule dump needs

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
        compiled = _compile(lowered, {**(options or {}), "xla_dump_to": where})
        live = _newest(where, "*after_optimizations-live-range.txt")
        if live is None:
            import jax

            raise RuntimeError(_NO_DUMP.format(version=jax.__version__))
        stem = live[: -len("-live-range.txt")]
        texts = [_read(live), _read(stem + "-buffer-assignment.txt"), _read(stem + ".txt")]
    return read_memory(*texts, compiled.memory_analysis())


def read_memory(live: str, assignment: str, hlo: str, stats: Any) -> MemoryReport:
    """A :class:`MemoryReport` from XLA's dumps of one program: its live ranges, its
    buffer assignment, its optimized HLO text and its ``memory_analysis()``."""
    m = _PEAK.search(live)
    if m is None:
        raise ValueError("memory_report: the live-range dump has no peak section.")
    at = int(m.group(1))
    steps = dict((int(i), name) for i, name in _STEP.findall(live.split("BufferLiveRange")[0]))
    shapes = {name + (index or "{}"): shape for name, index, shape in _VALUE.findall(assignment)}
    instrs = {name: rest for name, rest in _INSTR.findall(hlo)}
    buffers = []
    for name, index, size in _LIVE.findall(m.group(2)):
        rest = instrs.get(name, "")
        op = _OP_NAME.search(rest)
        buffers.append(PeakBuffer(
            name=name + index,
            shape=shapes.get(name + index, "").split("{")[0],
            bytes=int(size),
            made_by=op.group(1) if op else name,
            argument=" parameter(" in rest,
        ))  # fmt: skip
    buffers.sort(key=lambda b: -b.bytes)
    return MemoryReport(
        arguments=stats.argument_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        aliased=stats.alias_size_in_bytes,
        temps=stats.temp_size_in_bytes,
        peak=sum(b.bytes for b in buffers),
        peak_at=steps.get(at, str(at)),
        buffers=tuple(buffers),
    )


def _newest(where: str, pattern: str) -> str | None:
    files = sorted(glob.glob(os.path.join(where, pattern)), key=os.path.getmtime)
    return files[-1] if files else None


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()

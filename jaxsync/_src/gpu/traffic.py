"""Bytes each device's kernels move through memory per step, read off the compiled HLO.

On one real H100 XLA's time model priced six one-GPU training steps 1.14-1.77x off,
by a different factor per program, while the bytes their kernels read and write
tracked the measured time (r = 0.985 over those six programs). So the measure a
user can trust for per-device work is the bytes, counted exactly:

- every kernel of the optimized program (fusions, library calls such as cuBLAS
  matmuls, copies, unfused ops), its operands read and its result written;
- a kernel inside a loop counted once per iteration (the product of the enclosing
  loops' ``known_trip_count``), an iteration XLA peeled out of a loop once;
- a fusion that only slices an operand (``dynamic-slice``, ``slice``) reads the
  slice, and one that updates a buffer in place (``dynamic-update-slice``) reads
  and writes the update, not the whole buffer;
- collectives left out (they are the network's, :func:`jaxsync.collective_stats`),
  and so is plumbing (tuples, bitcasts, parameters).

XLA's own ``cost_analysis()`` is not used: it is not available on a compile-only
executable, and it counts a loop body once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

from .hlo import _ARRAY, _DTYPE_BYTES
from .overlap import _loop_context, _parse, hlo_text

_PLUMBING = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain", "while",
    "call", "conditional", "async-start", "async-update", "async-done", "send", "recv",
    "send-done", "recv-done", "copy-done",
})  # fmt: skip
_COLLECTIVE = re.compile(
    r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
    r"collective-broadcast|ragged-all-to-all)(-start|-done)?$"
)
_SLICES = frozenset({"dynamic-slice", "slice"})
_SEE_THROUGH = frozenset({"bitcast", "reshape", "copy", "convert", "reduce-precision"})
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
KINDS = ("matmul", "attention", "other")


class KernelBytes(NamedTuple):
    """One kernel's traffic per step.

    Attributes:
      name: the instruction.
      kind: ``"matmul"`` (cuBLAS / Triton gemms), ``"attention"`` (fused attention
        library calls) or ``"other"``.
      bytes: read + written per run.
      runs: runs per step (the loops' trip counts multiplied).
      op_name: the jax operation it comes from.
    """

    name: str
    kind: str
    bytes: int
    runs: int
    op_name: str

    @property
    def total(self) -> int:
        return self.bytes * self.runs


@dataclasses.dataclass(frozen=True)
class TrafficReport:
    """Memory traffic of one device's kernels per step.

    Attributes:
      kernels: every kernel, heaviest (bytes x runs) first.
      unknown_trips: kernels in a loop whose trip count XLA does not know
        (counted once each).
    """

    kernels: tuple[KernelBytes, ...]
    unknown_trips: int = 0

    @property
    def total(self) -> int:
        """Bytes read and written per step, collectives excluded."""
        return sum(k.total for k in self.kernels)

    @property
    def rematerialized(self) -> int:
        """Bytes per step of the kernels XLA's rematerialization cloned (``.remat`` in
        their names), all of each clone's traffic: nonzero where XLA's estimate of the
        program's peak, made before scheduling, passed its memory limit (80% of the
        GPU) and it recomputes values to get under it."""
        return sum(k.total for k in self.kernels if ".remat" in k.name)

    def by_kind(self) -> dict[str, int]:
        """Bytes per step by kernel kind (``matmul``, ``attention``, ``other``)."""
        out = dict.fromkeys(KINDS, 0)
        for k in self.kernels:
            out[k.kind] += k.total
        return out

    def table(self, top: int = 12) -> str:
        gb = 1e9
        kinds = ", ".join(f"{k} {v / gb:.2f}" for k, v in self.by_kind().items())
        lines = [f"{self.total / gb:.2f} GB per step ({kinds})"]
        if self.rematerialized:
            lines.append(f"  of which {self.rematerialized / gb:.2f} GB XLA rematerialized")
        for k in self.kernels[:top]:
            lines.append(
                f"  {k.total / gb:8.3f} GB  {k.runs:4d} x {k.bytes / 2**20:9.1f} MiB  "
                f"{k.kind:9s} {k.op_name or k.name}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def hbm_bytes(compiled_or_text: Any) -> TrafficReport:
    """Counts the bytes every kernel of a compiled program reads and writes per step.

    Args:
      compiled_or_text: a ``jax.stages.Compiled`` (for a GPU mesh: the
        compile-only targets of :func:`jaxsync.gpu_topology` give the H100's
        program without a GPU) or its ``.as_text()``.

    Returns:
      A :class:`TrafficReport`: ``.total`` bytes per step, ``.by_kind()``, and
      the heaviest kernels in ``.table()``.

    Example:
      >>> report = jaxsync.hbm_bytes(step.lower(state, batch).compile())
      >>> print(report.total / 1e9, "GB per step", report.by_kind())
    """
    comps, entry = _parse(hlo_text(compiled_or_text, "hbm_bytes"))
    loops = _loop_context(comps, entry)
    # Computations run inside a kernel: fused ones, and the reductions an op applies.
    fused = {
        callee for insts in comps.values() for inst in insts for attr, callee in inst.calls
        if inst.opcode == "fusion" or attr == "to_apply"
    }  # fmt: skip
    kernels, unknown = [], 0
    for comp, insts in comps.items():
        if comp not in loops or comp in fused:
            continue
        trips = [t for _, _, t in loops[comp]]
        runs = math.prod(t or 1 for t in trips)
        shapes = {i.name: i.shape for i in insts}
        for inst in insts:
            if inst.opcode in _PLUMBING or _COLLECTIVE.match(inst.opcode):
                continue
            size = _kernel_bytes(inst, shapes, comps)
            unknown += None in trips
            kernels.append(KernelBytes(inst.name, _kind(inst, comps), size, runs, inst.op_name))
    kernels.sort(key=lambda k: -k.total)
    return TrafficReport(tuple(kernels), unknown)


def _callee(inst: Any) -> str:
    return next((c for a, c in inst.calls if a == "calls"), "")


def _bytes(shape: str) -> int:
    return sum(
        math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dtype, 4)
        for dtype, dims in _ARRAY.findall(shape)
    )


def _kind(inst: Any, comps: dict) -> str:
    targets = _TARGET.findall(inst.attrs)
    if inst.opcode == "fusion":
        body = comps.get(_callee(inst), ())
        targets += [t for i in body for t in _TARGET.findall(i.attrs)]
        if any(i.opcode in ("dot", "convolution") for i in body):
            return "matmul"  # a gemm fusion (Triton on GPU)
    if any("fmha" in t or "flash" in t or "attention" in t for t in targets):
        return "attention"
    if any("gemm" in t or "matmul" in t or "cublas" in t for t in targets):
        return "matmul"
    return "other"


def _kernel_bytes(inst: Any, shapes: dict[str, str], comps: dict) -> int:
    """Read + written by one kernel: each operand whole, or the part a fusion slices
    out of it; the result whole, or the update a fusion writes in place."""
    reads = [_bytes(shapes.get(o, "")) for o in inst.operands]
    written = _bytes(inst.shape)
    if inst.opcode == "dynamic-update-slice" and len(reads) > 1:
        return 2 * reads[1]  # in place: the update read and written
    if inst.opcode in _SLICES:
        return 2 * written
    body = comps.get(_callee(inst), ()) if inst.opcode == "fusion" else ()
    if body:
        params = {
            int(i.operands[0]): i.name for i in body
            if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()
        }  # fmt: skip
        users: dict[str, list[Any]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        by_name = {i.name: i for i in body}
        for index, name in params.items():
            if index >= len(reads):
                continue
            seen = _read_part(name, users, by_name)
            if seen is not None:
                reads[index] = min(reads[index], seen * _itemsize(by_name[name].shape))
        updated = [i for i in body if i.opcode == "dynamic-update-slice"]
        for dus in updated:
            base = _through(dus.operands[0], by_name)
            if base in params.values():  # in place: not read, only the update written
                index = next(k for k, v in params.items() if v == base)
                if index < len(reads):
                    reads[index] = 0
                written -= _bytes(dus.shape) - _bytes(by_name[dus.operands[1]].shape)
    if "kind=kLoop" in inst.attrs:
        # An elementwise (loop) fusion reads at most one element of each operand per
        # element it writes: a slice of a slice reads the inner part only.
        out = _elements(inst.shape)
        reads = [
            min(r, out * _itemsize(shapes.get(o, "")))
            for r, o in zip(reads, inst.operands, strict=False)
        ]
    return sum(reads) + max(written, 0)


def _elements(shape: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(shape))


def _itemsize(shape: str) -> int:
    m = _ARRAY.search(shape)
    return _DTYPE_BYTES.get(m.group(1), 4) if m else 0


def _through(name: str, by_name: dict[str, Any]) -> str:
    """The fusion parameter ``name`` is a bitcast/reshape/copy chain of (or itself)."""
    while name in by_name and by_name[name].opcode in _SEE_THROUGH and by_name[name].operands:
        name = by_name[name].operands[0]
    return name


def _read_part(name: str, users: dict, by_name: dict) -> int | None:
    """Elements a fusion reads of ``name`` when every use slices it, through bitcasts
    and elementwise conversions (a slice of a converted dynamic slice reads the
    inner slice); None when some use reads it whole."""
    if not users.get(name):
        return None  # the fusion's result: read whole
    total = 0
    for user in users[name]:
        if user.opcode in _SEE_THROUGH:
            inner = _read_part(user.name, users, by_name)
            if inner is None:
                return None
            total += inner
        elif user.opcode in _SLICES and user.operands and user.operands[0] == name:
            inner = _read_part(user.name, users, by_name)
            total += _elements(user.shape) if inner is None else inner
        elif user.opcode == "dynamic-update-slice" and user.operands[0] == name:
            continue  # the buffer updated in place
        elif name in user.operands[1 if user.opcode == "dynamic-slice" else 2 :] and (
            user.opcode in ("dynamic-slice", "dynamic-update-slice")
        ):
            continue  # a scalar index
        else:
            return None
    return total

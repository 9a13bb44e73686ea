"""Pricing kernels the latency-hiding scheduler did not: a roofline of the target GPU.

A kernel runs at the larger of its FLOPs at the GPU's dense bf16 tensor peak and
the bytes it reads and writes at the memory bandwidth. :func:`compute_times`
gives, per kernel class (matmuls, the rest), XLA's modeled time next to this
roofline over a scheduled computation, so the report can scale the roofline of
the computations XLA skipped by what XLA charges for the same class.
"""

from __future__ import annotations

import math
import re

from .target import GpuSpec
from .textproto import Message

FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "while", "call",
    "conditional",
})  # fmt: skip
_BYTES = {
    "PRED": 1, "S8": 1, "U8": 1, "F8E4M3FN": 1, "F8E5M2": 1, "S16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "S32": 4, "U32": 4, "F32": 4, "S64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def is_compute(opcode: str) -> bool:
    return opcode not in FREE and not opcode.endswith(("-start", "-done", "-update"))


def compute_times(comp: Message, sched: Message, comps, insts, gpu: GpuSpec) -> tuple:
    """Per class (matmuls, the rest): (XLA's modeled time, roofline) of ``comp``'s kernels."""
    out = [[0.0, 0.0], [0.0, 0.0]]
    for e in sched.all("instructions"):
        inst = insts[e.one("id")]
        if not is_compute(inst.one("opcode")):
            continue
        cls = out[0 if dot_flops(inst, comps, insts) else 1]
        cls[0] += e.one("end_timestamp_cycles", 0.0) - e.one("start_timestamp_cycles", 0.0)
        cls[1] += roofline(inst, comps, insts, gpu)
    return out


def shape_bytes(shape: Message | None) -> int:
    if shape is None:
        return 0
    subs = shape.all("tuple_shapes")
    if subs:
        return sum(shape_bytes(s) for s in subs)
    return math.prod(shape.all("dimensions")) * _BYTES.get(shape.one("element_type"), 0)


def roofline(inst: Message, comps, insts, gpu: GpuSpec) -> float:
    """Microseconds of one kernel at the target's peak FLOPs or bytes, whichever binds."""
    op = inst.one("opcode")
    if op in FREE:
        return 0.0
    moved = shape_bytes(inst.one("shape")) + sum(
        shape_bytes(insts[o].one("shape")) for o in inst.all("operand_ids") if o in insts
    )
    flops = dot_flops(inst, comps, insts)
    dtype_peak = gpu.bf16_dense_tflops * 1e12
    return max(moved / gpu.memory_bandwidth, flops / dtype_peak) * 1e6


def dot_flops(inst: Message, comps, insts) -> float:
    """2 x output elements x contracted size of every matmul in ``inst``: a ``dot``, a
    fusion holding dots, or a cuBLAS gemm custom-call."""
    if inst.one("opcode") == "custom-call":
        if not re.search(r"gemm|matmul", inst.one("custom_call_target", "") or ""):
            return 0.0
        m = _GEMM_DIMS.search(inst.one("backend_config", "") or "")
        out = inst.one("shape")
        out = out.all("tuple_shapes")[0] if out.all("tuple_shapes") else out
        contracting = [int(j) for j in re.findall(r"\d+", m.group(1))] if m else []
        return _flops(out, insts.get((inst.all("operand_ids") or [None])[0]), contracting)
    dots = [inst] if inst.one("opcode") == "dot" else [
        i for c in inst.all("called_computation_ids") for i in comps[c].all("instructions")
        if i.one("opcode") == "dot"
    ]  # fmt: skip
    total = 0.0
    for d in dots:
        nums = d.one("dot_dimension_numbers", Message())
        lhs = insts.get(d.all("operand_ids")[0]) if d.all("operand_ids") else None
        total += _flops(d.one("shape"), lhs, nums.all("lhs_contracting_dimensions"))
    return total


def _flops(out: Message, lhs: Message | None, contracting: list[int]) -> float:
    dims = lhs.one("shape").all("dimensions") if lhs is not None else []
    k = math.prod(dims[j] for j in contracting if j < len(dims))
    return 2.0 * math.prod(out.all("dimensions")) * k

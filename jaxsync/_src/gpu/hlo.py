"""Reading collectives out of compiled HLO text: how many, and how many bytes.

This is how we (and the tests) check that a step holds exactly the planned
collectives: one per bucket, in the reduction dtype, and no hidden all-reduce.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


class CollectiveStats(NamedTuple):
    """Arrays moved by one kind of collective, and their total bytes."""

    count: int
    bytes: int


def _arrays(result: str) -> list[tuple[str, int]]:
    out = []
    for dtype, dims in _ARRAY.findall(result):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append((dtype, n * _DTYPE_BYTES.get(dtype, 4)))
    return out


def collective_stats(hlo_text: str) -> dict[str, CollectiveStats]:
    """Per collective kind: arrays communicated and result bytes, from compiled HLO.

    XLA's combiner passes may merge several per-bucket collectives into one
    tuple-shaped op, so a tuple result counts once per element: the count is the
    number of buffers communicated. Async ``*-start`` ops are counted once (their
    ``*-done`` is skipped); for all-gather/all-reduce starts, whose result tuple
    holds operands and results, only the results count.

    Args:
      hlo_text: ``jax.jit(f).lower(...).compile().as_text()``.
    """
    stats = {op: [0, 0] for op in COLLECTIVES}
    for line in hlo_text.splitlines():
        if "=" not in line:
            continue
        rhs = line.split("=", 1)[1]
        for op in COLLECTIVES:
            for form in (f" {op}(", f" {op}-start("):
                if form not in rhs:
                    continue
                arrays = _arrays(rhs.split(form)[0])
                if form.endswith("-start(") and op in ("all-gather", "all-reduce"):
                    arrays = arrays[len(arrays) // 2 :] if len(arrays) > 1 else arrays
                stats[op][0] += max(1, len(arrays))
                stats[op][1] += sum(b for _, b in arrays)
    return {op: CollectiveStats(*v) for op, v in stats.items()}


_LOWERED = {
    "all-reduce": "stablehlo.all_reduce",
    "reduce-scatter": "stablehlo.reduce_scatter",
    "all-gather": "stablehlo.all_gather",
    "collective-permute": "stablehlo.collective_permute",
    "all-to-all": "stablehlo.all_to_all",
}


def lowered_collective_counts(lowered_text: str) -> dict[str, int]:
    """Collectives as the program emitted them (StableHLO, before XLA's passes).

    Args:
      lowered_text: ``jax.jit(f).lower(...).as_text()``.
    """
    return {
        k: lowered_text.count(f'"{v}"') + lowered_text.count(f" {v}(") for k, v in _LOWERED.items()
    }

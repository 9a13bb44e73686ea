"""Where a backward loop's stacked results go in the rows of its input stacks, as bits.

:mod:`grad_rows` writes each layer's reduced gradient into the row of saved layer
inputs that layer's backward has just read. This module decides the places (which
stack, at which offset, how much spills into a stack of its own) and moves a result's
bits in and out of a row of another dtype, exactly: bits are copied, never converted.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ..core.axes import aval_varying_axes
from ..core.jaxpr_compat import scan_num_carry, scan_num_consts


class Place(NamedTuple):
    """Where a stacked result's rows go: ``take`` elements (of the stack's dtype) at
    offset ``at`` of input stack ``stack``'s rows, the ``spill`` elements left in a
    stack of their own."""

    stack: int
    at: int
    take: int
    spill: int


#: The least share of a result the rows must hold for it to be placed (one part in
#: three). Below it the spilled stack is nearly the whole one, and the rewritten loop's
#: schedule (each layer's reduction in the next iteration) replaces XLA's for little:
#: docs/gpu.md's 64 x H100 example, 8 rows of 1024 per GPU against a 256 KiB shard
#: (6% of it), had its backward loop's reduce-scatters left without compute beside them.
MIN_SHARE = 3


def places_of(jaxpr: Any, loop: Any) -> dict[int, Place]:
    """For each stacked result written into an input row (by its index among the loop's
    ``ys``), its :class:`Place`. Largest results first, each into the stack with most
    room; one that fits no row whole puts what fits in the roomiest (a third of it at
    least: :data:`MIN_SHARE`) and spills the rest into a stack of its own, which still
    frees what the rows hold of it. ``bench_gpu``'s
    Llama-style 1.1B on 8 x H100, FSDP, args + temps per GPU (GSPMD's FSDP), XLA's
    timeline: 2 rows of 2048 tokens per GPU (a 21.5 MiB shard per layer against 16 MiB
    of inputs) 3845 -> 3550 MiB (3937), 76.5 -> 77.4 ms (85.5); 1 row of 2048, 3058 ->
    2956 (3223), 48.2 -> 48.5 ms; 1 row of 4096, 4831 -> 4606 (4977). Where a shard fits
    (4 rows of 2048, and the 7.2B on 64 GPUs) the program is the same."""
    nc, ncar = scan_num_consts(loop), scan_num_carry(loop)
    length = loop.params["length"]
    uses: dict[Any, int] = {}
    for v in [*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]:
        if isinstance(v, jcore.Var):
            uses[v] = uses.get(v, 0) + 1
    xs = loop.invars[nc + ncar :]
    room = {k: _row(v.aval) for k, v in enumerate(xs)
            if isinstance(v, jcore.Var) and uses.get(v) == 1 and _stacked(v.aval, length)
            and v.aval.ndim >= 2}  # fmt: skip
    ys = [(j, v.aval) for j, v in enumerate(loop.outvars[ncar:])
          if not isinstance(v, jcore.DropVar) and _stacked(v.aval, length)]  # fmt: skip
    used = dict.fromkeys(room, 0)
    places = {}
    for j, a in sorted(ys, key=lambda t: -_row(t[1]) * t[1].dtype.itemsize):
        free = {k: (room[k] - used[k]) * xs[k].aval.dtype.itemsize for k in room
                if aval_varying_axes(a) == aval_varying_axes(xs[k].aval)}  # fmt: skip
        if not free or max(free.values()) <= 0:
            continue
        k = max(free, key=lambda k: free[k])
        need = elements(a, xs[k].aval.dtype)
        take = min(need, room[k] - used[k])
        if take * MIN_SHARE < need:
            continue
        places[j] = Place(k, used[k], take, need - take)
        used[k] += take
    return places


def _stacked(a: Any, length: int) -> bool:
    return a.ndim >= 1 and a.shape[0] == length and jnp.issubdtype(a.dtype, jnp.floating)


def _row(a: Any) -> int:
    return math.prod(a.shape[1:])


def elements(a: Any, dtype: Any) -> int:
    """How many elements of ``dtype`` hold one row of ``a``."""
    return -(-_row(a) * a.dtype.itemsize // jnp.dtype(dtype).itemsize)


def to_bits(y: jax.Array, dtype: Any) -> jax.Array:
    """``y`` flattened, its bits as ``dtype`` elements (padded to whole elements)."""
    y = y.reshape(-1)
    src, dst = y.dtype.itemsize, jnp.dtype(dtype).itemsize
    if src >= dst:
        return jax.lax.bitcast_convert_type(y, dtype).reshape(-1)
    r = dst // src
    y = jnp.pad(y, (0, -y.size % r))
    return jax.lax.bitcast_convert_type(y.reshape(-1, r), dtype)


def from_bits(bits: jax.Array, aval: Any) -> jax.Array:
    """The ``[L, ...]`` stack of ``aval`` whose rows' bits are ``bits`` ``[L, n]``."""
    length = bits.shape[0]
    src, dst = bits.dtype.itemsize, aval.dtype.itemsize
    if src == dst:
        out = jax.lax.bitcast_convert_type(bits, aval.dtype)
    elif src > dst:
        out = jax.lax.bitcast_convert_type(bits, aval.dtype).reshape(length, -1)
    else:
        out = jax.lax.bitcast_convert_type(bits.reshape(length, -1, dst // src), aval.dtype)
    return out[:, : _row(aval)].reshape(aval.shape)

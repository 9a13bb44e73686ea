"""The FSDP gather: all-gather a flat shard whose backward reduce-scatters into it.

Also the mixed-precision policy that decides the dtypes of both directions.

A stacked layer is gathered piece by piece (:func:`gather_pieces`): its shard
holds a piece of every param, each param's pieces are all-gathered straight into
that param's own array (XLA combines the layer's all-gathers into one), and the
backward packs the layer's gradient in that same order, in ``reduce_dtype``, for
one reduce-scatter (two, a half each, in one host: :func:`halves`). One
all-gather of the whole row would instead need every param cut out of it: a copy
of the layer, in the forward and again in the backward's re-gather.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ..core.axes import axes_size, to_varying
from ..core.hosts import in_one_host
from ..core.validate import check_bool, check_float_dtype
from ..sync.collectives import scatter_wire_sum, wire_sum
from .ready_order import order_of

PyTree = Any


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's mixed-precision policy.

    A model that states no policy gets :func:`default_policy`: its own float dtype
    (fp32 when its params mix dtypes); fp32 compute for a bf16 model is a choice
    to state, ``MixedPrecision(param_dtype=jnp.float32)``.

    Attributes:
      param_dtype: dtype the params are gathered in and computed with.
      reduce_dtype: dtype gradients are reduce-scattered (and all-reduced) in.
      output_dtype: cast each unit's floating outputs to this (None: leave).
      cast_forward_inputs: cast each unit's floating inputs to ``param_dtype``.
    """

    param_dtype: Any = jnp.float32
    reduce_dtype: Any = jnp.float32
    output_dtype: Any = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        # An integer dtype here would truncate params or gradients silently.
        check_float_dtype(self.param_dtype, "MixedPrecision.param_dtype")
        check_float_dtype(self.reduce_dtype, "MixedPrecision.reduce_dtype")
        check_float_dtype(self.output_dtype, "MixedPrecision.output_dtype", allow_none=True)
        check_bool(self.cast_forward_inputs, "MixedPrecision.cast_forward_inputs")


def default_policy(params: PyTree) -> MixedPrecision:
    """The policy of a model that states none: gather and compute in the params' own
    float dtype when they share one (a bf16 model runs in bf16 on its fp32 shards, as
    ZeRO's bf16 params on their fp32 master; reduce in fp32), fp32 when they mix
    dtypes. Gathering a bf16 model in fp32 would send twice the bytes and compute
    in another precision than the same model under ZeRO or DDP."""
    dtypes = {
        jnp.dtype(x.dtype)
        for x in jax.tree.leaves(params)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    }
    own = dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.float32)
    return MixedPrecision(param_dtype=own)


def cast_floats(tree: PyTree, dtype: Any) -> PyTree:
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda x: (
            x.astype(dtype)
            if isinstance(x, jax.Array | jnp.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        tree,
    )


def reduce_shard(
    flat: jax.Array, axes: tuple[str, ...], replicate: tuple[str, ...], wire: str = ""
) -> jax.Array:
    """``flat``'s reduce-scatter over ``axes`` (sending ``wire``, summing in ``flat``'s
    dtype, where given), all-reduced over ``replicate``, averaged."""
    if wire:
        out = scatter_wire_sum(flat, axes, jnp.dtype(wire))
    else:
        out = jax.lax.psum_scatter(flat, axes, scatter_dimension=flat.ndim - 1, tiled=True)
    if replicate:
        out = jax.lax.psum(out, replicate)
    return out * (1.0 / axes_size(axes + replicate))


def gather_shard(
    shard: jax.Array, axes, replicate, param_dtype: str, reduce_dtype: str
) -> jax.Array:
    """The whole shard all-gathered in ``param_dtype`` (:func:`gather_pieces` of one
    piece); its backward reduce-scatters the cotangent, in ``reduce_dtype``, into it.

    An unstacked unit (an embedding, a head) is reduced once, after the backward
    (or before its layer loop), where no layer's compute is left to hide it. In one
    host its fp32 sums of a bf16 model's gradients send bf16 (``wire_sum``: exact,
    the cotangents are bf16), half the bytes of an fp32 ring.
    """
    width = (shard.shape[-1],)
    wire = param_dtype if not replicate and wire_sum(reduce_dtype, param_dtype, axes) else ""
    return gather_pieces(shard, width, axes, replicate, param_dtype, reduce_dtype, wire)[0]


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def gather_pieces(
    shard: jax.Array,
    widths: tuple[int, ...],
    axes,
    replicate,
    param_dtype: str,
    reduce_dtype: str,
    wire: str = "",
) -> tuple[jax.Array, ...]:
    """Each ``widths`` piece of ``shard`` (a stacked layer's: one per param), all-gathered
    on its own, in ``param_dtype``: the flat arrays of the unit's buffers. The backward
    reduce-scatters in ``reduce_dtype``, sending ``wire`` where given
    (:func:`~jaxsync._src.sync.collectives.scatter_wire_sum`).

    Gathered as device-varying (over the replica axes too): typed replicated, JAX
    would psum the cotangent before our backward ever saw it (the implicit
    all-reduce), and the replica all-reduce would happen twice.
    """
    out, lo = [], 0
    for w in widths:
        full = jax.lax.all_gather(
            shard[..., lo : lo + w].astype(param_dtype), axes, axis=shard.ndim - 1, tiled=True
        )
        out.append(to_varying(full, replicate) if replicate else full)
        lo += w
    return tuple(out)


def pieces_fwd(shard, widths, axes, replicate, param_dtype, reduce_dtype, wire=""):
    # The residual only carries the shard's dtype (an empty array of it).
    out = gather_pieces(shard, widths, axes, replicate, param_dtype, reduce_dtype, wire)
    return out, jnp.zeros((0,), shard.dtype)


def pieces_bwd(widths, axes, replicate, param_dtype, reduce_dtype, wire, like, cts):
    # Every rank's part of each buffer, side by side: the rank-major order of the
    # shard, so one reduce-scatter leaves each rank its shard as it is stored. In
    # halves (:func:`halves`) each half's reduce-scatter leaves each rank its part of
    # the half's pieces, which are then put back in the shard's order.
    n = axes_size(axes)
    parts: dict[int, jax.Array] = {}
    last = None
    for group in halves(widths, axes, replicate, order_of(tuple(n * w for w in widths))):
        part = tuple(cts[i] for i in group)
        if last is not None:  # packed only when the half before is reduced: one pack held at a time
            part, _ = jax.lax.optimization_barrier((part, last))
        rows = [
            ct.astype(reduce_dtype).reshape(*ct.shape[:-1], n, widths[i])
            for ct, i in zip(part, group, strict=True)
        ]
        packed = jnp.concatenate(rows, axis=-1)
        packed = packed.reshape(*packed.shape[:-2], n * packed.shape[-1])
        last = reduce_shard(packed, axes, replicate, wire)
        lo = 0
        for i in group:
            parts[i] = last[..., lo : lo + widths[i]]
            lo += widths[i]
    pieces = [parts[i] for i in range(len(widths))]
    shard = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)
    return (shard.astype(like.dtype),)


def halves(
    widths: tuple[int, ...], axes, replicate, order: tuple[int, ...] | None = None
) -> list[list[int]]:
    """The pieces of a unit's gradient, grouped for its reduce-scatters: two halves
    where the reduction stays in one host, one group otherwise. The first half is
    the pieces that come first in ``order`` (the order the backward finishes them,
    :mod:`.ready_order`; default: the layout's), 3/5 of the width: it is reduced
    while the second is computed, and the second's pack waits into the next layer.
    Cut at half, the first half's pack sat at the backward loop's peak, beside the
    attention's buffers (8 x H100, Llama-style 1.1B: 5511 MiB against 5314).

    The pack a reduce-scatter reads is the whole layer's gradient in
    ``reduce_dtype``, fp32 for a bf16 model: on 8 x H100 it sat at the backward
    loop's peak (Llama-style 1.1B: 172 MiB). Packed and reduced a half at a time,
    the step holds less (8 x H100, ``bench_gpu``, in the layout's order: Llama-style
    1.1B 5693 -> 5433 MiB, GPT 1.2B 5320 -> 5219, Llama-3.2-1B's shape 8544 -> 8264;
    XLA's timeline +1.3%, -0.2%, +1.8%; with the head's gradient reduced before the
    loop, then in the ready order: 5314, 4928 and 7871 MiB, timelines 1.8%, 0.7% and
    2.0% shorter than in the layout's order). Across hosts a half's reduction can
    outlast the compute left to hide it, and halves in sequence then lengthen the
    backward loop (7.2B: 98% -> 75% of the bound on 2 hosts of 8 H100s, 93% -> 72% on
    8 hosts; a first half of 1/3 or 1/5: 82%, 81%), though a 1.1B model on 2 hosts
    gains (4642 -> 4384 MiB, 96% -> 98%). So a group beyond one host's NVLink
    (``core.hosts.in_one_host``), or one that sums over replica axes too, reduces its
    pack whole.
    """
    every = list(range(len(widths)))
    if len(widths) < 2 or replicate or not in_one_host(axes):
        return [every]
    order = list(every if order is None else order)
    assert sorted(order) == every, (order, widths)
    total, run = sum(widths), 0
    for k, i in enumerate(order[:-1]):
        run += widths[i]
        if 5 * run >= 3 * total:
            return [sorted(order[: k + 1]), sorted(order[k + 1 :])]
    return [sorted(order[:-1]), order[-1:]]


gather_pieces.defvjp(pieces_fwd, pieces_bwd)

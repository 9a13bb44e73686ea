"""The FSDP gather: all-gather a flat shard whose backward reduce-scatters into it.

Also the mixed-precision policy that decides the dtypes of both directions.

A stacked layer is gathered piece by piece (:func:`gather_pieces`): its shard
holds a piece of every param, each param's pieces are all-gathered straight into
that param's own array (XLA combines the layer's all-gathers into one), and the
backward packs the layer's gradient in that same order, in ``reduce_dtype``, for
one reduce-scatter. One all-gather of the whole row would instead need every
param cut out of it: a copy of the layer, in the forward and again in the
backward's re-gather.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ..core.axes import axes_size, to_varying
from ..core.validate import check_bool, check_float_dtype

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


def reduce_shard(flat: jax.Array, axes: tuple[str, ...], replicate: tuple[str, ...]) -> jax.Array:
    out = jax.lax.psum_scatter(flat, axes, scatter_dimension=flat.ndim - 1, tiled=True)
    if replicate:
        out = jax.lax.psum(out, replicate)
    return out * (1.0 / axes_size(axes + replicate))


def gather_shard(
    shard: jax.Array, axes, replicate, param_dtype: str, reduce_dtype: str
) -> jax.Array:
    """The whole shard all-gathered in ``param_dtype`` (:func:`gather_pieces` of one
    piece); its backward reduce-scatters the cotangent, in ``reduce_dtype``, into it."""
    width = (shard.shape[-1],)
    return gather_pieces(shard, width, axes, replicate, param_dtype, reduce_dtype)[0]


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def gather_pieces(
    shard: jax.Array, widths: tuple[int, ...], axes, replicate, param_dtype: str, reduce_dtype: str
) -> tuple[jax.Array, ...]:
    """Each ``widths`` piece of ``shard`` (a stacked layer's: one per param), all-gathered
    on its own, in ``param_dtype``: the flat arrays of the unit's buffers.

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


def pieces_fwd(shard, widths, axes, replicate, param_dtype, reduce_dtype):
    # The residual only carries the shard's dtype (an empty array of it).
    out = gather_pieces(shard, widths, axes, replicate, param_dtype, reduce_dtype)
    return out, jnp.zeros((0,), shard.dtype)


def pieces_bwd(widths, axes, replicate, param_dtype, reduce_dtype, like, cts):
    # Every rank's part of each buffer, side by side: the rank-major order of the
    # shard, so one reduce-scatter leaves each rank its shard as it is stored.
    n = axes_size(axes)
    rows = [
        ct.astype(reduce_dtype).reshape(*ct.shape[:-1], n, w)
        for ct, w in zip(cts, widths, strict=True)
    ]
    packed = jnp.concatenate(rows, axis=-1).reshape(*cts[0].shape[:-1], n * sum(widths))
    return (reduce_shard(packed, axes, replicate).astype(like.dtype),)


gather_pieces.defvjp(pieces_fwd, pieces_bwd)

"""The records a :class:`~jaxsync.Layout` is made of: buffer keys, param slots,
buckets, buffers and the three ranges of a param piece (Megatron's).

Frozen and hashable, built from shapes and dtypes only; :mod:`layout` holds the
layout itself and its array operations, :mod:`placement` builds it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

PyTree = Any


class BufferKey(NamedTuple):
    """What decides which flat buffer a parameter goes to.

    Params share a buffer only if everything about their reduction is the same,
    so each bucket's collectives are uniform.

    Attributes:
      dtype: name of the parameter dtype (``"float32"``, ``"bfloat16"``...).
      axes: data-parallel mesh axes the gradient is averaged and sharded over
        (expert params: the expert-data-parallel axes only).
      label: optimizer label (weight-decay group, ``multi_transform`` key).
      sum_axes: further ``(axis, groups)`` the gradient is summed over before the
        data-parallel reduction (tied stages, sequence parallelism); ``groups``
        is None (the whole axis) or a tuple of disjoint index groups.
      mean_axes: further axes the gradient is averaged over.
      varying: non-data-parallel mesh axes over which the param's values differ
        (tensor- or expert-sharded pieces, per-stage weights); the global norm
        counts such pieces once each, and replicated copies once in all.
      stack: name of the stacked-layer group (params with a leading layer axis,
        run by ``lax.scan``) the buffer holds, or None. A stacked buffer is laid
        out per layer: its arrays are ``[layers, size]``, and every layer has the
        same buckets and the same per-rank ranges.
      owned: None for a flat-sharded buffer; else the cost model of whole-matrix
        ownership (see :func:`jaxsync.whole_matrices`): each param, or each layer
        of a stacked param, lies whole in the shard of the rank that owns it.
      part: None, or a name that keeps the param in a buffer of its own (FSDP's
        stacked layers: each rank holds a piece of every leaf, so each leaf is
        gathered whole, straight into its own array, with no unpacking copy).
    """

    dtype: str
    axes: tuple[str, ...] = ()
    label: str | None = None
    sum_axes: tuple[tuple[str, tuple[tuple[int, ...], ...] | None], ...] = ()
    mean_axes: tuple[str, ...] = ()
    varying: tuple[str, ...] = ()
    stack: str | None = None
    owned: Any = None
    part: str | None = None


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter leaf lives in its buffer.

    For a stacked leaf (``layers > 0``), ``shape`` is the whole leaf
    ``(layers, *row_shape)`` and ``start``/``size`` refer to one layer's row.
    In an owned buffer (whole-matrix ownership) a stacked leaf's layers lie
    apart, each in its owner's shard: ``pieces`` holds each layer's start.
    """

    path: str
    leaf_index: int
    shape: tuple[int, ...]
    dtype: str
    buffer: int
    bucket: int
    start: int
    layers: int = 0
    pieces: tuple[int, ...] = ()

    def spans(self) -> tuple[tuple[int, Any], ...]:
        """``(start in buffer, index into the leaf reshaped to (layers, size))`` per
        piece: one per layer when the layers lie apart, else ``((start, None),)``."""
        if self.pieces:
            return tuple((p, layer) for layer, p in enumerate(self.pieces))
        return ((self.start, None),)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one layer's slice (the whole shape when not stacked)."""
        return self.shape[1:] if self.layers else self.shape

    @property
    def size(self) -> int:
        return math.prod(self.row_shape)

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range ``[start, end)`` of a buffer; one collective each."""

    start: int
    end: int
    slots: tuple[int, ...]  # indices into ``Layout.slots``

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One flat buffer: all params sharing a ``BufferKey``, cut into buckets."""

    key: BufferKey
    size: int  # padded
    used: int  # elements that hold parameters; the rest is padding
    buckets: tuple[Bucket, ...]
    slots: tuple[int, ...]
    num_shards: int = 1  # ranks every bucket is split over
    layers: int = 0  # leading layer axis of every array of a stacked buffer (0: none)

    @property
    def lead(self) -> tuple[int, ...]:
        """Leading dims of this buffer's arrays: ``(layers,)`` when stacked, else ``()``."""
        return (self.layers,) if self.layers else ()


class PieceRange(NamedTuple):
    """The three ranges Megatron keeps for a piece of a param owned by one rank.

    Attributes:
      slot: index into ``Layout.slots``.
      buffer: buffer index.
      in_buffer: ``(start, end)`` in the whole buffer.
      in_shard: ``(start, end)`` in the rank's local shard of that buffer.
      in_param: ``(start, end)`` in the flattened parameter.
    """

    slot: int
    buffer: int
    in_buffer: tuple[int, int]
    in_shard: tuple[int, int]
    in_param: tuple[int, int]

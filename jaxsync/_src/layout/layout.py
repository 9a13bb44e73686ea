"""Static layout of parameters in flat, bucketed, shardable buffers.

The layout is the one place that decides where every parameter element lives:
which buffer (one per ``BufferKey``), which bucket, at which offset, and which
rank owns which slice. It is computed from shapes and dtypes only, so it is
hashable, cacheable and identical on every host; flatten, unflatten, the
collectives, the sharded optimizer, checkpoints and reports all read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .records import Buffer, ParamSlot, PieceRange

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Layout:
    """Frozen, hashable placement of a parameter tree in flat buffers.

    Build one with :func:`build_layout`. Each buffer knows the number of ranks
    its buckets are split over (1 for plain all-reduce data parallelism).
    """

    treedef: Any
    slots: tuple[ParamSlot, ...]
    buffers: tuple[Buffer, ...]
    bucket_size: int | None

    # ---------------------------------------------------------------- sizes
    @property
    def num_shards(self) -> int:
        """The shard count shared by all buffers (an error if they differ)."""
        counts = {b.num_shards for b in self.buffers}
        if len(counts) != 1:
            raise ValueError(
                f"buffers of this layout are split over different numbers of ranks "
                f"({sorted(counts)}); use `layout.buffers[i].num_shards`."
            )
        return counts.pop()

    def shard_size(self, buffer: int) -> int:
        """Elements of ``buffer`` that one rank owns."""
        return self.buffers[buffer].size // self.buffers[buffer].num_shards

    def bucket_shard_offsets(self, buffer: int) -> tuple[int, ...]:
        """Offset of each bucket's per-rank piece inside the rank's local shard."""
        n = self.buffers[buffer].num_shards
        out, acc = [], 0
        for b in self.buffers[buffer].buckets:
            out.append(acc)
            acc += b.size // n
        return tuple(out)

    @property
    def num_params(self) -> int:
        """Parameter elements (a stacked leaf counts all its layers)."""
        return sum(s.size * max(s.layers, 1) for s in self.slots)

    @property
    def num_buckets(self) -> int:
        return sum(len(b.buckets) for b in self.buffers)

    def stacks(self) -> dict[str, tuple[int, ...]]:
        """Stacked-layer groups: ``{group name: indices of its buffers}``."""
        out: dict[str, list[int]] = {}
        for bi, buf in enumerate(self.buffers):
            if buf.key.stack is not None:
                out.setdefault(buf.key.stack, []).append(bi)
        return {k: tuple(v) for k, v in out.items()}

    def layer_bytes(self, groups: Any, dtype: Any = None) -> int:
        """Bytes of one layer of the largest of the stacked ``groups``, in ``dtype``
        (default: each buffer's own); 0 without one. A step that gathers its layers
        lets XLA combine one layer's all-gathers up to this size."""
        stacks = self.stacks()
        return max(
            (sum(self.buffers[bi].size * jnp.dtype(dtype or self.buffers[bi].key.dtype).itemsize
                 for bi in stacks[g]) for g in groups if g in stacks),
            default=0,
        )  # fmt: skip

    # --------------------------------------------------------------- ranges
    def shard_ranges(self, rank: int) -> tuple[PieceRange, ...]:
        """Per param piece owned by ``rank``: its buffer, shard and param ranges.

        For stacked buffers the ranges are those of one layer's row; rank ``rank``
        owns the same range of every layer.
        """
        out = []
        for bi, buf in enumerate(self.buffers):
            if not 0 <= rank < buf.num_shards:
                raise ValueError(f"`rank` must be in [0, {buf.num_shards}), got {rank}.")
            offsets = self.bucket_shard_offsets(bi)
            for bucket, shard_off in zip(buf.buckets, offsets, strict=True):
                k = bucket.size // buf.num_shards
                lo, hi = bucket.start + rank * k, bucket.start + (rank + 1) * k
                for si in bucket.slots:
                    slot = self.slots[si]
                    for start, layer in slot.spans():
                        s, e = max(lo, start), min(hi, start + slot.size)
                        if s >= e:
                            continue
                        base = start - (layer or 0) * slot.size  # in the flattened param
                        out.append(
                            PieceRange(
                                slot=si,
                                buffer=bi,
                                in_buffer=(s, e),
                                in_shard=(shard_off + s - lo, shard_off + e - lo),
                                in_param=(s - base, e - base),
                            )
                        )
        return tuple(out)

    # ------------------------------------------------------ flatten/unflatten
    def check_tree(self, tree: PyTree, what: str = "tree") -> list[Any]:
        """Leaves of ``tree`` after checking it has this layout's structure."""
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"`{what}` does not have the structure this layout was built for.\n"
                f"  expected: {self.treedef}\n  received: {treedef}\n"
                "Build the layout from the same params pytree you pass here."
            )
        for slot, leaf in zip(self.slots, leaves, strict=True):
            if tuple(np.shape(leaf)) != slot.shape:
                raise ValueError(
                    f"`{what}` leaf {slot.path} has shape {tuple(np.shape(leaf))}, "
                    f"but the layout expects {slot.shape}."
                )
        return leaves

    def pack_leaves(
        self,
        leaves: Sequence[Any],
        buffers: Sequence[int],
        dtype: Any = None,
        *,
        rows: bool = False,
    ) -> tuple[tuple[jax.Array, ...], ...]:
        """Bucket arrays of the given ``buffers`` from leaves indexed like ``slots``.

        Args:
          leaves: one array per slot (entries of other buffers are not read).
          buffers: which buffers to pack, in the order returned.
          dtype: cast to this dtype; default: each buffer's dtype.
          rows: the leaves are one layer's slices of stacked leaves (as a scanned
            layer body sees them), so the buckets are 1-D per-layer rows.
        """
        out = []
        for bi in buffers:
            buf = self.buffers[bi]
            dt = jnp.dtype(dtype or buf.key.dtype)
            lead = () if rows else buf.lead
            buckets = []
            for bucket in buf.buckets:
                pieces = []
                for si in bucket.slots:
                    slot = self.slots[si]
                    if slot.pieces:  # an owned stacked leaf: one piece per layer
                        rows_of = jnp.reshape(leaves[si], (slot.layers, slot.size)).astype(dt)
                        pieces += [
                            (p, rows_of[layer])
                            for p, layer in slot.spans()
                            if bucket.start <= p < bucket.end
                        ]
                    else:
                        x = jnp.reshape(leaves[si], (*lead, slot.size)).astype(dt)
                        pieces.append((slot.start, x))
                parts, pos = [], bucket.start
                for start, x in sorted(pieces, key=lambda t: t[0]):
                    if start > pos:
                        parts.append(jnp.zeros((*lead, start - pos), dt))
                    parts.append(x)
                    pos = start + x.shape[-1]
                if bucket.end > pos:
                    parts.append(jnp.zeros((*lead, bucket.end - pos), dt))
                buckets.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1))
            out.append(tuple(buckets))
        return tuple(out)

    def unpack_leaves(
        self,
        buckets: Sequence[Sequence[jax.Array]],
        buffers: Sequence[int],
        dtype: Any = None,
        *,
        rows: bool = False,
    ) -> dict[int, jax.Array]:
        """Inverse of :meth:`pack_leaves`: ``{slot index: leaf}`` of those buffers."""
        leaves = {}
        rows_by_slot: dict[int, dict[int, jax.Array]] = {}
        for bi, arrays in zip(buffers, buckets, strict=True):
            buf = self.buffers[bi]
            for bucket, arr in zip(buf.buckets, arrays, strict=True):
                for si in bucket.slots:
                    slot = self.slots[si]
                    if slot.pieces:  # owned layers may lie in several buckets
                        for layer, p in enumerate(slot.pieces):
                            if bucket.start <= p < bucket.end:
                                lo = p - bucket.start
                                rows_by_slot.setdefault(si, {})[layer] = arr[lo : lo + slot.size]
                        continue
                    lo = slot.start - bucket.start
                    shape = slot.row_shape if rows else slot.shape
                    piece = arr[..., lo : lo + slot.size].reshape(shape)
                    leaves[si] = piece.astype(dtype or slot.dtype)
        for si, by_layer in rows_by_slot.items():
            slot = self.slots[si]
            stacked = jnp.stack([by_layer[k] for k in range(slot.layers)]).reshape(slot.shape)
            leaves[si] = stacked.astype(dtype or slot.dtype)
        return leaves

    def pack(self, tree: PyTree, dtype: Any = None) -> tuple[tuple[jax.Array, ...], ...]:
        """Bucket arrays per buffer: ``out[buffer][bucket]``, padding zero-filled.

        Buckets of a stacked buffer are ``[layers, bucket size]``.

        Args:
          tree: a pytree with this layout's structure.
          dtype: cast every element to this dtype; default: each buffer's dtype.
        """
        return self.pack_leaves(self.check_tree(tree), range(len(self.buffers)), dtype)

    def unpack(self, buckets: Sequence[Sequence[jax.Array]], dtype: Any = None) -> PyTree:
        """Inverse of :meth:`pack`; leaves get their param dtype unless ``dtype``."""
        by_slot = self.unpack_leaves(buckets, range(len(self.buffers)), dtype)
        return jax.tree.unflatten(self.treedef, [by_slot[i] for i in range(len(self.slots))])

    def flatten(self, tree: PyTree, dtype: Any = None) -> tuple[jax.Array, ...]:
        """One flat array per buffer: ``[size]``, or ``[layers, size]`` when stacked."""
        return tuple(
            b[0] if len(b) == 1 else jnp.concatenate(b, axis=-1) for b in self.pack(tree, dtype)
        )

    def unflatten(self, flat: Sequence[jax.Array], dtype: Any = None) -> PyTree:
        """Inverse of :meth:`flatten`."""
        if len(flat) != len(self.buffers):
            raise ValueError(
                f"`flat` holds {len(flat)} arrays; this layout has {len(self.buffers)} buffers."
            )
        return self.unpack(
            [
                [f[..., b.start : b.end] for b in buf.buckets]
                for f, buf in zip(flat, self.buffers, strict=True)
            ],
            dtype,
        )

    def split_shard(self, buffer: int, shard: jax.Array) -> list[jax.Array]:
        """Cut a rank's local shard of ``buffer`` into its per-bucket pieces (last axis)."""
        pieces, off = [], 0
        n = self.buffers[buffer].num_shards
        for b in self.buffers[buffer].buckets:
            k = b.size // n
            pieces.append(shard[..., off : off + k])
            off += k
        return pieces

    def shard_of(self, buffer: int, flat: jax.Array, rank: jax.Array | int) -> jax.Array:
        """Rank ``rank``'s local shard of a full flat ``buffer`` (rank may be traced)."""
        pieces = []
        n = self.buffers[buffer].num_shards
        for b in self.buffers[buffer].buckets:
            k = b.size // n
            pieces.append(jax.lax.dynamic_slice_in_dim(flat, b.start + rank * k, k, axis=-1))
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)

    def gather_shards(self, buffer: int, stacked: jax.Array) -> jax.Array:
        """Full flat buffer from all ranks' shards stacked as ``(num_shards, ..., shard)``."""
        parts, off = [], 0
        n = self.buffers[buffer].num_shards
        for b in self.buffers[buffer].buckets:
            k = b.size // n
            piece = jnp.moveaxis(stacked[..., off : off + k], 0, -2)  # (..., n, k)
            parts.append(piece.reshape(*piece.shape[:-2], n * k))
            off += k
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

    # --------------------------------------------------------------- report
    def summary(self) -> str:
        """A human-readable table of buffers, buckets, sizes and padding."""
        shards = sorted({b.num_shards for b in self.buffers})
        lines = [
            f"Layout: {len(self.slots)} params, {self.num_params:,} elements, "
            f"{len(self.buffers)} buffers, {self.num_buckets} buckets, "
            f"{'/'.join(map(str, shards))} shards"
        ]
        for bi, buf in enumerate(self.buffers):
            pad = buf.size - buf.used
            key = buf.key
            lines.append(
                f"  buffer {bi} dtype={key.dtype} axes={key.axes} label={key.label}"
                + (f" sum={key.sum_axes}" if key.sum_axes else "")
                + (f" mean={key.mean_axes}" if key.mean_axes else "")
                + (f" varying={key.varying}" if key.varying else "")
                + (f" stack={key.stack} x{buf.layers}" if key.stack else "")
                + (" owned" if key.owned is not None else "")
                + ": "
                f"{buf.size:,} elements ({buf.used:,} used, {pad:,} padding), "
                f"{len(buf.buckets)} buckets, shard {self.shard_size(bi):,}"
            )
            for ki, b in enumerate(buf.buckets):
                names = ", ".join(self.slots[s].path for s in b.slots)
                if len(names) > 80:
                    names = names[:77] + "..."
                lines.append(
                    f"    bucket {ki}: [{b.start:,}, {b.end:,}) {len(b.slots)} params: {names}"
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

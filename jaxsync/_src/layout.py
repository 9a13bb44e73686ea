"""Static layout of parameters in flat, bucketed, shardable buffers.

The layout is the one place that decides where every parameter element lives:
which buffer (one per ``BufferKey``), which bucket, at which offset, and which
rank owns which slice. It is computed from shapes and dtypes only, so it is
hashable, cacheable and identical on every host; flatten, unflatten, the
collectives, the sharded optimizer, checkpoints and reports all read it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

#: Param starts are aligned to this many elements when sharding (as Megatron
#: does), so a parameter never starts in the middle of a cache line.
PARAM_ALIGNMENT = 64
#: Buckets are padded to a multiple of lcm(num_shards, this) when sharding.
BUCKET_ALIGNMENT = 128


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
    """

    dtype: str
    axes: tuple[str, ...] = ()
    label: str | None = None
    sum_axes: tuple[tuple[str, tuple[tuple[int, ...], ...] | None], ...] = ()
    mean_axes: tuple[str, ...] = ()
    varying: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter leaf lives in its buffer."""

    path: str
    leaf_index: int
    shape: tuple[int, ...]
    dtype: str
    buffer: int
    bucket: int
    start: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

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


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


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
        return sum(s.size for s in self.slots)

    @property
    def num_buckets(self) -> int:
        return sum(len(b.buckets) for b in self.buffers)

    # --------------------------------------------------------------- ranges
    def shard_ranges(self, rank: int) -> tuple[PieceRange, ...]:
        """Per param piece owned by ``rank``: its buffer, shard and param ranges."""
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
                    s, e = max(lo, slot.start), min(hi, slot.end)
                    if s >= e:
                        continue
                    out.append(
                        PieceRange(
                            slot=si,
                            buffer=bi,
                            in_buffer=(s, e),
                            in_shard=(shard_off + s - lo, shard_off + e - lo),
                            in_param=(s - slot.start, e - slot.start),
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

    def pack(self, tree: PyTree, dtype: Any = None) -> tuple[tuple[jax.Array, ...], ...]:
        """Bucket arrays per buffer: ``out[buffer][bucket]``, padding zero-filled.

        Args:
          tree: a pytree with this layout's structure.
          dtype: cast every element to this dtype; default: each buffer's dtype.
        """
        leaves = self.check_tree(tree)
        out = []
        for buf in self.buffers:
            dt = jnp.dtype(dtype or buf.key.dtype)
            buckets = []
            for bucket in buf.buckets:
                parts, pos = [], bucket.start
                for si in bucket.slots:
                    slot = self.slots[si]
                    if slot.start > pos:
                        parts.append(jnp.zeros((slot.start - pos,), dt))
                    parts.append(jnp.ravel(leaves[si]).astype(dt))
                    pos = slot.end
                if bucket.end > pos:
                    parts.append(jnp.zeros((bucket.end - pos,), dt))
                buckets.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
            out.append(tuple(buckets))
        return tuple(out)

    def unpack(self, buckets: Sequence[Sequence[jax.Array]], dtype: Any = None) -> PyTree:
        """Inverse of :meth:`pack`; leaves get their param dtype unless ``dtype``."""
        leaves: list[Any] = [None] * len(self.slots)
        for buf, arrays in zip(self.buffers, buckets, strict=True):
            for bucket, arr in zip(buf.buckets, arrays, strict=True):
                for si in bucket.slots:
                    slot = self.slots[si]
                    lo = slot.start - bucket.start
                    piece = arr[lo : lo + slot.size].reshape(slot.shape)
                    leaves[si] = piece.astype(dtype or slot.dtype)
        return jax.tree.unflatten(self.treedef, leaves)

    def flatten(self, tree: PyTree, dtype: Any = None) -> tuple[jax.Array, ...]:
        """One flat array per buffer, of length ``buffer.size``."""
        return tuple(b[0] if len(b) == 1 else jnp.concatenate(b) for b in self.pack(tree, dtype))

    def unflatten(self, flat: Sequence[jax.Array], dtype: Any = None) -> PyTree:
        """Inverse of :meth:`flatten`."""
        if len(flat) != len(self.buffers):
            raise ValueError(
                f"`flat` holds {len(flat)} arrays; this layout has {len(self.buffers)} buffers."
            )
        return self.unpack(
            [
                [f[b.start : b.end] for b in buf.buckets]
                for f, buf in zip(flat, self.buffers, strict=True)
            ],
            dtype,
        )

    def split_shard(self, buffer: int, shard: jax.Array) -> list[jax.Array]:
        """Cut a rank's local shard of ``buffer`` into its per-bucket pieces."""
        pieces, off = [], 0
        n = self.buffers[buffer].num_shards
        for b in self.buffers[buffer].buckets:
            k = b.size // n
            pieces.append(shard[off : off + k])
            off += k
        return pieces

    def shard_of(self, buffer: int, flat: jax.Array, rank: jax.Array | int) -> jax.Array:
        """Rank ``rank``'s local shard of a full flat ``buffer`` (rank may be traced)."""
        pieces = []
        n = self.buffers[buffer].num_shards
        for b in self.buffers[buffer].buckets:
            k = b.size // n
            pieces.append(jax.lax.dynamic_slice_in_dim(flat, b.start + rank * k, k))
        return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)

    def gather_shards(self, buffer: int, stacked: jax.Array) -> jax.Array:
        """Full flat buffer from all ranks' shards stacked as ``(num_shards, shard)``."""
        parts, off = [], 0
        n = self.buffers[buffer].num_shards
        for b in self.buffers[buffer].buckets:
            k = b.size // n
            parts.append(stacked[:, off : off + k].reshape(-1))
            off += k
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

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


KeyFn = Callable[[str, Any], BufferKey]

EMPTY_TREE = (
    "`params` has no array leaves: there is nothing to lay out. Pass the model's "
    "parameter pytree (arrays or jax.ShapeDtypeStruct)."
)


def _default_key(path: str, leaf: Any) -> BufferKey:
    del path
    return BufferKey(dtype=jnp.dtype(leaf.dtype).name)


def check_bucket_size(bucket_size: int | None) -> int | None:
    """``bucket_size`` as an int: a positive element count (numpy ints too, never a
    bool), or None for one bucket."""
    if bucket_size is None:
        return None
    if isinstance(bucket_size, bool | np.bool_) or not isinstance(bucket_size, int | np.integer):
        raise ValueError(
            f"`bucket_size` must be a positive number of elements or None (one bucket "
            f"per buffer), got {bucket_size!r} ({type(bucket_size).__name__})."
        )
    if bucket_size <= 0:
        raise ValueError(
            f"`bucket_size` must be a positive number of elements or None (one bucket "
            f"per buffer), got {bucket_size!r}."
        )
    return int(bucket_size)


def build_layout(
    params: PyTree,
    *,
    num_shards: int | Callable[[BufferKey], int] = 1,
    bucket_size: int | None = None,
    key_fn: KeyFn | None = None,
) -> Layout:
    """Lays out ``params`` in per-key flat buffers cut into buckets.

    Params are placed in reverse tree order, because backprop produces the last
    layers' gradients first, so the first bucket is ready first. When
    ``num_shards > 1`` param starts are aligned to 64 elements and each bucket
    is padded to a multiple of ``lcm(num_shards, 128)``, so rank ``r`` owns the
    ``r``-th equal slice of every bucket.

    Args:
      params: pytree of arrays or ``jax.ShapeDtypeStruct`` (floating dtypes only).
      num_shards: ranks each bucket is split over (1: plain all-reduce), or a
        function of the buffer's key (expert buffers are split over fewer ranks).
      bucket_size: a bucket closes once it holds at least this many elements
        (a param that crosses the limit stays whole); ``None``: one bucket per buffer.
      key_fn: ``(path, leaf) -> BufferKey``; default groups by dtype alone.

    Returns:
      A hashable :class:`Layout`, cached on its inputs' shapes and dtypes.

    Example:
      >>> layout = build_layout({"w": jnp.zeros((3, 4))}, num_shards=2)
      >>> layout.buffers[0].size
      128
    """
    shards_of = num_shards if callable(num_shards) else (lambda _key: num_shards)
    bucket_size = check_bucket_size(bucket_size)
    key_fn = key_fn or _default_key
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not path_leaves:
        raise ValueError(EMPTY_TREE)
    specs = []
    for path, leaf in path_leaves:
        name = jax.tree_util.keystr(path)
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"param {name} has dtype {dtype} and shape {tuple(np.shape(leaf))}; "
                "only floating-point leaves can be trained and synced. Keep integer "
                "state (step counters, rng keys, masks) outside the params pytree."
            )
        key = key_fn(name, leaf)
        if not isinstance(key, BufferKey):
            raise TypeError(f"`key_fn` must return a BufferKey, got {key!r} for {name}.")
        specs.append((name, tuple(int(d) for d in np.shape(leaf)), jnp.dtype(dtype).name, key))
    shards = {}
    for *_, key in specs:
        if key not in shards:
            n = shards_of(key)
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"`num_shards` must be a positive int, got {n!r} for {key}.")
            shards[key] = n
    return _build(tuple(specs), treedef, tuple(shards.items()), bucket_size)


@functools.lru_cache(maxsize=256)
def _build(
    specs: tuple[tuple[str, tuple[int, ...], str, BufferKey], ...],
    treedef: Any,
    shards: tuple[tuple[BufferKey, int], ...],
    bucket_size: int | None,
) -> Layout:
    shards_of = dict(shards)
    keys: list[BufferKey] = []
    members: dict[BufferKey, list[int]] = {}
    for i in reversed(range(len(specs))):  # reverse tree order
        key = specs[i][3]
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(i)

    slots: list[ParamSlot | None] = [None] * len(specs)
    buffers = []
    for bi, key in enumerate(keys):
        num_shards = shards_of[key]
        sharded = num_shards > 1
        param_align = PARAM_ALIGNMENT if sharded else 1
        bucket_align = math.lcm(num_shards, BUCKET_ALIGNMENT) if sharded else 1
        buckets: list[Bucket] = []
        pos, bstart, current = 0, 0, []
        for n, i in enumerate(members[key]):
            name, shape, dtype, _ = specs[i]
            start = _round_up(pos, param_align)
            slots[i] = ParamSlot(name, i, shape, dtype, bi, len(buckets), start)
            current.append(i)
            pos = start + math.prod(shape)
            last = n == len(members[key]) - 1
            if last or (bucket_size is not None and pos - bstart >= bucket_size):
                # Close the bucket: pad it so every rank owns an equal slice.
                end = bstart + _round_up(max(pos - bstart, 1), bucket_align)
                buckets.append(Bucket(start=bstart, end=end, slots=tuple(current)))
                pos = bstart = end
                current = []
        buffers.append(
            Buffer(
                key=key,
                size=pos,
                used=sum(math.prod(specs[i][1]) for i in members[key]),
                buckets=tuple(buckets),
                slots=tuple(members[key]),
                num_shards=num_shards,
            )
        )
    return Layout(
        treedef=treedef,
        slots=tuple(s for s in slots if s is not None),
        buffers=tuple(buffers),
        bucket_size=bucket_size,
    )

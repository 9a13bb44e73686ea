"""Building a :class:`~jaxsync.Layout`: which buffer, bucket and offset each param gets.

Placement is computed from shapes and dtypes only and cached, so every host
builds the same layout and a traced step never rebuilds it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.names import group_of, param_name
from .layout import Layout
from .ownership import place_owned
from .records import Bucket, Buffer, BufferKey, ParamSlot

PyTree = Any

#: Param starts are aligned to this many elements when sharding (as Megatron
#: does), so a parameter never starts in the middle of a cache line.
PARAM_ALIGNMENT = 64
#: Buckets are padded to a multiple of lcm(num_shards, this) when sharding.
BUCKET_ALIGNMENT = 128

KeyFn = Callable[[str, Any], BufferKey]

EMPTY_TREE = (
    "`params` has no array leaves: there is nothing to lay out. Pass the model's "
    "parameter pytree (arrays or jax.ShapeDtypeStruct)."
)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


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


def normalize_stacked(stacked: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"blocks"`` -> ``("blocks",)``; checks the names are non-empty strings."""
    if stacked is None:
        return ()
    names = (stacked,) if isinstance(stacked, str) else tuple(stacked)
    if not all(isinstance(s, str) and s for s in names):
        raise TypeError(
            f"`stacked` must be a dotted param-name prefix (e.g. 'blocks') or a sequence "
            f"of them, got {stacked!r}."
        )
    return names


def stack_layers(params: PyTree, stacked: Sequence[str]) -> dict[str, int]:
    """Layer count of each stacked group, checking every leaf of a group has it.

    A stacked group is a subtree whose leaves all carry the same leading layer
    axis (as ``lax.scan``/``nnx.scan`` consume them).
    """
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
    layers: dict[str, int] = {}
    for name, shape in zip(names, shapes, strict=True):
        group = group_of(name, stacked)
        if group is None:
            continue
        if not shape:
            raise ValueError(
                f"param {name} is a scalar, but it lies in stacked group {group!r}, whose "
                "leaves need a leading layer axis. Stack it per layer (shape (layers,)) or "
                "keep it outside the group."
            )
        if layers.setdefault(group, shape[0]) != shape[0]:
            raise ValueError(
                f"stacked group {group!r} mixes layer counts: param {name} has leading "
                f"dim {shape[0]}, other params of the group have {layers[group]}. Every "
                "leaf of a scanned stack needs the same leading layer axis."
            )
    empty = [g for g in stacked if g not in layers]
    if empty:
        raise ValueError(
            f"`stacked` names {empty}, which match no params; param names look like "
            f"{names[:6]}. Use dotted prefixes as jaxsync.param_name prints them."
        )
    return layers


def build_layout(
    params: PyTree,
    *,
    num_shards: int | Callable[[BufferKey], int] = 1,
    bucket_size: int | None = None,
    key_fn: KeyFn | None = None,
    stacked: str | Sequence[str] | None = None,
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
        (a param that crosses the limit stays whole); ``None``: one bucket per
        buffer. For stacked groups the count is per layer.
      key_fn: ``(path, leaf) -> BufferKey``; default groups by dtype alone.
      stacked: dotted name prefixes of stacked-layer groups (``"blocks"``):
        subtrees whose leaves share a leading layer axis ``L``. Each group gets
        buffers of its own, laid out per layer (``[L, size]`` arrays), so one
        layer's gradients can be synced inside the scan that computes them.

    Returns:
      A hashable :class:`Layout`, cached on its inputs' shapes and dtypes.

    Example:
      >>> layout = build_layout({"w": jnp.zeros((3, 4))}, num_shards=2)
      >>> layout.buffers[0].size
      128
    """
    shards_of = num_shards if callable(num_shards) else (lambda _key: num_shards)
    bucket_size = check_bucket_size(bucket_size)
    groups = normalize_stacked(stacked)
    key_fn = key_fn or _default_key
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not path_leaves:
        raise ValueError(EMPTY_TREE)
    layers = stack_layers(params, groups) if groups else {}
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
        group = group_of(param_name(path), groups)
        if group is not None and key.owned is None:
            key = key._replace(stack=group)  # owned layers are synced after the scan
        shape = tuple(int(d) for d in np.shape(leaf))
        specs.append((name, shape, jnp.dtype(dtype).name, key, layers.get(group, 0)))
    shards = {}
    for spec in specs:
        key = spec[3]
        if key not in shards:
            n = shards_of(key)
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"`num_shards` must be a positive int, got {n!r} for {key}.")
            shards[key] = n
    return _build(tuple(specs), treedef, tuple(shards.items()), bucket_size)


@functools.lru_cache(maxsize=256)
def _build(
    specs: tuple[tuple[str, tuple[int, ...], str, BufferKey, int], ...],
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
    # Buffers that differ only in their part (one param each) lie side by side, so
    # the buffers of one label form one range of a rank's shard.
    first = {}
    for k in keys:
        first.setdefault(k._replace(part=None), len(first))
    keys.sort(key=lambda k: first[k._replace(part=None)])

    slots: list[ParamSlot | None] = [None] * len(specs)
    buffers = []
    for bi, key in enumerate(keys):
        num_shards = shards_of[key]
        if key.owned is not None:  # whole matrices, each in its owner's shard
            placed, buf = place_owned(specs, members[key], bi, num_shards, bucket_size)
            for i, slot in placed.items():
                slots[i] = slot
            buffers.append(buf)
            continue
        sharded = num_shards > 1
        param_align = PARAM_ALIGNMENT if sharded else 1
        bucket_align = math.lcm(num_shards, BUCKET_ALIGNMENT) if sharded else 1
        buckets: list[Bucket] = []
        pos, bstart, current = 0, 0, []
        used = 0
        for n, i in enumerate(members[key]):
            name, shape, dtype, _, layers = specs[i]
            start = _round_up(pos, param_align)
            slot = ParamSlot(name, i, shape, dtype, bi, len(buckets), start, layers)
            slots[i] = slot
            current.append(i)
            pos = start + slot.size
            used += slot.size
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
                used=used,
                buckets=tuple(buckets),
                slots=tuple(members[key]),
                num_shards=num_shards,
                layers=specs[members[key][0]][4],
            )
        )
    return Layout(
        treedef=treedef,
        slots=tuple(s for s in slots if s is not None),
        buffers=tuple(buffers),
        bucket_size=bucket_size,
    )

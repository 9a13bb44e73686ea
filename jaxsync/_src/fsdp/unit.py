"""FSDP units: which params each one holds, and its flat buffer split by optimizer label.

A unit's params of each label lie in a buffer of their own, padded to split
evenly over the ranks; a rank's shard of the unit is its piece of every buffer,
one after the other. So each label's optimizer runs on a static slice of the
shard (its state exists once per element, never once per label), and the unit
still costs one all-gather and one reduce-scatter: the collectives see the
*rank-major* array ``[rank 0's pieces | rank 1's pieces | ...]``, which
:class:`UnitFlat` regroups into the buffers' flat arrays and back. Without
labels a unit has one buffer and every move here is the identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core.names import group_of, in_group, param_name
from ..layout.layout import Layout
from ..layout.placement import build_layout
from ..layout.records import BufferKey

PyTree = Any


@dataclasses.dataclass(frozen=True)
class UnitFlat:
    """A unit's layout (one buffer per label, one bucket each) over ``num_shards`` ranks.

    Arrays here carry the layout's leading layer axis for a stacked unit
    (``[layers, ...]``) unless ``rows``: one layer's row, as a scanned body sees it.
    """

    layout: Layout
    num_shards: int
    names: tuple[str, ...]  # the params' dotted names, in the layout's leaf order

    def __post_init__(self) -> None:
        # One bucket per buffer: a buffer's flat array is then the rank-major
        # concatenation of its shards, which every move below relies on.
        assert all(len(b.buckets) == 1 for b in self.layout.buffers), self.layout

    @property
    def widths(self) -> tuple[int, ...]:
        """Elements of each buffer in one rank's shard."""
        return tuple(self.layout.shard_size(bi) for bi in range(len(self.layout.buffers)))

    @property
    def shard_size(self) -> int:
        """Elements of one rank's shard of the unit (all labels, padding included)."""
        return sum(self.widths)

    @property
    def lead(self) -> tuple[int, ...]:
        """``(layers,)`` for a stacked unit, else ``()``."""
        return self.layout.buffers[0].lead

    def pieces(self) -> tuple[tuple[str | None, int, int], ...]:
        """``(label, start, end)`` of each label's piece in a rank's shard (a label's
        buffers lie side by side: one piece each)."""
        out: list[tuple[str | None, int, int]] = []
        start = 0
        for buf, w in zip(self.layout.buffers, self.widths, strict=True):
            label = buf.key.label
            if out and out[-1][0] == label:
                out[-1] = (label, out[-1][1], start + w)
            else:
                assert all(lab != label for lab, _, _ in out), self.layout  # one piece each
                out.append((label, start, start + w))
            start += w
        return tuple(out)

    def label_buffers(self, label: str | None) -> tuple[int, ...]:
        """Indices of ``label``'s buffers (side by side in the shard)."""
        return tuple(bi for bi, b in enumerate(self.layout.buffers) if b.key.label == label)

    def to_buffers(
        self, x: jax.Array, buffers: Sequence[int] | None = None
    ) -> tuple[jax.Array, ...]:
        """Rank-major ``[..., num_shards * width]`` -> each buffer's flat array; ``x``
        holds ``buffers`` (side by side; default: all of them)."""
        bis = range(len(self.widths)) if buffers is None else buffers
        widths = [self.widths[bi] for bi in bis]
        if len(widths) == 1:
            return (x,)
        lead, n = x.shape[:-1], self.num_shards
        ranks = x.reshape(*lead, n, sum(widths))
        out, lo = [], 0
        for w in widths:
            out.append(ranks[..., lo : lo + w].reshape(*lead, n * w))
            lo += w
        return tuple(out)

    def from_buffers(
        self, flats: Sequence[jax.Array], buffers: Sequence[int] | None = None
    ) -> jax.Array:
        """Inverse of :meth:`to_buffers`."""
        bis = range(len(self.widths)) if buffers is None else buffers
        widths = [self.widths[bi] for bi in bis]
        if len(flats) == 1:
            return flats[0]
        lead, n = flats[0].shape[:-1], self.num_shards
        ranks = [f.reshape(*lead, n, w) for f, w in zip(flats, widths, strict=True)]
        return jnp.concatenate(ranks, axis=-1).reshape(*lead, n * sum(widths))

    def flatten(self, tree: PyTree, dtype: Any) -> jax.Array:
        """The unit's ``{param name: array}`` as one rank-major flat array (global shards)."""
        return self.from_buffers(self.layout.flatten(tree, dtype))

    def unflatten(self, x: jax.Array, dtype: Any) -> dict[str, jax.Array]:
        """Inverse of :meth:`flatten` (a gathered unit, or the global shards)."""
        return self.layout.unflatten(self.to_buffers(x), dtype)

    def unflatten_row(self, flats: Sequence[jax.Array], dtype: Any) -> dict[str, jax.Array]:
        """One layer of a stacked unit from its buffers' gathered rows (one flat
        array per buffer, as :func:`.gather.gather_pieces` returns them):
        ``{param name: array}``. A param that fills its buffer is a reshape of it."""
        nb = len(flats)
        by_slot = self.layout.unpack_leaves([[f] for f in flats], range(nb), dtype, rows=True)
        return jax.tree.unflatten(self.layout.treedef, [by_slot[i] for i in range(len(by_slot))])


def check_units(units: Any, stacked: Sequence[str]) -> None:
    """``units``: distinct dotted name prefixes (strings), at least one with ``stacked``."""
    if isinstance(units, str):
        raise TypeError(f"`units` must be a list of name prefixes, got the string {units!r}.")
    if not units and not stacked:
        raise ValueError("`units` is empty; name at least one unit (a param-name prefix).")
    bad = [u for u in units if not isinstance(u, str)]
    dup = sorted({u for u in units if list(units).count(u) > 1})
    if bad or dup:
        raise ValueError(
            f"`units` must be distinct param-name prefixes (strings); got non-strings {bad}"
            if bad
            else f"`units` must be distinct param-name prefixes; {dup} appear more than once."
        )


def assign_units(
    names: Sequence[str], units: Sequence[str], stacked: Sequence[str]
) -> dict[str, tuple[int, ...]]:
    """``{unit: leaf indices}``: each param goes to the longest unit prefixing its
    name; a param of a stacked group to the group (a scanned stack is never split)."""
    unit_of = []
    for name in names:
        group = group_of(name, stacked)
        hits = [group] if group is not None else [u for u in units if in_group(name, u)]
        if not hits:
            raise ValueError(
                f"param {name} belongs to no unit; `units` are {list(units)}. Add a "
                "unit that is a prefix of its dotted name (or the name itself)."
            )
        unit_of.append(max(hits, key=len))
    empty = [u for u in units if u not in unit_of]
    if empty:
        raise ValueError(f"units {empty} hold no params; param names look like {list(names[:6])}.")
    return {u: tuple(i for i, x in enumerate(unit_of) if x == u) for u in units}


def unit_flat(
    shapes: Mapping[str, tuple[int, ...]],
    labels: Mapping[str, str] | None,
    key: BufferKey,
    num_shards: int,
    *,
    stacked: str | None,
) -> UnitFlat:
    """The :class:`UnitFlat` of a unit's params (``{dotted name: shape}``), fp32,
    one buffer per label (``key`` with each param's label); ``stacked``: the
    unit's name when it is a stacked group, whose params each get a buffer of
    their own (a rank's shard is then a piece of every param, gathered param by
    param: :func:`.gather.gather_pieces`)."""
    sub = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in shapes.items()}
    by_path = {jax.tree_util.keystr((jax.tree_util.DictKey(n),)): n for n in shapes}

    def key_fn(path: str, _leaf: Any) -> BufferKey:
        name = by_path[path]
        return key._replace(label=labels[name] if labels else None, part=name if stacked else None)

    layout = build_layout(sub, num_shards=num_shards, key_fn=key_fn, stacked=stacked)
    order = tuple(param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(sub)[0])
    return UnitFlat(layout, num_shards, order)

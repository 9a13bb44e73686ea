"""Whole-matrix ownership: which data-parallel rank owns which matrix, balanced by cost.

Optimizers that are not elementwise (Muon's Newton-Schulz, Adafactor's factored
second moment, Shampoo's preconditioners) need a whole matrix, so flat shards
that cut params apart cannot run them. Instead each param routed to such an
optimizer (each *layer* of a stacked ``[L, m, n]`` param) is owned whole by one
rank, as in Megatron-Core's ``LayerWiseDistributedOptimizer``. Owners are chosen
by LPT bin-packing on an estimated cost (most expensive matrix first, onto the
least loaded rank), so a rank holding one large matrix gets fewer small ones.

The placement is static (shapes only) and lives in the flat-buffer layout: an
owned buffer is cut into ``N`` equal shards, and each rank's matrices lie whole
and contiguous in its own shard (padded to the largest shard). So the usual
bucketed reduce-scatter delivers each matrix's reduced gradient to its owner,
and the usual all-gather returns the new params.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import optax

from ..core.introspect import factories
from .records import Bucket, Buffer, BufferKey, ParamSlot

PyTree = Any
Cost = str | Callable[[tuple[int, ...]], float]

#: Named cost models: estimated work of the inner update on one matrix.
COSTS: dict[str, Callable[[tuple[int, ...]], float]] = {
    # Newton-Schulz: a few (m x n) @ (n x m) products, ~ m * n * min(m, n) each.
    "muon": lambda s: float(math.prod(s)) * (min(s[-2:]) if len(s) >= 2 else 1),
    # Factored moments (adafactor) and other per-element work: ~ m * n.
    "elementwise": lambda s: float(math.prod(s)),
    # Shampoo-style: eigen/inverse roots of both (m x m) and (n x n) factors.
    "shampoo": lambda s: float(sum(d**3 for d in s[-2:])) if len(s) >= 2 else float(s[0] ** 3),
}


#: optax transformations that read every param at once (a global norm): run per
#: matrix, as whole_matrices runs its `inner`, each matrix would see only itself.
CROSS_PARAM = frozenset({"clip_by_global_norm"})
WHOLE_COUPLED = (
    "jaxsync.whole_matrices runs `inner` on each matrix on its own, but `inner` holds "
    "{found}, which reads all params at once: each matrix would be clipped by its own "
    "norm. Take it out of `inner` and pass `clip_grad_norm=` to the step or to "
    "jaxsync.distributed_optimizer, which clips by the true global norm (each owned "
    "matrix counted once)."
)


@dataclasses.dataclass(frozen=True, eq=False)
class WholeMatrices:
    """An optax transformation that jaxsync runs on whole matrices, each on its owner.

    Make one with :func:`whole_matrices`. It is itself a transformation (``init``
    and ``update`` are the wrapped one's), so the same optimizer dict also runs
    on one device with ``optax.multi_transform``.
    """

    inner: optax.GradientTransformation
    cost: Cost = "muon"
    tree: bool = False

    @property
    def init(self) -> Callable[..., Any]:
        return self.inner.init

    @property
    def update(self) -> Callable[..., Any]:
        return self.inner.update

    def cost_of(self, shape: tuple[int, ...]) -> float:
        return cost_fn(self.cost)(shape)

    @property
    def owned(self) -> Cost | WholeLeaves:
        """What the layout's buffer key carries: the cost, or for ``tree`` the
        cost marked so that a stacked param is owned whole (not per layer)."""
        return WholeLeaves(self.cost) if self.tree else self.cost


@dataclasses.dataclass(frozen=True)
class WholeLeaves:
    """The ownership cost of a ``tree`` optimizer: every param owned whole, a stacked
    ``[L, ...]`` one too (its optimizer was written for that shape)."""

    cost: Cost

    def __call__(self, shape: tuple[int, ...]) -> float:
        return cost_fn(self.cost)(shape)


def cost_fn(cost: Cost) -> Callable[[tuple[int, ...]], float]:
    if callable(cost):
        return cost
    if cost not in COSTS:
        raise ValueError(
            f"`cost` must be one of {sorted(COSTS)} or a function of a matrix shape "
            f"returning its estimated cost, got {cost!r}."
        )
    return COSTS[cost]


def whole_matrices(
    inner: optax.GradientTransformation, *, cost: Cost = "muon", tree: bool = False
) -> WholeMatrices:
    """Marks ``inner`` to run on whole params, each owned by one data-parallel rank.

    Use it as the transformation of a label in
    :func:`jaxsync.distributed_optimizer` (``labels=`` routes params to it). Every
    param of that label is owned whole by one rank; for a param in a ``stacked``
    group, each layer is its own matrix with its own owner. The owner receives
    the reduced gradient, keeps the fp32 master and ``inner``'s state of its
    matrices, runs ``inner`` on each matrix on its own, and the new params are
    all-gathered. ``inner`` must treat each param on its own (Muon, Adafactor,
    Shampoo, Lamb... do); clip with ``clip_grad_norm=``, not inside ``inner``.

    Args:
      inner: the optax transformation (``optax.contrib.muon``, ``optax.adafactor``...).
      cost: how owners are balanced: ``"muon"`` (Newton-Schulz, ``m*n*min(m, n)``),
        ``"elementwise"`` (``m*n``: adafactor), ``"shampoo"`` (``m**3 + n**3``), or
        a function of the matrix shape.
      tree: ``inner`` is written for the param tree and routes each param itself
        (``optax.contrib.muon(..., muon_weight_dimension_numbers=...)``: Newton-Schulz
        where the dimension numbers say, its own Adam elsewhere). Each param is then
        owned whole, a stacked ``[L, m, n]`` one too, and handed to ``inner`` in the
        param tree with every other param masked (``optax.MaskedNode``), as
        ``optax.multi_transform`` hands it on one device; so the dimension numbers
        stay valid. ``inner`` must still treat each param on its own.
        ``jaxsync.train_step`` and ``jaxsync.distributed_optimizer`` wrap a bare
        ``optax.contrib.muon`` this way by themselves.

    Example:
      >>> tx = jaxsync.distributed_optimizer(
      ...     {"muon": jaxsync.whole_matrices(optax.contrib.muon(0.02)),
      ...      "adamw": optax.adamw(3e-4)},
      ...     labels=jaxsync.muon_labels, axis_name="data")
    """
    if not hasattr(inner, "init") or not hasattr(inner, "update"):
        raise TypeError(f"`inner` must be an optax GradientTransformation, got {inner!r}.")
    coupled = sorted(factories(inner) & CROSS_PARAM)
    if coupled:
        raise ValueError(WHOLE_COUPLED.format(found=", ".join(f"optax.{c}" for c in coupled)))
    cost_fn(cost)
    if not isinstance(tree, bool):
        raise TypeError(f"`tree` must be True or False, got {tree!r}.")
    return WholeMatrices(inner, cost, tree)


def lpt(
    costs: Sequence[float], num_ranks: int, loads: Sequence[float] | None = None
) -> tuple[int, ...]:
    """Owner of each item by LPT: largest cost first, onto the least loaded rank.

    Ties go to the earlier item and the lower rank, so every host computes the
    same assignment. LPT is within 4/3 of the optimal makespan. ``loads``: what
    each rank carries already (earlier buckets).
    """
    loads = [0.0] * num_ranks if loads is None else list(loads)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(num_ranks), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += costs[i]
    return tuple(owners)


Spec = tuple[str, tuple[int, ...], str, BufferKey, int]  # name, shape, dtype, key, layers


def place_owned(
    specs: Sequence[Spec],
    members: Sequence[int],
    buffer: int,
    num_shards: int,
    bucket_size: int | None = None,
) -> tuple[dict[int, ParamSlot], Buffer]:
    """Slots and buffer of an owned buffer: each matrix whole in its owner's shard.

    ``members`` index ``specs`` in placement order (reverse tree order: backprop
    order). A member with ``layers > 0`` contributes one matrix per layer.
    Buckets take consecutive matrices in that order (closing at ``bucket_size``
    elements and at least one matrix per rank; None: one bucket), so the first
    bucket's gradients are ready first. Inside a bucket, LPT assigns owners
    against the loads of all buckets so far (the whole assignment stays
    balanced), each rank's matrices lie contiguous in its piece of the bucket,
    and pieces are padded to the largest.
    """
    key = specs[members[0]][3]
    cost = cost_fn(key.owned)
    if isinstance(key.owned, WholeLeaves):  # a stacked param is one unit, [L, ...] whole
        specs = [(*s[:4], 0) for s in specs]
    units = []  # (member, layer or None, row shape)
    for i in members:
        _, shape, _, _, layers = specs[i]
        if layers:
            units += [(i, layer, shape[1:]) for layer in range(layers)]
        else:
            units.append((i, None, shape))
    groups, current, fill = [], [], 0
    for u in units:
        current.append(u)
        fill += math.prod(u[2])
        # A bucket holds at least one matrix per rank: fewer would leave ranks
        # with nothing but padding in it (memory and all-gather bytes).
        if bucket_size is not None and fill >= bucket_size and len(current) >= num_shards:
            groups.append(current)
            current, fill = [], 0
    if current and groups and len(current) < num_shards:
        groups[-1] += current
    elif current:
        groups.append(current)
    loads = [0.0] * num_shards
    starts: dict[int, list[int]] = {}
    buckets, pos, used = [], 0, 0
    for group in groups:
        costs = [cost(u[2]) for u in group]
        owners = lpt(costs, num_shards, loads)
        fills = [0] * num_shards
        offsets = []
        for u, c, r in zip(group, costs, owners, strict=True):
            loads[r] += c
            offsets.append(fills[r])
            fills[r] += math.prod(u[2])
        piece = max(max(fills), 1)
        for u, r, off in zip(group, owners, offsets, strict=True):
            starts.setdefault(u[0], []).append(pos + r * piece + off)
        members_here = tuple(dict.fromkeys(u[0] for u in group))
        buckets.append(Bucket(pos, pos + piece * num_shards, members_here))
        pos += piece * num_shards
        used += sum(fills)
    slots = {}
    for i in members:
        name, shape, dtype, _, layers = specs[i]
        first = min(starts[i])
        bucket = next(b for b, bk in enumerate(buckets) if bk.start <= first < bk.end)
        pieces = tuple(starts[i]) if layers else ()
        slots[i] = ParamSlot(name, i, shape, dtype, buffer, bucket, first, layers, pieces)
    buf = Buffer(
        key=key,
        size=pos,
        used=used,
        buckets=tuple(buckets),
        slots=tuple(members),
        num_shards=num_shards,
        layers=0,
    )
    return slots, buf

"""What an FSDP step's ``state.params`` holds: each unit's flat fp32 shard, by unit.

A ``"fsdp"`` :func:`jaxsync.train_step` keeps no params tree: every unit is one flat
fp32 buffer (padded to divide over the ranks) sharded over the data axes. A plain
``{unit: shard}`` dict there reads like the params (``jax.tree.leaves`` of it counts
the padding too), so ``state.params`` holds them in an :class:`FsdpShards`: a
read-only mapping that says what it is and where the params are
(:meth:`TrainStep.params`), and a pytree whose key paths are the dict's
(``['blocks']``), so checkpoints, specs and ``tree_map`` see what they saw before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

NOT_A_UNIT = (
    "{key!r} is not an FSDP unit: a 'fsdp' step's state.params is an FsdpShards, the flat "
    "fp32 shard (padded) of each unit {units}, not the params. Read the params with "
    "`step.params(state)` (or the fp32 master weights with `step.master(state)`)."
)

NOT_PARAMS = (
    "{fn}: `params` is an FSDP step's state.params (an FsdpShards: each unit's flat fp32 "
    "shard, padded), not the params. Pass `step.params(state)`."
)


@jax.tree_util.register_pytree_with_keys_class
class FsdpShards(Mapping):
    """``state.params`` of an FSDP step: ``{unit: that unit's flat fp32 shard}``.

    Each value is one unit's params flattened into one fp32 buffer, padded so that
    it divides over the data-parallel ranks (a stacked unit's is ``[layers, n *
    shard]``), sharded over the data axes. These are not the params: their leaves
    hold the padding too. Read the params, shaped and typed as the model wrote them,
    with ``step.params(state)``; the fp32 master weights with ``step.master(state)``.

    A read-only mapping in unit order (``state.params["blocks"]``, ``.items()``) and a
    pytree with the key paths of the dict it replaces (``['blocks']``), flattened in
    a dict's order (sorted keys), so ``jax.tree`` functions, shardings and
    checkpoints read it as they read that dict. :class:`jaxsync.FullyShard`'s methods
    take it as they take :meth:`FullyShard.shard`'s plain dict (:meth:`as_dict`).

    Example:
      >>> state = step.init(params)  # mode="fsdp"
      >>> state.params  # FsdpShards(FSDP's flat fp32 shards per unit, padded; ...) {...}
      >>> n = sum(x.size for x in jax.tree.leaves(step.params(state)))  # not state.params
    """

    __slots__ = ("_shards",)

    def __init__(self, shards: Mapping[str, Any], units: Sequence[str] | None = None):
        """``shards``: ``{unit: shard}``; ``units`` orders them (default: ``shards``' order).

        The order is part of the pytree structure, so a step's state keeps
        ``FullyShard.units``' order whatever order a tree operation left a dict in.
        """
        self._shards = dict(shards) if units is None else {u: shards[u] for u in units}
        if len(self._shards) != len(shards):
            raise ValueError(
                f"FsdpShards: `units` {list(units or ())} are not the keys {sorted(shards)}."
            )

    # ------------------------------------------------------------- mapping
    def __getitem__(self, key: Any) -> Any:
        try:
            return self._shards[key]
        except KeyError:
            raise KeyError(NOT_A_UNIT.format(key=key, units=list(self._shards))) from None

    def __contains__(self, key: object) -> bool:
        return key in self._shards

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def as_dict(self) -> dict[str, Any]:
        """The plain ``{unit: shard}`` dict (what :meth:`FullyShard.shard` returns)."""
        return dict(self._shards)

    # -------------------------------------------------------------- pytree
    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], tuple[str, ...]]:
        keys = sorted(self._shards)  # a dict's flatten order: leaves as before
        children = tuple((jax.tree_util.DictKey(k), self._shards[k]) for k in keys)
        return children, tuple(self._shards)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, ...]]:
        return tuple(self._shards[k] for k in sorted(self._shards)), tuple(self._shards)

    @classmethod
    def tree_unflatten(cls, units: tuple[str, ...], children: Any) -> FsdpShards:
        by_key = dict(zip(sorted(units), children, strict=True))
        return cls({u: by_key[u] for u in units})

    # ---------------------------------------------------------------- repr
    def __repr__(self) -> str:
        items = ", ".join(f"{u!r}: {_describe(x)}" for u, x in self._shards.items())
        return (
            f"FsdpShards(FSDP's flat fp32 shards per unit, padded; not the params: read them "
            f"with step.params(state)) {{{items}}}"
        )


def _describe(x: Any) -> str:
    """A shard as ``float32[1024] P('data',)`` (its values would say nothing)."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return repr(x)
    dims = ",".join(str(d) for d in shape)
    try:  # a tracer may have no sharding to give
        spec = getattr(getattr(x, "sharding", None), "spec", None)
    except Exception:
        spec = None
    return f"{dtype}[{dims}]" + ("" if spec is None else f" {spec}")


def plain(shards: Any) -> Any:
    """``shards`` as a plain ``{unit: shard}`` dict if it is an :class:`FsdpShards`;
    anything else as it is (the FullyShard methods take both)."""
    return shards.as_dict() if isinstance(shards, FsdpShards) else shards

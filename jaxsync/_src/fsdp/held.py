"""What an FSDP step's ``state.params`` holds: each unit's flat fp32 shard, by unit.

A ``"fsdp"`` :func:`jaxsync.train_step` keeps no params tree: every unit is one flat
fp32 buffer (padded to divide over the ranks) sharded over the data axes. A plain
``{unit: shard}`` dict there reads like the params (``jax.tree.leaves`` of it counts
the padding too, and ``"embed" in state.params`` answered True where a unit is named
like a param: a parameter count read 84352 for 84288), so ``state.params`` holds them
in an :class:`FsdpShards`: it says what it is, answers no mapping question (``in``,
``[]``, ``keys()``, iteration raise, naming :meth:`TrainStep.params`, the one
accessor of the params), and is a pytree whose key paths are the dict's
(``['blocks']``), so ``jit``, checkpoints, specs and ``tree_map`` see what they saw
before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

NOT_THE_PARAMS = (
    "a 'fsdp' step's state.params is an FsdpShards: the flat fp32 shard (padded) of each "
    "unit {units}, not the params, so it answers no {op} (a param's name or count read "
    "from it would be a unit's, padding included). Read the params with "
    "`step.params(state)` (the fp32 master weights with `step.master(state)`); the unit "
    "shards themselves with `state.params.as_dict()`."
)

NOT_PARAMS = (
    "{fn}: `params` is an FSDP step's state.params (an FsdpShards: each unit's flat fp32 "
    "shard, padded), not the params. Pass `step.params(state)`."
)


@jax.tree_util.register_pytree_with_keys_class
class FsdpShards:
    """``state.params`` of an FSDP step: each unit's flat fp32 shard, by unit.

    Each value is one unit's params flattened into one fp32 buffer, padded so that
    it divides over the data-parallel ranks (a stacked unit's is ``[layers, n *
    shard]``), sharded over the data axes. These are not the params: their leaves
    hold the padding too, and a unit may be named like a param (``"embed"``). So it
    answers no mapping question (``in``, ``[]``, ``keys()``, ``len()``, iteration):
    each raises a ``TypeError`` naming ``step.params(state)``, the one accessor of
    the params, shaped and typed as the model wrote them (``step.master(state)``: the
    fp32 master weights). :meth:`as_dict` gives the ``{unit: shard}`` dict itself.

    It is a pytree with the key paths of that dict (``['blocks']``), flattened in a
    dict's order (sorted keys), so ``jit``, ``jax.tree`` functions, shardings and
    orbax read it as they read the dict. :class:`jaxsync.FullyShard`'s methods take it
    as they take :meth:`FullyShard.shard`'s plain dict.

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
        shards = plain(shards)
        self._shards = dict(shards) if units is None else {u: shards[u] for u in units}
        if len(self._shards) != len(shards):
            raise ValueError(
                f"FsdpShards: `units` {list(units or ())} are not the keys {sorted(shards)}."
            )

    def as_dict(self) -> dict[str, Any]:
        """The plain ``{unit: shard}`` dict (what :meth:`FullyShard.shard` returns)."""
        return dict(self._shards)

    @property
    def units(self) -> tuple[str, ...]:
        """The FSDP units, in the step's order."""
        return tuple(self._shards)

    # ------------------------------------------------- not a mapping of params
    def _refuse(self, op: str) -> TypeError:
        return TypeError(NOT_THE_PARAMS.format(units=list(self._shards), op=op))

    def __getitem__(self, key: Any) -> Any:
        raise self._refuse(f"`[{key!r}]`")

    def __contains__(self, key: object) -> bool:
        raise self._refuse(f"`{key!r} in ...`")

    def __iter__(self) -> Iterator[str]:
        raise self._refuse("iteration")

    def __len__(self) -> int:
        raise self._refuse("`len()`")

    def __bool__(self) -> bool:
        return True

    def keys(self) -> Any:
        raise self._refuse("`keys()`")

    def values(self) -> Any:
        raise self._refuse("`values()`")

    def items(self) -> Any:
        raise self._refuse("`items()`")

    def get(self, key: Any, default: Any = None) -> Any:
        raise self._refuse(f"`get({key!r})`")

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

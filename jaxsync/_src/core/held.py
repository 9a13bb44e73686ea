"""The marker a ZeRO step's ``state.params`` holds in place of a stacked group.

A 1-D ``"zero"`` step keeps its stacked-layer groups only as the distributed
optimizer's master shards (:mod:`jaxsync._src.step.held`); ``state.params`` keeps
their place with a :class:`HeldLayers`, which carries no arrays and says where the
params are. Kept in ``core`` so that every layer that takes params can refuse it
by name (:func:`check_not_held`) instead of failing on a layout it cannot build.
"""

from __future__ import annotations

from typing import Any

import jax

PyTree = Any

HELD = (
    "state.params[{group!r}] is not the params of the stacked-layer group {group!r}: a "
    "'zero' step holds them only as the distributed optimizer's fp32 master shards and "
    "gathers each layer in the forward. Read the params with `step.params(state)` (or "
    "the master weights with `step.master(state)`)."
)


@jax.tree_util.register_pytree_with_keys_class
class HeldLayers:
    """What ``state.params`` holds in place of a stacked group a ZeRO step keeps as
    master shards: no arrays, and a pointer to :meth:`TrainStep.params`."""

    def __init__(self, group: str):
        self.group = group

    def tree_flatten_with_keys(self) -> tuple[tuple[()], str]:
        return (), self.group

    def tree_flatten(self) -> tuple[tuple[()], str]:
        return (), self.group

    @classmethod
    def tree_unflatten(cls, group: str, children: Any) -> HeldLayers:
        del children
        return cls(group)

    def __repr__(self) -> str:
        return f"HeldLayers({self.group!r}: in the optimizer's master shards; step.params(state))"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldLayers) and other.group == self.group

    def __hash__(self) -> int:
        return hash(("HeldLayers", self.group))

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(HELD.format(group=self.group))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "group":
            raise AttributeError(name)
        raise TypeError(HELD.format(group=self.group))



def check_not_held(params: PyTree, fn: str) -> None:
    """Refuses params holding a :class:`HeldLayers` (a ZeRO step's ``state.params``),
    which hold no arrays for their group: pass ``step.params(state)`` instead."""
    found = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, HeldLayers))
    held = sorted({x.group for x in found if isinstance(x, HeldLayers)})
    if held:
        raise TypeError(f"{fn}: " + HELD.format(group=held[0]))

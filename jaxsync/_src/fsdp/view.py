"""The params as an FSDP model reads them: gathered units, and stacked units left
sharded as :class:`ShardedLayers` that :func:`jaxsync.tap` gathers layer by layer.

So the model code is the same as for plain data parallelism:
``loss_fn(fs.view(shards), batch)``, with the scanned layer body tapping its slice.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from ..core.names import param_name
from ..sync.tap_rules import WHOLE_STACK
from ..sync.views import GATHERED, NOT_TAPPED
from .gather import cast_floats

PyTree = Any
# The jaxsync.FullyShard whose method calls this: passed in, not imported (fsdp.py
# imports this module).
FullyShardT = Any


@jax.tree_util.register_pytree_node_class
class ShardedLayers:
    """A stacked FSDP unit's ``[layers, shard]`` shard as the model sees it.

    ``lax.scan`` slices it like any pytree; :func:`jaxsync.tap` on the slice
    gathers that one layer (see :meth:`FullyShard.view`).
    """

    def __init__(self, shard: Any, fs: FullyShardT, unit: str):
        self.shard, self.fs, self.unit = shard, fs, unit

    def tree_flatten(self) -> tuple[tuple[Any], tuple[FullyShardT, str]]:
        return (self.shard,), (self.fs, self.unit)

    @classmethod
    def tree_unflatten(cls, aux: tuple[FullyShardT, str], children: Any) -> ShardedLayers:
        return cls(children[0], *aux)

    holds_shards = True  # the model sees placeholders until the tap gathers a layer

    def jaxsync_tap(self) -> PyTree:
        """This layer's params, gathered from its shard (:func:`jaxsync.tap`)."""
        shape = tuple(getattr(self.shard, "shape", ()))
        if len(shape) > 1:  # one layer's shard is flat; [L, shard] is the whole stack
            what = f"its shard with shape {shape}; one layer's shard has shape {shape[1:]}"
            raise ValueError(WHOLE_STACK.format(group=self.unit, what=what))
        return self.fs.gather_layer(self.shard, self.unit)

    def __getitem__(self, key: Any) -> Any:

        raise TypeError(NOT_TAPPED.format(group=self.unit))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("shard", "fs", "unit"):
            raise AttributeError(name)

        raise TypeError(NOT_TAPPED.format(group=self.unit))


def view(fs: FullyShardT, shards: dict[str, Any], gathered: dict[str, Any], stacked: Any) -> PyTree:
    """The params' tree: ``gathered[name]`` per param, a :class:`ShardedLayers` per
    stacked group (``stacked``: its units)."""

    def place(path: Any, x: Any) -> Any:
        name = param_name(path)
        return ShardedLayers(shards[name], fs, name) if name in stacked else gathered[name]

    return jax.tree_util.tree_map_with_path(
        place,
        fs.template,
        is_leaf=lambda path, _: param_name(path) in stacked,
        is_leaf_takes_path=True,
    )


def gather_layer(fs: FullyShardT, shard: jax.Array, unit: str) -> PyTree:
    """One layer of stacked ``unit``, gathered param by param straight into each
    param's array (:func:`.gather.gather_pieces`), shaped like the group's subtree;
    the backward reduce-scatters the layer's gradient inside the backward scan."""
    flat = fs.unit_flat(unit)
    rows = fs._gather_flat(shard, "FullyShard.gather_layer", flat.widths)
    # Named, so a remat policy can keep gathered layers (save_only_these_names)
    # when memory allows, instead of gathering them again in the backward.
    rows = [checkpoint_name(r, GATHERED) for r in rows]
    named = flat.unflatten_row(rows, fs.policy.param_dtype)
    treedef, names = fs._groups[unit]
    return jax.tree.unflatten(treedef, [named[n] for n in names])


def apply(fs: FullyShardT, shards: dict[str, Any], unit: str, fn: Any, *inputs: Any) -> Any:
    """:meth:`FullyShard.apply`: ``fn(unit_params, *inputs)``, the unit gathered just
    before use (again in the backward when it reshards after the forward)."""
    if fs.policy.cast_forward_inputs:
        inputs = cast_floats(inputs, fs.policy.param_dtype)

    def run(shard: Any, *inputs: Any) -> Any:
        full = shard if isinstance(shard, dict) else fs.gather({unit: shard}, unit)
        return fn(full, *inputs)

    if fs.reshard_after_forward and not isinstance(shards[unit], dict):
        # Gathered params are never a dot's output, so this policy re-gathers
        # them. jax.checkpoint's optimization barriers are JAX's documented way
        # to keep XLA from merging the backward gather into the forward one; on
        # XLA:CPU we saw the pair merged anyway (not checked on GPU here).
        run = jax.checkpoint(run, policy=fs.remat_policy)
    out = run(shards[unit], *inputs)
    return cast_floats(out, fs.policy.output_dtype)

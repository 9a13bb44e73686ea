"""ZeRO's stacked layers held only as the optimizer's master shards, gathered in the forward.

A ZeRO step that all-gathers every updated param after the update has nothing
left to overlap that gather with: on 8 x H100 it was 6.3 ms of a 160 ms step, on
64 x H100 95 ms of 663. Megatron-Core's ``overlap_param_gather`` moves it into
the next forward. Here a 1-D ``"zero"`` step keeps each stacked-layer group only
as the distributed optimizer's fp32 master rows (``[layers, shard]``, which it
holds anyway); the group's view gathers each layer, in the params' dtype, as the
scanned forward reaches it (:func:`jaxsync._src.sync.layer_tap.gather_layer`),
where XLA overlaps the gather with the previous layer's compute. The gathered
values are exactly the ones the old gather after the update gave (the master cast
to the param dtype), and no GPU holds the stacked params whole between steps.

``state.params`` then holds a :class:`~jaxsync._src.core.held.HeldLayers` marker
in each group's place;
:meth:`TrainStep.params` returns the params whole, as in every mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import mesh_axes_size
from ..core.held import HeldLayers
from ..core.names import group_of, param_name
from ..layout.layout import Layout
from ..optim.portable import owned_of
from ..sync.collectives import gather_params

PyTree = Any


def held_groups(tx: Any, params: PyTree, mesh: Mesh, mode: Any, stacked: Sequence[str]) -> tuple:
    """The stacked groups a 1-D ZeRO step can hold as master shards: all of them, when
    every leaf of every group lies in an elementwise stacked buffer and no finalize
    rules apply; else none (the step then gathers its params after the update).
    None on one device either: there is nothing to gather or overlap, and the params
    are the update's cast, written in the optimizer's own pass (one H100, Llama-style
    1.1B: 1.5 GiB and 2.8 GB of kernel traffic less per step than holding them)."""
    if not stacked or mode.rules is not None or mode.deterministic is not None:
        return ()
    if mesh_axes_size(mesh, tx._config.axes, "jaxsync.train_step") == 1:
        return ()
    layout = tx.layout(params, mesh)
    stacks = layout.stacks()
    config = tx._config
    in_stack = {si for bufs in stacks.values() for bi in bufs for si in layout.buffers[bi].slots}
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    grouped = [i for i, n in enumerate(names) if group_of(n, stacked) is not None]
    owned = any(owned_of(config, layout, bi) is not None for bufs in stacks.values() for bi in bufs)
    if owned or not stacks or any(i not in in_stack for i in grouped):
        return ()
    return tuple(stacks)


def _is_group(groups: Sequence[str]) -> Any:
    return lambda path, _: param_name(path) in groups


def strip(params: PyTree, groups: Sequence[str]) -> PyTree:
    """``params`` with each held group's subtree replaced by its :class:`HeldLayers`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, sub: HeldLayers(param_name(path)) if param_name(path) in groups else sub,
        params,
        is_leaf=_is_group(groups),
        is_leaf_takes_path=True,
    )


def _arrays(held: PyTree) -> dict[str, Any]:
    """``{keystr(path): leaf}`` of the arrays ``held`` still holds."""
    flat = jax.tree_util.tree_flatten_with_path(held)[0]
    return {jax.tree_util.keystr(p): x for p, x in flat}


def stand_ins(held: PyTree, template: PyTree, groups: Sequence[str]) -> PyTree:
    """The full params tree inside the step: ``held``'s arrays, and zeros of each held
    group's shapes and dtypes, which only give the layout its shapes (no computation
    reads them, so XLA allocates nothing for them)."""
    arrays = _arrays(held)

    def one(path: Any, t: Any) -> Any:
        if group_of(param_name(path), groups) is not None:
            return jnp.zeros(t.shape, t.dtype)
        return arrays[jax.tree_util.keystr(path)]

    return jax.tree_util.tree_map_with_path(one, template)


def master_rows(layout: Layout, master: Sequence[jax.Array], groups: Sequence[str]) -> dict:
    """``{group: this rank's master rows of its buffers}`` (inside the step)."""
    stacks = layout.stacks()
    return {g: tuple(master[bi] for bi in stacks[g]) for g in groups}


def held_buffers(layout: Layout, groups: Sequence[str]) -> frozenset[int]:
    stacks = layout.stacks()
    return frozenset(bi for g in groups for bi in stacks[g])


def split_stacks(mode: Any) -> bool:
    """Whether a step keeps a buffer per stacked param: every 1-D ZeRO step. On several
    devices each layer's gathers (in the forward, and again in the backward when it
    reshards) then go straight into each param's own array, where one shared row
    would be gathered and every param cut out of it (a copy of the layer each time:
    64 x H100, Llama-style 7.2B, resharding: 674.1 -> 607.2 GB of kernel traffic, XLA's
    timeline 408.9 -> 399.7 ms); on one (nothing held, :func:`held_groups`) each
    param's new bf16 stack is its buffer cast, not a slice copied out of a shared row."""
    return mode.name == "zero"


def gather_held(
    layout: Layout, master: Sequence[jax.Array], axes: tuple[str, ...], params: PyTree,
    groups: Sequence[str],
) -> PyTree:  # fmt: skip
    """``params`` with the held groups gathered whole from the master (inside the step):
    what a step with microbatches feeds the earlier ones, which need the whole stack."""
    held = held_buffers(layout, groups)
    shards = tuple(
        m.astype(layout.buffers[bi].key.dtype) if bi in held else m for bi, m in enumerate(master)
    )
    skip = frozenset(range(len(layout.buffers))) - held
    return gather_params(shards, layout, axes, params, skip=skip)


def whole_params(
    tx: Any, opt_state: Any, held: PyTree, template: PyTree, groups: Sequence[str], mesh: Mesh
) -> PyTree:
    """The params as the user wrote them (outside the step, replicated): the held
    groups' master weights cast to the params' dtypes, the rest as ``held`` has them."""
    master = tx.to_portable(opt_state, template, mesh)["master"]
    arrays, rep = _arrays(held), NamedSharding(mesh, P())

    def one(path: Any, t: Any) -> Any:
        name = param_name(path)
        if group_of(name, groups) is None:
            return arrays[jax.tree_util.keystr(path)]
        return jax.device_put(master[name].astype(t.dtype), rep)

    return jax.tree_util.tree_map_with_path(one, template)

"""FSDP state outside shard_map: replicated params <-> global unit shards, and
the optimizer state's per-param form for checkpoints (independent of the DP size).

A unit's global shard array is rank-major (``[(layers,) n * shard]``, see
:mod:`fsdp.unit`), so placing params is flattening them, and reading them back
is unflattening: no per-rank slicing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import mesh_axes_size
from ..optim.portable import convert
from ..optim.whole_tree import OwnedTreePortable, OwnedTreeState
from .optimizer import LabelsState

PyTree = Any
# The jaxsync.FullyShard whose method calls this: passed in, not imported (fsdp.py
# imports this module).
FullyShardT = Any


def shard(fs: FullyShardT, params: PyTree, mesh: Mesh) -> dict[str, jax.Array]:
    """:meth:`FullyShard.shard`."""
    n = mesh_axes_size(mesh, fs.axes, "FullyShard.shard")
    if n != fs.num_shards:
        raise ValueError(
            f"this FullyShard was built for {fs.num_shards} shards; "
            f"axis {fs.axes} of the mesh has {n}."
        )
    # Units pick their params by leaf position: another tree with as many
    # leaves of the same shapes would be sharded under the wrong names.
    treedef = jax.tree.structure(params)
    if treedef != fs.treedef:
        raise ValueError(
            "FullyShard.shard: `params` does not have the structure this FullyShard "
            f"was built for.\n  expected: {fs.treedef}\n  received: {treedef}\n"
            "Pass the params given to `jaxsync.fully_shard`."
        )

    def build(params: PyTree) -> dict[str, jax.Array]:
        # A global shard array is rank-major: [(layers,) n * shard].
        return {
            u: fs.unit_flat(u).flatten(fs.unit_params(params, u), jnp.float32) for u in fs.units
        }

    shardings = {u: NamedSharding(mesh, s) for u, s in fs.specs().items()}
    return convert(build, (params,), mesh, shardings, key=("fsdp.shard", fs, mesh))


def unshard(fs: FullyShardT, shards: dict[str, jax.Array], mesh: Mesh) -> PyTree:
    """:meth:`FullyShard.unshard`."""
    for u in fs.units:
        if not hasattr(shards[u], "shape"):  # e.g. the params themselves
            raise ValueError(
                f"FullyShard.unshard: `shards[{u!r}]` is a {type(shards[u]).__name__}, not the "
                "unit's flat shard array; pass the dict {unit: shard} that `fs.shard(params)` "
                "returns (or an FSDP step's `state.params`)."
            )
    leaves: list[Any] = [None] * len(fs.param_names)

    def build(shards: dict[str, jax.Array]) -> PyTree:
        for u in fs.units:
            tree = fs.unit_flat(u).unflatten(shards[u], jnp.float32)
            for i in fs.members(u):
                leaves[i] = tree[fs.param_names[i]]
        return jax.tree.unflatten(fs.treedef, leaves)

    out = jax.tree.map(
        lambda _: NamedSharding(mesh, P()),
        jax.tree.unflatten(fs.treedef, list(fs.param_names)),
    )
    return convert(build, (shards,), mesh, out, key=("fsdp.unshard", fs, mesh))


# ------------------------------------------------------------- checkpoints
def _unit_dicts(fs: FullyShardT, label: str | None) -> Callable[[Any], bool]:
    """Recognises the state's ``{unit: shard}`` dicts (a label's: ``{unit: piece}``)."""
    units = set(fs.units) if label is None else {u for u, lab, _, _ in fs.pieces() if lab == label}
    return lambda x: isinstance(x, dict) and len(units) > 0 and set(x) == units


def _label_names(fs: FullyShardT, label: str) -> tuple[str, ...]:
    return tuple(n for n, lab in zip(fs.param_names, fs.labels, strict=True) if lab == label)


def _per_label(fs: FullyShardT, opt: Any, convert_one: Callable[[Any, str | None], Any]) -> Any:
    """``convert_one(state, label)`` of each label's state (the whole state: None)."""
    if isinstance(opt, LabelsState):
        return LabelsState({lab: convert_one(s, lab) for lab, s in opt.inner_states.items()})
    return convert_one(opt, None)


def _bare(tree: Any) -> Any:
    """Shapes and dtypes only: the conversion traces on global arrays, unsharded."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _owned_shardings(fs: FullyShardT, mesh: Mesh) -> Any:
    """Shardings of the owned state: each packed vector over the data axes."""
    specs = fs.owned_tree.specs()
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _owned_portable(fs: FullyShardT, opt: OwnedTreeState, mesh: Mesh) -> OwnedTreePortable:
    """Muon as written's owned state as ``{param name: state}`` (any DP size reads it)."""
    ot = fs.owned_tree
    rep = NamedSharding(mesh, P())
    out = jax.tree.map(lambda _: rep, jax.eval_shape(ot.to_portable, _bare(opt)))
    return convert(ot.to_portable, (opt,), mesh, out, key=("fsdp.owned_portable", ot, mesh))


def to_portable(fs: FullyShardT, opt: Any, mesh: Mesh) -> Any:
    """Every ``{unit: shard}`` of ``opt`` as the params' tree, every label's
    ``{unit: piece}`` as ``{param name: array}`` (fp32, replicated, no padding);
    muon as written's owned state as ``{param name: its state}``."""
    if isinstance(opt, OwnedTreeState):
        return _owned_portable(fs, opt, mesh)

    def one(state: Any, label: str | None) -> Any:
        is_u = _unit_dicts(fs, label)
        conv = (lambda d: fs.unshard(d, mesh)) if label is None else (
            lambda d: _unshard_label(fs, d, label, mesh))  # fmt: skip
        return jax.tree.map(lambda d: conv(d) if is_u(d) else d, state, is_leaf=is_u)

    return _per_label(fs, opt, one)


def portable_like(fs: FullyShardT, opt: Any, template: PyTree, mesh: Mesh) -> Any:
    """The abstract form of :func:`to_portable`'s result for an (abstract) ``opt``."""
    rep = NamedSharding(mesh, P())
    if isinstance(opt, OwnedTreeState):
        abstract = jax.eval_shape(fs.owned_tree.to_portable, _bare(opt))
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), abstract
        )
    sds = lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32, sharding=rep)  # noqa: E731
    full = jax.tree.map(sds, template)
    shape_of = dict(zip(fs.param_names, fs.param_shapes, strict=True))

    def one(state: Any, label: str | None) -> Any:
        is_u = _unit_dicts(fs, label)
        like = full if label is None else {
            n: sds(jax.ShapeDtypeStruct(shape_of[n], jnp.float32)) for n in _label_names(fs, label)
        }  # fmt: skip
        return jax.tree.map(lambda d: like if is_u(d) else d, state, is_leaf=is_u)

    return _per_label(fs, opt, one)


def from_portable(fs: FullyShardT, opt: Any, template: PyTree, mesh: Mesh) -> Any:
    """Inverse of :func:`to_portable` onto ``fs``'s layout (any DP size)."""
    if isinstance(opt, OwnedTreePortable):
        ot = fs.owned_tree
        out = _owned_shardings(fs, mesh)
        return convert(ot.from_portable, (opt,), mesh, out, key=("fsdp.owned_restore", ot, mesh))
    params_struct = jax.tree.structure(template)

    def one(state: Any, label: str | None) -> Any:
        if label is None:
            hit = lambda x: isinstance(x, dict) and jax.tree.structure(x) == params_struct  # noqa: E731
            conv = lambda d: fs.shard(d, mesh)  # noqa: E731
        else:
            names = set(_label_names(fs, label))
            hit = lambda x: isinstance(x, dict) and set(x) == names  # noqa: E731
            conv = lambda d: _shard_label(fs, d, label, mesh)  # noqa: E731
        return jax.tree.map(lambda d: conv(d) if hit(d) else d, state, is_leaf=hit)

    return _per_label(fs, opt, one)


def _label_units(fs: FullyShardT, label: str) -> list[str]:
    """The units that hold params of ``label``."""
    return [u for u in fs.units if fs.unit_flat(u).label_buffers(label)]


def _unshard_label(fs: FullyShardT, pieces: dict[str, jax.Array], label: str, mesh: Mesh) -> Any:
    # A label's global piece array is rank-major over its buffers, side by side.
    def build(pieces: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for u in _label_units(fs, label):
            flat = fs.unit_flat(u)
            bis = flat.label_buffers(label)
            flats = flat.to_buffers(pieces[u], bis)
            by_slot = flat.layout.unpack_leaves([[f] for f in flats], bis, jnp.float32)
            out.update({flat.names[si]: x for si, x in by_slot.items()})
        return out

    rep = NamedSharding(mesh, P())
    shardings = dict.fromkeys(_label_names(fs, label), rep)
    return convert(build, (pieces,), mesh, shardings, key=("fsdp.unshard_label", fs, label, mesh))


def _shard_label(fs: FullyShardT, arrays: dict[str, Any], label: str, mesh: Mesh) -> Any:
    def build(arrays: dict[str, Any]) -> dict[str, jax.Array]:
        out = {}
        for u in _label_units(fs, label):
            flat = fs.unit_flat(u)
            bis = flat.label_buffers(label)
            leaves = [arrays.get(n) for n in flat.names]
            buckets = flat.layout.pack_leaves(leaves, bis, jnp.float32)
            out[u] = flat.from_buffers([b[0] for b in buckets], bis)
        return out

    specs = fs.specs()
    shardings = {u: NamedSharding(mesh, specs[u]) for u in _label_units(fs, label)}
    return convert(build, (arrays,), mesh, shardings, key=("fsdp.shard_label", fs, label, mesh))

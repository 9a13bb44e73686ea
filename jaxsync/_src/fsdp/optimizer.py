"""The optimizer over FSDP shards: init, the elementwise probe, state specs, and
one optimizer per label (its checkpoint form: :mod:`fsdp.shards`).

Any elementwise optax optimizer runs on the ``{unit: shard}`` dict as it is. With
labels (``jaxsync.fully_shard(labels=...)``: weight decay on matrices only, a
different learning rate for embeddings...) every unit's shard holds one piece per
label (see :mod:`fsdp.unit`), and :func:`multi_transform` runs each label's
optimizer on its pieces only: ``optax.multi_transform`` for flat shards, with
each element's state held once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core.names import param_name
from ..layout.ownership import WholeMatrices
from ..optim.elementwise import check_elementwise

PyTree = Any
# The jaxsync.FullyShard whose method calls this: passed in, not imported (fsdp.py
# imports this module).
FullyShardT = Any
Labels = PyTree | Callable[[PyTree], PyTree] | None

NO_LABELS = (
    "{fn}: this FullyShard was built without `labels`, so its shards hold no per-label "
    "pieces. Pass `labels=` (a pytree of label strings shaped like the params, or a "
    "function of the params returning one) to `jaxsync.fully_shard`."
)
LABEL_WITHOUT_OPTIMIZER = (
    "{fn}: param {param} has label {label!r}, which `transforms` has no optimizer for; it "
    "has {keys}. Add an optimizer for {label!r} to the mapping, or give the param one of "
    "those labels (`labels=` of `jaxsync.fully_shard` / `jaxsync.train_step`)."
)
MAPPING_TX = (
    "{fn}: `tx` is a mapping of label -> optimizer ({keys}). Build the optimizer over the "
    "shards with `opt = fs.multi_transform(tx)` (the labels given to `jaxsync.fully_shard`), "
    "and pass `opt` here and use `opt.update` in the step."
)
WHOLE_MATRICES_IN_FSDP = (
    "{fn}: {what} routed to `jaxsync.whole_matrices`, which needs each matrix "
    "whole on one rank; FSDP runs every optimizer on flat shards. Use mode='zero' "
    "(`jaxsync.distributed_optimizer`) for whole-matrix optimizers, or an elementwise "
    "optimizer instead."
)


def resolve_labels(params: PyTree, labels: Labels, fn: str) -> tuple[str, ...] | None:
    """One label string per param leaf (in leaf order), or None without labels."""
    if labels is None:
        return None
    tree = labels(params) if callable(labels) else labels
    is_none = lambda x: x is None  # noqa: E731
    want, got = jax.tree.structure(params), jax.tree.structure(tree, is_leaf=is_none)
    if want != got:
        raise ValueError(
            f"{fn}: `labels` must have the structure of the params (one label string per "
            f"param).\n  params: {want}\n  labels: {got}"
        )
    out = []
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    for path, lab in zip(paths, jax.tree.leaves(tree, is_leaf=is_none), strict=True):
        if not isinstance(lab, str):
            raise TypeError(
                f"{fn}: the label of param {param_name(path)} is {lab!r}; every param needs "
                "a label string, a key of the mapping of optimizers."
            )
        out.append(lab)
    return tuple(out)


class LabelsState(NamedTuple):
    """State of :meth:`FullyShard.multi_transform`.

    Attributes:
      inner_states: per label, its optimizer's state over ``{unit: piece}``, the
        label's pieces of the units that hold params of that label.
    """

    inner_states: dict[str, Any]


class ShardMultiTransform(optax.GradientTransformation):
    """An ``optax.GradientTransformation`` over ``{unit: shard}``, one optimizer per
    label (see :meth:`FullyShard.multi_transform`)."""

    @property
    def transforms(self) -> dict[str, optax.GradientTransformation]:
        return self.__dict__["transforms"]


def multi_transform(
    fs: FullyShardT, transforms: Mapping[str, optax.GradientTransformation]
) -> ShardMultiTransform:
    fn = "FullyShard.multi_transform"
    if fs.labels is None:
        raise ValueError(NO_LABELS.format(fn=fn))
    if not isinstance(transforms, Mapping):
        raise TypeError(f"{fn}: `transforms` must be a mapping label -> optax optimizer, "
                        f"got {type(transforms).__name__}.")  # fmt: skip
    bad = [f"{k!r}: {type(v).__name__}" for k, v in transforms.items()
           if not (hasattr(v, "init") and hasattr(v, "update"))]  # fmt: skip
    if bad:
        raise TypeError(f"{fn}: `transforms` must map labels to optax optimizers; got {bad}.")
    owned = sorted(k for k, v in transforms.items() if isinstance(v, WholeMatrices))
    if owned:
        raise ValueError(WHOLE_MATRICES_IN_FSDP.format(fn=fn, what=f"labels {owned} are"))
    for name, lab in zip(fs.param_names, fs.labels, strict=True):
        if lab not in transforms:
            keys = sorted(transforms)
            raise ValueError(
                LABEL_WITHOUT_OPTIMIZER.format(fn=fn, param=name, label=lab, keys=keys)
            )
    txs = {lab: transforms[lab] for lab in sorted(set(fs.labels))}
    routes = {lab: tuple((u, lo, hi) for u, x, lo, hi in fs.pieces() if x == lab) for lab in txs}
    order = {u: [lab for v, lab, _, _ in fs.pieces() if v == u] for u in fs.units}

    def split(tree: Any) -> dict[str, Any]:
        return {lab: {u: tree[u][..., lo:hi] for u, lo, hi in r} for lab, r in routes.items()}

    def init_fn(params: Any) -> LabelsState:
        return LabelsState({lab: txs[lab].init(p) for lab, p in split(params).items()})

    def update_fn(updates: Any, state: LabelsState, params: Any = None) -> tuple[Any, LabelsState]:
        grads = split(updates)
        ps = split(params) if params is not None else dict.fromkeys(txs)
        out, new = {}, {}
        for lab, tx in txs.items():
            out[lab], new[lab] = tx.update(grads[lab], state.inner_states[lab], ps[lab])
        joined = {}
        for u, labs in order.items():
            parts = [out[lab][u] for lab in labs]
            joined[u] = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        return joined, LabelsState(new)

    tx = ShardMultiTransform(init_fn, update_fn)
    tx.__dict__["transforms"] = txs
    return tx


# -------------------------------------------------------------------- init
def probe(fs: FullyShardT, tx: Any) -> None:
    """The elementwise probe of ``tx`` as it runs on the shards (per label)."""
    fn = "FullyShard.init_optimizer"
    axes = fs.axes + fs.replicate_axes
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in fs.param_shapes]
    if not isinstance(tx, ShardMultiTransform):
        tree = jax.tree.unflatten(fs.treedef, shapes)
        members = tuple((u, fs.members(u)) for u in fs.units)
        check_elementwise(tx, tree, fn, units=members, axes=axes)
        return
    for lab, inner in tx.transforms.items():
        idx = [i for i, x in enumerate(fs.labels) if x == lab]
        units = tuple(
            (u, tuple(j for j, i in enumerate(idx) if i in fs.members(u))) for u in fs.units
        )
        units = tuple((u, m) for u, m in units if m)
        # The tree as optax.multi_transform hands it over: real names, the other
        # labels' params masked out (a transform keyed by names must see them).
        mine = set(idx)
        tree = jax.tree.unflatten(
            fs.treedef, [x if i in mine else optax.MaskedNode() for i, x in enumerate(shapes)]
        )
        check_elementwise(inner, tree, f"label {lab!r}", units=units, axes=axes)


def init_optimizer(
    fs: FullyShardT, tx: Any, shards: dict[str, jax.Array], mesh: Mesh | None, check: bool
) -> tuple[Any, Any]:
    fn = "FullyShard.init_optimizer"
    if isinstance(tx, Mapping):
        raise TypeError(MAPPING_TX.format(fn=fn, keys=sorted(tx)))
    if not hasattr(tx, "init") or not hasattr(tx, "update"):
        raise TypeError(f"`tx` must be an optax GradientTransformation, got {tx!r}.")
    if isinstance(tx, WholeMatrices):  # refused whatever `check`: it declares whole matrices
        raise ValueError(WHOLE_MATRICES_IN_FSDP.format(fn=fn, what="`tx` is"))
    if check:
        probe(fs, tx)
    missing = sorted(set(fs.units) - set(shards)) if isinstance(shards, dict) else None
    if missing is None or missing:
        raise ValueError(
            "`shards` must be the dict {unit: shard} from `fs.shard(params, mesh)`"
            + (f"; it lacks units {missing}." if missing else f", got {type(shards).__name__}.")
        )
    mesh = fs._mesh(mesh, fn)
    specs = state_specs(fs, tx)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=(fs.specs(),), out_specs=specs)
    return jax.jit(init)(shards), specs


def state_specs(fs: FullyShardT, tx: Any) -> Any:
    """Moments (shard- or piece-shaped leaves) sharded like their unit, scalars ``P()``."""
    specs = fs.specs()
    local, spec_of = {}, {}
    for u in fs.units:
        flat = fs.unit_flat(u)
        local[u] = jax.ShapeDtypeStruct((*flat.lead, flat.shard_size), jnp.float32)
        for _, lo, hi in flat.pieces():
            spec_of[(*flat.lead, hi - lo)] = specs[u]
        spec_of[local[u].shape] = specs[u]
    abstract = jax.eval_shape(tx.init, local)
    return jax.tree.map(lambda x: spec_of.get(tuple(x.shape), P()), abstract)

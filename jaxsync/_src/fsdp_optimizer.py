"""The optimizer over FSDP shards: init, state specs, one optimizer per label, and
the state's form for checkpoints (per-param arrays, independent of the DP size).

Any elementwise optax optimizer runs on the ``{unit: shard}`` dict as it is. With
labels (``jaxsync.fully_shard(labels=...)``: weight decay on matrices only, a
different learning rate for embeddings...) every unit's shard holds one piece per
label (see :mod:`fsdp_unit`), and :func:`multi_transform` runs each label's
optimizer on its pieces only: ``optax.multi_transform`` for flat shards, with
each element's state held once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .elementwise import check_elementwise
from .names import param_name
from .ownership import WholeMatrices
from .portable import convert

if TYPE_CHECKING:
    from .fsdp import FullyShard

PyTree = Any
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
    "{fn}: labels {labels} are routed to `jaxsync.whole_matrices`, which needs each matrix "
    "whole on one rank; FSDP runs every optimizer on flat shards. Use mode='zero' "
    "(`jaxsync.distributed_optimizer`) for whole-matrix optimizers, or an elementwise "
    "optimizer for those labels."
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
    fs: FullyShard, transforms: Mapping[str, optax.GradientTransformation]
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
        raise ValueError(WHOLE_MATRICES_IN_FSDP.format(fn=fn, labels=owned))
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
def probe(fs: FullyShard, tx: Any) -> None:
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
        check_elementwise(inner, [shapes[i] for i in idx], f"label {lab!r}", units=units, axes=axes)


def init_optimizer(
    fs: FullyShard, tx: Any, shards: dict[str, jax.Array], mesh: Mesh | None, check: bool
) -> tuple[Any, Any]:
    fn = "FullyShard.init_optimizer"
    if isinstance(tx, Mapping):
        raise TypeError(MAPPING_TX.format(fn=fn, keys=sorted(tx)))
    if not hasattr(tx, "init") or not hasattr(tx, "update"):
        raise TypeError(f"`tx` must be an optax GradientTransformation, got {tx!r}.")
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


def state_specs(fs: FullyShard, tx: Any) -> Any:
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


# ------------------------------------------------------------- checkpoints
def _unit_dicts(fs: FullyShard, label: str | None) -> Callable[[Any], bool]:
    """Recognises the state's ``{unit: shard}`` dicts (a label's: ``{unit: piece}``)."""
    units = set(fs.units) if label is None else {u for u, lab, _, _ in fs.pieces() if lab == label}
    return lambda x: isinstance(x, dict) and len(units) > 0 and set(x) == units


def _label_names(fs: FullyShard, label: str) -> tuple[str, ...]:
    return tuple(n for n, lab in zip(fs.param_names, fs.labels, strict=True) if lab == label)


def _per_label(fs: FullyShard, opt: Any, convert_one: Callable[[Any, str | None], Any]) -> Any:
    """``convert_one(state, label)`` of each label's state (the whole state: None)."""
    if isinstance(opt, LabelsState):
        return LabelsState({lab: convert_one(s, lab) for lab, s in opt.inner_states.items()})
    return convert_one(opt, None)


def to_portable(fs: FullyShard, opt: Any, mesh: Mesh) -> Any:
    """Every ``{unit: shard}`` of ``opt`` as the params' tree, every label's
    ``{unit: piece}`` as ``{param name: array}`` (fp32, replicated, no padding)."""

    def one(state: Any, label: str | None) -> Any:
        is_u = _unit_dicts(fs, label)
        conv = (lambda d: fs.unshard(d, mesh)) if label is None else (
            lambda d: _unshard_label(fs, d, label, mesh))  # fmt: skip
        return jax.tree.map(lambda d: conv(d) if is_u(d) else d, state, is_leaf=is_u)

    return _per_label(fs, opt, one)


def portable_like(fs: FullyShard, opt: Any, template: PyTree, mesh: Mesh) -> Any:
    """The abstract form of :func:`to_portable`'s result for an (abstract) ``opt``."""
    rep = NamedSharding(mesh, P())
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


def from_portable(fs: FullyShard, opt: Any, template: PyTree, mesh: Mesh) -> Any:
    """Inverse of :func:`to_portable` onto ``fs``'s layout (any DP size)."""
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


def _label_buffers(fs: FullyShard, label: str) -> list[tuple[str, int]]:
    """``(unit, buffer index)`` of ``label``'s buffer in each unit that has one."""
    return [
        (u, bi)
        for u in fs.units
        for bi, buf in enumerate(fs.layout(u).buffers)
        if buf.key.label == label
    ]


def _unshard_label(fs: FullyShard, pieces: dict[str, jax.Array], label: str, mesh: Mesh) -> Any:
    # A label's global piece array is rank-major over one buffer: that buffer's flat array.
    def build(pieces: dict[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for u, bi in _label_buffers(fs, label):
            flat = fs.unit_flat(u)
            by_slot = flat.layout.unpack_leaves([[pieces[u]]], [bi], jnp.float32)
            out.update({flat.names[si]: x for si, x in by_slot.items()})
        return out

    rep = NamedSharding(mesh, P())
    shardings = dict.fromkeys(_label_names(fs, label), rep)
    return convert(build, (pieces,), mesh, shardings, key=("fsdp.unshard_label", fs, label, mesh))


def _shard_label(fs: FullyShard, arrays: dict[str, Any], label: str, mesh: Mesh) -> Any:
    def build(arrays: dict[str, Any]) -> dict[str, jax.Array]:
        out = {}
        for u, bi in _label_buffers(fs, label):
            flat = fs.unit_flat(u)
            leaves = [arrays.get(n) for n in flat.names]
            (buckets,) = flat.layout.pack_leaves(leaves, [bi], jnp.float32)
            out[u] = buckets[0]
        return out

    specs = fs.specs()
    shardings = {u: NamedSharding(mesh, specs[u]) for u, _ in _label_buffers(fs, label)}
    return convert(build, (arrays,), mesh, shardings, key=("fsdp.shard_label", fs, label, mesh))

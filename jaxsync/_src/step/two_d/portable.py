"""2-D train states (:mod:`two_d.plan`) in the portable form of a 1-D mesh.

A step on ``("data", "model")`` holds each param whole (ddp, zero) or as fp32
shards padded along one dim (zero's master, fsdp's params) and its optax state
on those. A whole-state checkpoint of it is written in *exactly* the tree a
1-D step of the same mode writes (:mod:`checkpoint.train_state`), so a run
saved on ``data=8`` resumes on ``(data=4, model=2)`` and back, and on another
model-axis size:

- ``"ddp"``: the state as it is (already the 1-D tree).
- ``"zero"``: the distributed optimizer's portable form (:mod:`portable`):
  per-param fp32 ``master``, per buffer of the 1-D layout its optax state with
  ``{param name: array}`` dicts, and the loss scale and metrics in it.
- ``"fsdp"``: params and every params-shaped optax leaf unpadded to the param's
  shape (with labels: per label ``{param name: array}``); the per-param NaN
  diagnostics folded into the 1-D step's FSDP units (per unit: the largest
  device count and the lowest device of its params).

Per-param arrays keep the param's tensor-parallel sharding, so nothing is
gathered on one device.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.names import group_of, param_name
from ...fsdp.optimizer import LabelsState
from ...fsdp.unit import assign_units
from ...layout.buffer_names import buffer_name, saved_entry
from ...optim.optimizer import distributed_optimizer
from ...optim.portable import convert, slot_names
from ...optim.state import StepMetrics
from ..train_state import GuardState
from .dims import DimPlan, pad, unpad
from .plan import SpecLayout, SpecZeroState, specs_by_param

PyTree = Any

NOT_PORTABLE = (
    "{fn}: the {mode!r} optimizer state of this 2-D step cannot be written in the form a "
    "1-D step of the same mode writes: {why}. Whole-state checkpoints of 2-D steps support "
    "optax optimizers whose state holds, per param, arrays shaped like the param (Adam's "
    "moments) and other leaves shared by all params (counts)."
)


# ------------------------------------------------------------------ helpers
def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _param_tree(treedef: Any) -> Callable[[Any], bool]:
    """Recognises a params-shaped subtree of an optax state (``multi_transform``'s
    with ``MaskedNode`` where another label's params are)."""

    def hit(x: Any) -> bool:
        if not isinstance(x, dict) or not x:
            return False
        return jax.tree.structure(x, is_leaf=_is_masked) == treedef

    return hit


def _name_dict(names: frozenset[str]) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, dict) and bool(x) and set(x) == names


def _by_name(tree: PyTree) -> dict[str, Any]:
    """A params-shaped subtree as ``{param name: leaf}`` (masked leaves left out)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_masked)[0]
    return {param_name(path): x for path, x in flat if not _is_masked(x)}


def _plans(layout: SpecLayout) -> dict[str, DimPlan]:
    return {p.name: p for p in layout.leaves()}


def _treedef(layout: SpecLayout) -> Any:
    return jax.tree.structure(layout.plans, is_leaf=lambda x: isinstance(x, DimPlan))


def _shardings(tree: PyTree, layout: SpecLayout, mesh: Mesh) -> PyTree:
    """Per-param arrays (a leaf whose path ends in a param's name, of its whole
    shape) sharded like the param over the non-data axes; the rest replicated."""
    named = {p.name: (p.shape, P(*p.spec)) for p in layout.leaves()}
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs_by_param(tree, named),
        is_leaf=lambda s: isinstance(s, P),
    )  # fmt: skip


def _abstract(tree: PyTree, shardings: PyTree) -> PyTree:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _template(layout: SpecLayout, dtype: Any = None) -> PyTree:
    return layout.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype or jnp.dtype(p.dtype)))


def _labels(ts: Any, layout: SpecLayout) -> dict[str, str] | None:
    """``{param name: label}`` of a step with parameter groups, else None."""
    if ts.labels is None:
        return None
    template = _template(layout)
    tree = ts.labels(template) if callable(ts.labels) else ts.labels
    labels = jax.tree.leaves(jax.tree.map(lambda _, lab: lab, template, tree))
    return dict(zip([p.name for p in layout.leaves()], labels, strict=True))


# ------------------------------------------ groups: optax states by param names
# A 1-D portable optimizer state holds, per buffer (zero) or per label (fsdp),
# the optax state of that group's params with a ``{param name: array}`` dict
# wherever the 2-D state has a params-shaped tree. Both come from the same
# elementwise optax ``init``, so their skeletons align leaf for leaf.


def _sub(inner: PyTree, label: str | None) -> PyTree:
    """The optax state of ``label``'s params inside a ``multi_transform`` state."""
    return inner if label is None else inner.inner_states[label].inner_state


def _with_sub(inner: PyTree, label: str | None, new: PyTree) -> PyTree:
    if label is None:
        return new
    states = dict(inner.inner_states)
    states[label] = states[label]._replace(inner_state=new)
    return inner._replace(inner_states=states)


def _slots(tree: PyTree, hit: Callable[[Any], bool]) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=hit)


def group_to_portable(
    src: PyTree, like: PyTree, names: frozenset[str], layout: SpecLayout, why: str
) -> PyTree:
    """``src`` (2-D optax state, params-shaped trees of padded shards) in the skeleton
    of ``like`` (its 1-D portable form, ``{param name: ...}`` dicts of ``names``)."""
    plans = _plans(layout)
    is_tree = _param_tree(_treedef(layout))
    src_leaves, _ = _slots(src, is_tree)
    like_leaves, like_def = _slots(like, _name_dict(names))
    if len(src_leaves) != len(like_leaves):
        raise ValueError(why)
    out = []
    for s, t in zip(src_leaves, like_leaves, strict=True):
        if isinstance(t, dict):
            if not is_tree(s):
                raise ValueError(why)
            full = _by_name(s)
            out.append({n: unpad(full[n], plans[n]) for n in sorted(names)})
        elif is_tree(s) or tuple(s.shape) != tuple(t.shape):
            raise ValueError(why)
        else:
            out.append(s)
    return jax.tree.unflatten(like_def, out)


def group_from_portable(
    like: PyTree, saved: list[tuple[PyTree, frozenset[str]]], layout: SpecLayout
) -> PyTree:
    """Inverse of :func:`group_to_portable`: the 2-D optax state shaped like ``like``
    from the portable states of the groups holding its params (other leaves, such
    as counts, from the first group)."""
    plans = _plans(layout)
    is_tree = _param_tree(_treedef(layout))
    like_leaves, like_def = _slots(like, is_tree)
    groups = [_slots(state, _name_dict(names))[0] for state, names in saved]
    out = []
    for i, t in enumerate(like_leaves):
        if not is_tree(t):
            out.append(groups[0][i])
            continue
        arrays = {n: x for g in groups for n, x in g[i].items()}

        def one(path: Any, x: Any, arrays: dict = arrays) -> Any:
            if _is_masked(x):
                return x
            name = param_name(path)
            return pad(arrays[name].astype(x.dtype), plans[name])

        out.append(jax.tree_util.tree_map_with_path(one, t, is_leaf=_is_masked))
    return jax.tree.unflatten(like_def, out)


# --------------------------------------------------------------- the modes
_ZERO_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def zero_optimizer(ts: Any) -> Any:
    """The distributed optimizer a 1-D step with ``ts``'s settings builds: its
    portable form and checkpoint description are the ones a 2-D zero state takes.
    (Kept per step while the step lives: a cache would keep every step alive.)"""

    if ts in _ZERO_OPTIMIZERS:
        return _ZERO_OPTIMIZERS[ts]
    _ZERO_OPTIMIZERS[ts] = tx = distributed_optimizer(
        ts.tx, axis_name=ts.axis_name, bucket_size=ts.mode.bucket_size,
        reduce_dtype=ts.mode.reduce_dtype, clip_grad_norm=ts.clip_grad_norm,
        loss_scale=ts.loss_scale, rules=ts.mode.rules, stacked=ts.stacked or None,
        deterministic=ts.mode.deterministic, labels=ts.labels,
    )  # fmt: skip
    return tx


def _zero_groups(ts: Any, layout: SpecLayout) -> list[tuple[str, str | None, frozenset[str]]]:
    """``(buffer name, label, param names)`` of each buffer of the 1-D layout."""
    template = _template(layout)
    lay = zero_optimizer(ts).layout(template, ts.mesh)
    names = slot_names(lay, template)
    return [
        (buffer_name(lay, bi), buf.key.label, frozenset(names[si] for si in buf.slots))
        for bi, buf in enumerate(lay.buffers)
    ]


def _fsdp_groups(ts: Any, layout: SpecLayout) -> list[tuple[str, frozenset[str]]] | None:
    """``(label, param names)`` per label of an FSDP step with labels, else None."""
    labels = _labels(ts, layout)
    if labels is None:
        return None
    return [
        (lab, frozenset(n for n, x in labels.items() if x == lab))
        for lab in sorted(set(labels.values()))
    ]


def _units(ts: Any, layout: SpecLayout) -> list[tuple[int, ...]]:
    """Leaf indices of each unit of the FSDP plan a 1-D step would build."""
    names = [p.name for p in layout.leaves()]
    if ts.mode.units:
        units = tuple(ts.mode.units) + tuple(g for g in ts.stacked if g not in ts.mode.units)
    else:  # the 1-D default: one unit per top-level entry, stacked groups their own
        tops = {n.split(".")[0]: None for n in names if group_of(n, ts.stacked) is None}
        units = tuple(tops) + tuple(ts.stacked)
    return list(assign_units(names, units, ts.stacked).values())


def fold_metrics(metrics: StepMetrics, units: list[tuple[int, ...]]) -> StepMetrics:
    """Per-param NaN diagnostics -> per unit (the largest count, the lowest device)."""
    nd, first = metrics.nonfinite_devices, metrics.first_nonfinite_device
    big = jnp.iinfo(first.dtype).max
    idx = [jnp.asarray(u) for u in units]
    low = [jnp.min(jnp.where(first[i] >= 0, first[i], big)) for i in idx]
    return metrics._replace(
        nonfinite_devices=jnp.stack([jnp.max(nd[i]) for i in idx]),
        first_nonfinite_device=jnp.stack([jnp.where(x == big, -1, x) for x in low]),
    )


def unfold_metrics(metrics: StepMetrics, units: list[tuple[int, ...]]) -> StepMetrics:
    """Per-unit NaN diagnostics -> per param (each param gets its unit's)."""
    unit_of = {i: k for k, u in enumerate(units) for i in u}
    index = jnp.asarray([unit_of[i] for i in range(len(unit_of))])
    return metrics._replace(
        nonfinite_devices=metrics.nonfinite_devices[index],
        first_nonfinite_device=metrics.first_nonfinite_device[index],
    )


def _portable_fn(ts: Any, layout: SpecLayout, fn: str) -> Callable[..., tuple]:
    """``(params, opt_state, guard)`` of a 2-D state -> their 1-D portable form."""
    mode = ts.mode.name
    why = NOT_PORTABLE.format(fn=fn, mode=mode, why="{why}")
    is_tree = _param_tree(_treedef(layout))
    plans = _plans(layout)

    if mode == "zero":
        like = zero_optimizer(ts).portable_shapes(_template(layout), ts.mesh)["inner_state"]
        groups = _zero_groups(ts, layout)
        bad = why.format(why="its state does not align with the 1-D distributed optimizer's")

        def zero(params: PyTree, opt: SpecZeroState, guard: GuardState) -> tuple:
            master = {n: unpad(x, plans[n]) for n, x in _by_name(opt.master).items()}
            inner = {
                b: group_to_portable(_sub(opt.inner, lab), like[b], names, layout, bad)
                for b, lab, names in groups
            }
            portable = {
                "master": master,
                "inner_state": inner,
                "loss_scale": tuple(guard.loss_scale),
                "metrics": tuple(x for x in guard.metrics if x is not None),
            }
            return params, portable, {}

        return zero

    if mode == "fsdp":
        labeled = _fsdp_groups(ts, layout)
        units = _units(ts, layout)
        bad = why.format(why="its state does not align with optax's state of the labels' params")

        def fsdp(params: PyTree, opt: PyTree, guard: GuardState) -> tuple:
            whole = layout.map(lambda p, x: unpad(x, p), params)
            if labeled is None:
                opt = jax.tree.map(
                    lambda t: layout.map(lambda p, x: unpad(x, p), t) if is_tree(t) else t,
                    opt, is_leaf=is_tree,
                )  # fmt: skip
            else:
                opt = LabelsState({
                    lab: group_to_portable(
                        _sub(opt, lab), _label_like(ts, layout, lab, names), names, layout, bad
                    )
                    for lab, names in labeled
                })  # fmt: skip
            return whole, opt, GuardState(guard.loss_scale, fold_metrics(guard.metrics, units))

        return fsdp

    return lambda params, opt, guard: (params, opt, guard)


def _label_like(ts: Any, layout: SpecLayout, label: str, names: frozenset[str]) -> PyTree:
    """The abstract optax state of ``label``'s params as ``{param name: array}``."""
    shapes = {
        n: jax.ShapeDtypeStruct(p.shape, jnp.float32) for n, p in _plans(layout).items()
        if n in names
    }  # fmt: skip
    return jax.eval_shape(ts.tx[label].init, shapes)


def to_portable(ts: Any, plan: Any, state: Any, fn: str) -> tuple[PyTree, PyTree, PyTree]:
    """``(params, opt_state, guard)`` of a 2-D ``state`` in the 1-D portable form."""
    layout: SpecLayout = plan.dims
    build = _portable_fn(ts, layout, fn)
    args = (state.params, state.opt_state, state.guard)
    out = _shardings(jax.eval_shape(build, *args), layout, ts.mesh)
    return convert(build, args, ts.mesh, out, key=("two_d.portable.to", ts, layout))


def portable_like(ts: Any, plan: Any, like: Any, fn: str) -> tuple[PyTree, PyTree, PyTree]:
    """The abstract form (with shardings) of :func:`to_portable` for an (abstract) ``like``."""
    layout: SpecLayout = plan.dims
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    args = jax.tree.map(sds, (like.params, like.opt_state, like.guard))
    shapes = jax.eval_shape(_portable_fn(ts, layout, fn), *args)
    return _abstract(shapes, _shardings(shapes, layout, ts.mesh))


def from_portable(
    ts: Any, plan: Any, portable: dict[str, Any], like: Any
) -> tuple[PyTree, PyTree, PyTree]:
    """Inverse of :func:`to_portable`: ``(params, opt_state, guard)`` placed as in
    ``like`` (this step's layout: any data and model axis sizes)."""
    layout: SpecLayout = plan.dims
    mode = ts.mode.name
    is_tree = _param_tree(_treedef(layout))
    # Only structure and dtypes are read from ``like``: no array of it enters the program.
    like_opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like.opt_state)
    guard_def = jax.tree.structure(like.guard)
    groups = _zero_groups(ts, layout) if mode == "zero" else None
    labeled = _fsdp_groups(ts, layout) if mode == "fsdp" else None
    units = _units(ts, layout) if mode == "fsdp" else None
    every = frozenset(p.name for p in layout.leaves())
    padded = lambda t: layout.map(lambda p, x: pad(x, p), t)  # noqa: E731

    def build(params: PyTree, opt: PyTree, guard: PyTree) -> tuple:
        if mode == "zero":
            master = layout.map(lambda p: pad(opt["master"][p.name], p))
            inner = like_opt.inner
            for lab in sorted({lab for _, lab, _ in groups}, key=str):
                saved = [
                    (saved_entry(opt["inner_state"], b, n, every), n)
                    for b, x, n in groups
                    if x == lab
                ]
                inner = _with_sub(inner, lab, group_from_portable(_sub(inner, lab), saved, layout))
            leaves = jax.tree.leaves((opt["loss_scale"], opt["metrics"]))
            return params, SpecZeroState(master, inner), jax.tree.unflatten(guard_def, leaves)
        guard = jax.tree.unflatten(guard_def, jax.tree.leaves(guard))
        if mode == "ddp":
            return params, opt, guard
        if labeled is None:
            as_dicts = jax.tree.map(
                lambda t: _by_name(t) if is_tree(t) else t, opt, is_leaf=is_tree
            )
            opt = group_from_portable(like_opt, [(as_dicts, every)], layout)
        else:
            new = like_opt
            for lab, names in labeled:
                saved = [(opt.inner_states[lab], names)]
                new = _with_sub(new, lab, group_from_portable(_sub(new, lab), saved, layout))
            opt = new
        guard = guard._replace(metrics=unfold_metrics(guard.metrics, units))
        return padded(params), opt, guard

    args = (portable["params"], portable["opt_state"], portable["guard"])
    out = jax.tree.map(lambda x: x.sharding, (like.params, like.opt_state, like.guard))
    return convert(build, args, ts.mesh, out, key=("two_d.portable.from", ts, layout))

"""Mesh-axis helpers: normalise ``axis_name``, check it is bound, read sizes.

Every public function takes ``axis_name`` as one name or a tuple of names, and
checks it here, at trace time, so a typo fails with the mesh's real axis names
in the message instead of a bare ``NameError`` deep inside a collective.
"""

from __future__ import annotations

import math
from typing import Any

import jax

AxisName = str | tuple[str, ...]

NOT_IN_SHARD_MAP = (
    "{fn} must run inside `jax.shard_map` over a mesh with axis {axes}, but no mesh "
    "axes are bound here. Wrap the step in `jax.shard_map(step, mesh=mesh, ...)`."
)
UNKNOWN_AXIS = (
    "{fn}: `axis_name` {missing} is not an axis of the mesh; the mesh has axes "
    "{names} with sizes {sizes}. Pass one of those names (or a tuple of them)."
)


def normalize_axes(axis_name: AxisName, name: str = "axis_name") -> tuple[str, ...]:
    """``"data"`` -> ``("data",)``; tuples pass through; rejects empty names.
    ``name``: the argument the axes came from, as the errors call it."""
    if isinstance(axis_name, str):
        axes = (axis_name,)
    elif isinstance(axis_name, tuple | list):
        axes = tuple(axis_name)
    else:
        raise TypeError(
            f"`{name}` must be a mesh axis name (a string such as 'data') or a tuple of "
            f"them, got {axis_name!r} ({type(axis_name).__name__})."
        )
    if not axes or not all(isinstance(a, str) and a for a in axes):
        raise ValueError(
            f"`{name}` must be a mesh axis name or a non-empty tuple of them, got {axis_name!r}."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"`{name}` names an axis twice: {axis_name!r}.")
    return axes


def bound_axes(axis_name: AxisName, fn: str, *, allow_vmap: bool = False) -> tuple[str, ...]:
    """Normalised axes, after checking they are bound by the enclosing shard_map
    (or, with ``allow_vmap``, by an enclosing ``jax.vmap(..., axis_name=...)``, as
    the elementwise probe runs sharded transformations)."""
    axes = normalize_axes(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty and allow_vmap and all(_vmap_bound(a) for a in axes):
        return axes
    if mesh.empty:
        raise ValueError(NOT_IN_SHARD_MAP.format(fn=fn, axes=axes))
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            UNKNOWN_AXIS.format(
                fn=fn, missing=missing, names=mesh.axis_names, sizes=tuple(mesh.shape.values())
            )
        )
    return axes


def _vmap_bound(axis: str) -> bool:
    try:
        jax.lax.axis_size(axis)
    except NameError:
        return False
    return True


def axes_size(axes: tuple[str, ...]) -> int:
    """Product of the sizes of ``axes`` in the current (abstract) mesh."""
    shape = jax.sharding.get_abstract_mesh().shape
    return math.prod(shape[a] for a in axes)


def mesh_axes_size(mesh: Any, axis_name: AxisName, fn: str) -> int:
    """Size of ``axis_name`` in a concrete ``mesh``, with a clear error if absent."""
    axes = normalize_axes(axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            UNKNOWN_AXIS.format(
                fn=fn, missing=missing, names=mesh.axis_names, sizes=tuple(mesh.shape.values())
            )
        )
    return math.prod(mesh.shape[a] for a in axes)


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes over which ``x`` is typed device-varying (empty outside shard_map)."""
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval: Any) -> frozenset[str]:
    """:func:`varying_axes` of an abstract value (a jaxpr variable's ``aval``)."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", frozenset())
    return frozenset(vma)


def partitioned_axes() -> tuple[str, ...]:
    """The axes of the mesh being traced that the compiler partitions (not manual) and
    that have more than one device: a tensor-parallel split inside the step's
    ``shard_map``. A value laid out over them loses that layout when flattened, and XLA
    gathers it whole to flatten it."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ())
    return tuple(a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1)


def to_varying(tree: Any, axes: tuple[str, ...]) -> Any:
    """Marks every leaf device-varying over ``axes`` (no-op where it already is).

    Differentiating w.r.t. this view yields each device's *local* gradient; w.r.t.
    a replicated (invariant) value JAX would insert a hidden all-reduce instead.
    """

    def cast(x: Any) -> Any:
        todo = tuple(a for a in axes if a not in varying_axes(x))
        return jax.lax.pcast(x, todo, to="varying") if todo else x

    return jax.tree.map(cast, tree)


def rank(axes: tuple[str, ...]) -> jax.Array:
    """Linear index of this device over ``axes`` (row-major, first axis slowest)."""
    return jax.lax.axis_index(axes)


IDLE_AXIS = (
    "{fn}: mesh axis {axis!r} (size {size}) is idle: it is not a data axis "
    "(axis_name={data!r}), no param is sharded over it and no `rules` reduce over it, so "
    "the {size} devices along it would each run the same rows as the others: the right "
    "numbers at 1/{size} of the throughput. If it is data parallel (a trainer's "
    "('replica', 'data') mesh), pass `axis_name={suggest!r}`: the batch is then split over "
    "it too; if the loss uses it itself (its own collectives or axis_index: tensor or "
    "sequence parallelism by hand over replicated params), declare it with "
    "`loss_axes={axis!r}`; else build the mesh without it."
)


def check_idle_axes(
    mesh: Any, data: tuple[str, ...], used: set[str], loss_axes: tuple[str, ...], fn: str
) -> None:
    """Refuses a mesh axis of size > 1 that nothing uses: not a data axis, in no
    param's spec (``used``: those and the axes ``rules`` name) and not declared in
    ``loss_axes``. The step would run each device's rows once per device along it."""
    unknown = [a for a in loss_axes if a not in mesh.axis_names or a in data]
    if unknown:
        raise ValueError(
            f"{fn}: `loss_axes` {unknown} must be mesh axes other than the data axes "
            f"{data}; the mesh has axes {dict(mesh.shape)}."
        )
    idle = [
        a for a in mesh.axis_names
        if mesh.shape[a] > 1 and a not in data and a not in used and a not in loss_axes
    ]  # fmt: skip
    if not idle:
        return
    suggest = tuple(a for a in mesh.axis_names if a in data or a in idle)
    raise ValueError(
        IDLE_AXIS.format(
            fn=fn, axis=idle[0], size=mesh.shape[idle[0]], data=data[0] if len(data) == 1 else data,
            suggest=suggest[0] if len(suggest) == 1 else suggest,
        )
    )  # fmt: skip

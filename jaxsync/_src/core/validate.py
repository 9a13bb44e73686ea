"""TODO(validate): split from checks."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

PyTree = Any


def check_positive(value: Any, name: str, *, allow_none: bool = True) -> float | None:
    """A finite, positive real number (not a bool, not a string)."""
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)
    if not ok or not math.isfinite(float(value)) or not float(value) > 0:
        allowed = "a finite positive number" + (" or None" if allow_none else "")
        raise ValueError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")
    return float(value)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"`{name}` must be True or False, got {value!r}.")
    return bool(value)


def check_float_dtype(dtype: Any, name: str, *, allow_none: bool = False) -> None:
    """Reductions and master weights in an integer dtype would truncate silently."""
    if dtype is None and allow_none:
        return
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"`{name}` must be a floating dtype, got {dtype!r}.") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"`{name}` must be a floating dtype (float32, bfloat16, ...), got {dt.name}: "
            "gradients reduced or stored in it would be truncated."
            + (" Pass None to keep the gradients' dtype." if allow_none else "")
        )


def check_param_leaves(params: PyTree, fn: str) -> None:
    """Global params must be arrays or ShapeDtypeStructs (shapes and dtypes are read)."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(
                f"{fn}: param {jax.tree_util.keystr(path)} is a {type(x).__name__} ({x!r}), "
                "not an array: the optimizer lays out arrays by shape and dtype. Make it "
                f"one, e.g. `jnp.asarray({x!r}, jnp.float32)`."
            )


def check_param_specs(params: PyTree, specs: PyTree, mesh: Any) -> None:
    """``param_specs``: one PartitionSpec per param, naming mesh axes, dividing shapes."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    want = jax.tree.structure(params)
    got = jax.tree.structure(specs, is_leaf=is_spec)
    if want != got:
        raise ValueError(
            "`param_specs` must have the structure of the params, one PartitionSpec per "
            f"param.\n  params:      {want}\n  param_specs: {got}"
        )
    names = dict(mesh.shape)
    for (path, x), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(specs, is_leaf=is_spec),
        strict=True,
    ):
        name = jax.tree_util.keystr(path)
        if not isinstance(spec, P):
            raise TypeError(
                f"`param_specs` for param {name} must be a PartitionSpec, got {spec!r}."
            )
        shape = tuple(np.shape(x))
        if len(spec) > len(shape):
            raise ValueError(
                f"`param_specs` for param {name} is {spec}, which names {len(spec)} dimensions; "
                f"the param has shape {shape}."
            )
        for dim, entry in enumerate(spec):
            if entry is None:
                continue
            axes = (entry,) if isinstance(entry, str) else tuple(entry)
            unknown = [a for a in axes if a not in names]
            if unknown:
                raise ValueError(
                    f"`param_specs` for param {name} is {spec}: {unknown} is not an axis of "
                    f"the mesh, which has axes {tuple(names)} with sizes {tuple(names.values())}."
                )
            n = math.prod(names[a] for a in axes)
            if shape[dim] % n:
                raise ValueError(
                    f"`param_specs` for param {name} is {spec}: dimension {dim} of shape {shape} "
                    f"({shape[dim]}) is not divisible by the {n} devices of mesh axes {axes}."
                )



"""Argument checks shared by every entry point: numbers, booleans, dtypes, param specs, losses.

They run before anything is traced, so a wrong option fails with its name in the
message instead of deep inside a jitted program.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .axes import varying_axes
from .names import param_name

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


def check_option(value: Any, cls: type, what: str) -> Any:
    """An opt-in option given as None/False (off), True (``cls()``, its defaults) or an
    instance of ``cls``; ``what`` names the argument and an example in the error."""
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{what}, True for its defaults or None, got {value!r}.")
    return value


def check_float_dtype(dtype: Any, name: str, *, allow_none: bool = False) -> None:
    """Reductions and master weights in an integer dtype would truncate silently; and
    ``None``, where it has no meaning of its own, would read as float64 (which JAX
    truncates to float32 with a warning, or keeps under ``jax_enable_x64``)."""
    if dtype is None:
        if allow_none:
            return
        raise TypeError(
            f"`{name}` must be a floating dtype (float32, bfloat16, ...), got None; "
            "leave the argument out for its default."
        )
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


LOSS_REDUCED = (
    "jaxsync.value_and_grad: the loss returned by `fun` is already reduced over {axes} "
    "(typed invariant over them: a `jax.lax.pmean`/`psum` inside the loss function). "
    "Its gradients are then divided by the number of ranks once in the loss and again "
    "by the sync, which averages the local gradients. Return this device's local "
    "loss from `fun` and `jax.lax.pmean(loss, {axis_name!r})` it outside, for logging."
)



def check_local_loss(out: Any, axes: tuple[str, ...], has_aux: bool, axis_name: Any) -> None:
    """The loss :func:`jaxsync.value_and_grad` returns must vary over the data axes."""
    loss = out[0] if has_aux else out
    reduced = [a for a in axes if a not in varying_axes(loss)]
    if reduced:
        raise TypeError(LOSS_REDUCED.format(axes=reduced, axis_name=axis_name))


INTEGER_LOSS = (
    "`loss_fn` returned a loss of dtype {dtype}: gradients of an integer loss are zero "
    "(float0), so nothing would train. Compute the loss in floating point (e.g. "
    "`jnp.mean(x.astype(jnp.float32))`)."
)



INTEGER_PARAM = (
    "{fn}: param {param} has dtype {dtype} and shape {shape}; only floating-point params "
    "can be trained and synced in mode={mode!r} (an integer param would be trained as a "
    "float and truncated). Keep integer state (counters, rng keys, masks) outside the "
    "params: as a constant of the loss function, in the batch, or (flax NNX) in a "
    "variable that is not an `nnx.Param`, which the step keeps in `state.model_state`."
)



LOSS_ALREADY_REDUCED = (
    "{fn}: the loss returned by `loss_fn` is already reduced over {axes} (typed invariant "
    "over them: a `jax.lax.pmean`/`psum` inside the loss function), in mode={mode!r}. Its "
    "gradients would then be divided by the number of devices once in the loss and again "
    "by the sync. Return this device's own mean loss; the step averages it for you."
)



def check_float_params(params: PyTree, mode: str, fn: str) -> None:
    """Integer params cannot be trained in any mode."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(x, "dtype", None)
        if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                INTEGER_PARAM.format(
                    fn=fn, param=param_name(path), dtype=dtype, shape=tuple(np.shape(x)), mode=mode
                )
            )



def check_loss(out: Any, axes: tuple[str, ...], mode: str, fn: str) -> None:
    """The per-device loss: floating, and not reduced over the data axes yet."""
    if hasattr(out, "dtype") and not jnp.issubdtype(out.dtype, jnp.inexact):
        raise TypeError(INTEGER_LOSS.format(dtype=out.dtype))
    reduced = [a for a in axes if a not in varying_axes(out)]
    if reduced:
        raise TypeError(LOSS_ALREADY_REDUCED.format(fn=fn, axes=reduced, mode=mode))

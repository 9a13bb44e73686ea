"""Deterministic mode: bitwise-identical training whatever the data-parallel size.

Two things make data-parallel results depend on the number of ranks ``N``: each
device's float gradient is a sum over a different set of examples, and the
cross-device float sum runs in an ``N``-dependent order. This mode removes both:

* **A fixed unit of work.** Every microbatch's global batch is cut into
  ``units`` equal pieces (``U``, a multiple of every DP size used). Each device
  runs its ``U / N`` units one at a time, through the same per-unit program
  (a ``while`` loop whose trip count XLA cannot see, with optimization
  barriers around the unit's data and gradients, so no ``N``-dependent
  unrolling or fusion reaches the gradient kernels). A unit's gradients summed
  over microbatches, in microbatch order, are then the same bits at any ``N``.
* **Exact sums.** Units are added in fixed point with int32 limbs
  (:mod:`jaxsync._src.deterministic.fixed_point`): integer ``psum``/``psum_scatter`` is exact
  and associative, so the reduced gradient, the loss and the global norm do not
  depend on which device held which unit, or on shard boundaries.

The price: each device keeps its ``U / N`` unit gradients (fp32) until the
sync (memory ``U / N`` times the gradients), and the sync moves two int32 limbs
plus one int8 exponent per element instead of one fp32 (see the README's table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ..core.axes import axes_size, bound_axes, to_varying
from ..core.validate import check_local_loss, check_option
from ..program.grad_program import value_and_grad as program_value_and_grad
from .fixed_point import MAX_ADDENDS, unit_sum

PyTree = Any

NOT_DIVISIBLE = (
    "{fn}: deterministic mode cuts the global batch into units={units} equal units, "
    "{k} per device on {n} data-parallel devices ({axes}), but {what}. {fix}"
)


@dataclasses.dataclass(frozen=True)
class Deterministic:
    """Opt-in bitwise-identical training at any data-parallel size dividing ``units``.

    Pass it as ``deterministic=`` to :func:`jaxsync.value_and_grad` or
    :func:`jaxsync.accumulate_grads` (which then return :class:`UnitGrads`) and to
    the sync that reduces them (:func:`jaxsync.all_reduce_grads`,
    :func:`jaxsync.sync_grads` or :func:`jaxsync.distributed_optimizer`).

    The guarantee holds for the same global batch, seed, config and ``units``, on
    the same backend with the same jax/XLA versions: params, fp32 master,
    optimizer state, loss, grad norm and skipped steps are then the same bits for
    every DP size ``N`` that divides ``units``, in one process or several, and
    across a checkpoint saved at one ``N`` and resumed at another. Known limit:
    on XLA:CPU a model with a softmax (attention) gives ``N = 1`` results that
    differ from ``N >= 2`` in the last bits (the one-partition program is compiled
    differently); ``N >= 2`` agree bitwise. :func:`jaxsync.train_step` refuses
    NNX model state (BatchNorm statistics, Dropout RNG) in this mode.

    Attributes:
      units: ``U``, the number of equal pieces each microbatch's global batch is
        cut into; a multiple of every DP size you want to use (e.g. 8 for 1, 2, 4
        and 8 devices), at most 1024. ``U`` equal to the DP size costs least: each
        device then runs one unit, as in the default mode.

    Example:
      >>> det = jaxsync.Deterministic(units=8)
      >>> tx = jaxsync.distributed_optimizer(optax.adamw(3e-4), axis_name="data",
      ...                                    deterministic=det)
      >>> # inside shard_map over "data":
      >>> loss, grads = jaxsync.value_and_grad(loss_fn, axis_name="data",
      ...                                      deterministic=det)(params, batch)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
    """

    units: int = 8

    def __post_init__(self) -> None:
        u = self.units
        if isinstance(u, bool) or not isinstance(u, int) or not 1 <= u <= MAX_ADDENDS:
            raise ValueError(
                f"`Deterministic(units=...)` must be an int in [1, {MAX_ADDENDS}] (a multiple "
                f"of every data-parallel size you will use, e.g. 8), got {u!r}."
            )


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["grads"],
    meta_fields=["units", "microbatches", "dtypes"],
)
@dataclasses.dataclass(frozen=True)
class UnitGrads:
    """This device's per-unit gradients, ready for an exact, order-free sum.

    What :func:`jaxsync.value_and_grad` and :func:`jaxsync.accumulate_grads` return
    with ``deterministic=``. Reduce them with the sync given the same
    :class:`Deterministic`; they are not a gradient tree.

    Attributes:
      grads: the params' tree; each leaf ``[U / N, *param shape]`` in fp32: unit
        ``j`` of this device, summed over microbatches in microbatch order.
      units: ``U``.
      microbatches: microbatches summed per unit (the mean divides by
        ``units * microbatches``).
      dtypes: the gradients' own dtypes (tree-leaf order): the all-reduced tree
        gets them back.
    """

    grads: PyTree
    units: int
    microbatches: int
    dtypes: tuple[str, ...]

    @property
    def count(self) -> int:
        """Addends of the mean: units times microbatches."""
        return self.units * self.microbatches


def check_deterministic(det: Any, name: str = "deterministic") -> Deterministic | None:
    """``det`` as a :class:`Deterministic` (``True``: the default units) or None."""
    return check_option(
        det, Deterministic,
        f"`{name}` must be a jaxsync.Deterministic (e.g. `jaxsync.Deterministic(units=8)`)",
    )  # fmt: skip


def units_per_device(det: Deterministic, axes: tuple[str, ...], fn: str) -> int:
    """``U / N``, after checking that the DP size ``N`` divides ``U``."""
    n = axes_size(axes)
    if det.units % n:
        raise ValueError(
            f"{fn}: deterministic mode needs the data-parallel size to divide the units, "
            f"but units={det.units} is not divisible by the {n} devices of axes {axes}. "
            f"Run on a data-parallel size dividing {det.units}, or use "
            f"`jaxsync.Deterministic(units=...)` with a multiple of {n} (the same units "
            "at every size you compare)."
        )
    return det.units // n


def unit_value_and_grad(
    fun: Callable[..., Any],
    params: PyTree,
    microbatches: PyTree,
    det: Deterministic,
    axes: tuple[str, ...],
    *,
    has_aux: bool,
    fn: str,
) -> tuple[Any, UnitGrads]:
    """Per-unit gradients of ``fun`` over ``[M, local batch, ...]`` microbatches.

    Returns ``(loss, UnitGrads)`` (``((loss, aux), UnitGrads)`` with ``has_aux``),
    where ``loss`` is the exact global mean over all units and microbatches
    (replicated, the same bits at any DP size) and ``aux`` is per unit
    ``[U / N, ...]``, from the last microbatch.
    """
    k = units_per_device(det, axes, fn)
    leaves = jax.tree.leaves(microbatches)
    m = leaves[0].shape[0]
    for leaf in leaves:
        if leaf.ndim < 2 or leaf.shape[1] % k:
            b = leaf.shape[1] if leaf.ndim > 1 else "none"
            raise ValueError(
                NOT_DIVISIBLE.format(
                    fn=fn,
                    units=det.units,
                    k=k,
                    n=axes_size(axes),
                    axes=axes,
                    what=f"a batch leaf has local batch size {b} (shape {leaf.shape}), not "
                    f"divisible by {k}",
                    fix=f"Use a global batch divisible by units={det.units} "
                    "(each leaf's leading axis is the batch).",
                )
            )
    # [M, k * ub, ...] -> [M * k, ub, ...]: entry i = m * k + j is unit j of microbatch m.
    data = jax.tree.map(lambda x: x.reshape(m * k, x.shape[1] // k, *x.shape[2:]), microbatches)
    view = to_varying(params, axes)
    vg = program_value_and_grad(fun, has_aux=has_aux)
    unit0 = jax.tree.map(lambda x: x[0], data)
    out_shape, g_shape = jax.eval_shape(vg, view, unit0)
    dtypes = tuple(jnp.dtype(g.dtype).name for g in jax.tree.leaves(g_shape))

    def zeros(s: Any, dtype: Any = None) -> jax.Array:
        return to_varying(jnp.zeros((k, *s.shape), dtype or s.dtype), axes)

    acc = jax.tree.map(lambda g: zeros(g, jnp.float32), g_shape)
    loss_shape, aux_shape = out_shape if has_aux else (out_shape, None)
    losses = zeros(loss_shape, jnp.float32)
    aux = jax.tree.map(zeros, aux_shape)

    def body(i: jax.Array, carry: Any) -> Any:
        acc, losses, aux = carry
        j = i % k
        unit = jax.lax.optimization_barrier(
            jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), data)
        )
        out, g = jax.lax.optimization_barrier(vg(view, unit))
        check_local_loss(out, axes, has_aux, axes)
        loss, a = out if has_aux else (out, None)

        def add(buf: jax.Array, x: jax.Array) -> jax.Array:
            row = jax.lax.dynamic_index_in_dim(buf, j, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(buf, row + x.astype(buf.dtype), j, 0)

        def put(buf: jax.Array, x: jax.Array) -> jax.Array:
            return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), j, 0)

        return jax.tree.map(add, acc, g), add(losses, loss), jax.tree.map(put, aux, a)

    # A trip count XLA cannot read keeps the loop a loop at every N: a known count
    # of 1 may be unrolled and fused into its neighbours differently. (On XLA:CPU
    # the tests give the same bits without this and the barriers too; they are
    # insurance for compilers that simplify more.)
    trips = jax.lax.optimization_barrier(jnp.int32(m * k))
    acc, losses, aux = jax.lax.fori_loop(0, trips, body, (acc, losses, aux))
    total, _ = unit_sum(losses.reshape(k, 1), axes)
    loss = total[0] * (1.0 / (det.units * m))
    grads = UnitGrads(acc, det.units, m, dtypes)
    return ((loss, aux) if has_aux else loss), grads


def check_unit_grads(grads: Any, det: Deterministic | None, k: int | None, fn: str) -> UnitGrads:
    """``grads`` must be :class:`UnitGrads` made with the same units as ``det``."""
    if not isinstance(grads, UnitGrads):
        raise TypeError(
            f"{fn} was given deterministic={det!r}, so it needs the UnitGrads that "
            "`jaxsync.value_and_grad(..., deterministic=det)` or "
            "`jaxsync.accumulate_grads(..., deterministic=det)` return, got "
            f"{type(grads).__name__}. Compute the gradients with the same `deterministic=`."
        )
    if det is not None and grads.units != det.units:
        raise ValueError(
            f"{fn}: the UnitGrads were made with units={grads.units}, but this sync has "
            f"deterministic={det!r}. Use the same jaxsync.Deterministic for both."
        )
    if k is not None:
        got = {x.shape[0] for x in jax.tree.leaves(grads.grads)}
        if got != {k}:
            raise ValueError(f"{fn}: UnitGrads hold {sorted(got)} units per device, expected {k}.")
    return grads


def check_det_args(argnums: Any, rules: Any, sync: Any, fn: str) -> None:
    """What deterministic mode does not combine with, named with the way out."""
    if sync is not None:
        raise NotImplementedError(
            f"{fn}: `deterministic=` does not combine with the in-loop `sync=`; drop `sync=` "
            "and pass the UnitGrads to `tx.update` (a distributed_optimizer built with the "
            "same `deterministic=`) or to jaxsync.all_reduce_grads."
        )
    if rules is not None:
        raise NotImplementedError(
            f"{fn}: `deterministic=` supports plain data parallelism only, not `rules`."
        )
    if argnums != 0:
        raise ValueError(
            f"{fn}: with `deterministic=`, `fun` must be `fun(params, batch)` with "
            f"argnums=0, got argnums={argnums!r}."
        )


def deterministic_value_and_grad(
    fun: Callable[..., Any],
    axis_name: Any,
    argnums: Any,
    has_aux: bool,
    rules: Any,
    sync: Any,
    det: Deterministic,
) -> Callable[..., Any]:
    """:func:`jaxsync.value_and_grad` with ``deterministic=``: one microbatch of units."""
    fn = "jaxsync.value_and_grad"
    check_det_args(argnums, rules, sync, fn)

    def wrapped(params: PyTree, batch: PyTree) -> Any:
        axes = bound_axes(axis_name, fn)
        one = jax.tree.map(lambda x: x[None], batch)
        return unit_value_and_grad(fun, params, one, det, axes, has_aux=has_aux, fn=fn)

    return wrapped

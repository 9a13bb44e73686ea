"""Token-weighted losses: a sum and a weight, normalized by the global weight.

``train_step`` averages the per-device mean loss over devices and microbatches.
With padding that differs between rows (a masked, token-weighted loss) a mean of
means is another objective than single-device training on the global batch: 21%
off in a port of a real trainer. Megatron-Core keeps a loss sum and a token count
and divides by the global count (``calculate_per_token_loss``); so does this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class WeightedLoss:
    """A loss given as a sum over tokens (``sum_fn``) and their weight (``weight_fn``).

    Called directly it is the weighted mean of one batch, so the same object is the
    single-device loss (with ``(sum, aux)`` from ``sum_fn``: ``(mean, aux)``, as
    ``has_aux=True`` steps take it); :func:`jaxsync.train_step` divides the sums of
    every device and microbatch by the weight of the whole global batch instead
    (``normalize="step"``), or each microbatch's sums by that microbatch's global
    weight, averaging the microbatches (``normalize="microbatch"``).
    """

    sum_fn: Callable[[Any, Any], Any]
    weight_fn: Callable[[Any], jax.Array]
    normalize: str = "step"

    def __call__(self, params: Any, batch: Any) -> Any:
        out, weight = self.sum_fn(params, batch), self.weight_fn(batch)
        if isinstance(out, tuple) and len(out) == 2:  # (loss sum, aux)
            return out[0] / weight, out[1]
        return out / weight


NORMALIZE = ("step", "microbatch")


def weighted_loss(
    sum_fn: Callable[[Any, Any], jax.Array],
    weight_fn: Callable[[Any], jax.Array],
    *,
    normalize: str = "step",
) -> WeightedLoss:
    """A token-weighted loss for :func:`jaxsync.train_step`: equal to single-device
    training on the same global batch whatever the padding of each device's rows.

    With ``microbatches=k`` two objectives are in use, and ``normalize`` picks one:

    - ``"step"`` (default): the sum over every token of the step's global batch divided
      by their total weight, the token mean of the whole batch (Megatron-Core's
      ``calculate_per_token_loss``; one device on the global batch without
      accumulation).
    - ``"microbatch"``: each microbatch's sum divided by that microbatch's global
      weight (its rows on every device), averaged over the ``k`` microbatches: the
      mean of microbatch means that a trainer with ``optax.MultiSteps(tx, k)`` computes
      when each of its calls takes one microbatch as the global batch. Microbatch ``j``
      is the ``j``-th of the ``k`` equal slices of each device's rows.

    The two agree when every microbatch holds the same weight (no padding, or
    padding spread evenly).

    Args:
      sum_fn: ``sum_fn(params_or_model, batch) -> scalar``: the loss *summed* over the
        tokens of ``batch`` (padding masked out).
      weight_fn: ``weight_fn(batch) -> scalar``: their weight (the count of real
        tokens) in the rows it is given; it must not depend on the params, and must
        depend on the batch: a constant (the global token count) is refused, as the
        step sums it over every device and microbatch. A global batch whose weight is 0
        (all padding) is skipped as a non-finite step, never counted; with
        ``normalize="microbatch"`` so is one whose microbatch has weight 0 (its mean
        is 0 / 0, as in the MultiSteps trainer).
      normalize: ``"step"`` or ``"microbatch"``: where the division by the weight
        happens (above). Float aux follows it: token-weighted within each microbatch,
        then the microbatches averaged, under ``"microbatch"``.

    Example:
      >>> loss_fn = jaxsync.weighted_loss(
      ...     lambda p, b: jnp.sum(xent(p, b) * b["mask"]), lambda b: jnp.sum(b["mask"]))
      >>> step = jaxsync.train_step(loss_fn, optax.adamw(1e-3), mesh, microbatches=4)
    """
    if not callable(sum_fn) or not callable(weight_fn):
        raise TypeError(
            "jaxsync.weighted_loss takes two functions: sum_fn(params, batch) (the loss "
            f"summed over tokens) and weight_fn(batch) (their count); got {sum_fn!r}, "
            f"{weight_fn!r}."
        )
    if normalize not in NORMALIZE:
        raise ValueError(
            f"jaxsync.weighted_loss: `normalize` must be 'step' (the token mean of the "
            f"whole step's batch) or 'microbatch' (the mean of each microbatch's token "
            f"mean, as optax.MultiSteps trainers compute), got {normalize!r}."
        )
    return WeightedLoss(sum_fn, weight_fn, normalize)


def weight_factor(loss_fn: Any, batch: Any, axes: tuple[str, ...], k: int) -> jax.Array | None:
    """``N * k / W``: what turns the step's mean over ``N`` devices and ``k``
    microbatches of sums into the sum over the global batch divided by its weight
    ``W`` (None for a plain loss). ``batch`` is this device's rows, all microbatches."""
    if not isinstance(loss_fn, WeightedLoss):
        return None
    check_weight_fn(loss_fn.weight_fn, batch, jax.lax.axis_size(axes) * k)
    local = jnp.asarray(jax.lax.stop_gradient(loss_fn.weight_fn(batch)), jnp.float32)
    if local.shape != ():
        raise ValueError(
            f"`weight_fn` of jaxsync.weighted_loss must return a scalar (the weight of the "
            f"batch's tokens), got shape {local.shape}."
        )
    if loss_fn.normalize == "microbatch":  # each piece's own weight: piece_factor
        return jnp.ones((), jnp.float32)
    total = jax.lax.psum(local, axes)
    n = jax.lax.psum(1, axes)
    # An all-padding global batch is no step: a NaN factor makes the loss and every
    # gradient NaN, so the step is skipped as a non-finite one (params, optimizer state
    # and step count kept; counted in state.metrics), never an update of zero gradients
    # that momentum and weight decay would still apply.
    return jnp.where(total > 0, n * k / jnp.where(total > 0, total, 1.0), jnp.nan)


CONSTANT_WEIGHT = (
    "jaxsync.weighted_loss: `weight_fn` returns {value!r} whatever the batch holds; the "
    "step sums every device's and microbatch's weight_fn(rows) into the global weight, so "
    "a constant (such as the global token count) is counted once per piece: this step's "
    "{n} pieces (devices x microbatches) would divide by {n}x the weight. Return the "
    "weight of the rows it is given, e.g. `lambda b: jnp.sum(b['mask'])` (or "
    "`b['x'].shape[0]` when every row counts)."
)


def check_weight_fn(weight_fn: Callable[[Any], Any], batch: Any, pieces: int) -> None:
    """Refuses a ``weight_fn`` whose value does not depend on the batch: not on its
    values (the jaxpr's output is no function of its inputs) nor on its shapes (the
    same value for twice the rows). Checked at trace time, on shapes only."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), batch)
    try:
        closed = jax.make_jaxpr(weight_fn)(shapes)
    except Exception:  # weight_fn fails on its own below, with its own error
        return
    if _depends(closed.jaxpr):
        return
    doubled = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((2 * s.shape[0], *s.shape[1:]) if s.shape else (), s.dtype),
        shapes,
    )
    try:
        with jax.ensure_compile_time_eval():
            a = _constant(closed)
            b = _constant(jax.make_jaxpr(weight_fn)(doubled))
    except Exception:
        return
    if a is None or b is None or a != b:
        return
    raise ValueError(CONSTANT_WEIGHT.format(value=a, n=pieces))


def _depends(jaxpr: Any) -> bool:
    """Whether an output of ``jaxpr`` is computed from one of its inputs."""
    seen = {id(v) for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        if any(id(v) in seen for v in eqn.invars if not _literal(v)):
            seen.update(id(v) for v in eqn.outvars)
    return any(id(v) in seen for v in jaxpr.outvars if not _literal(v))


def _literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def _constant(closed: Any) -> float | None:
    """The value of a jaxpr that reads none of its inputs (zeros stand in for them)."""
    zeros = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *zeros)
    if len(out) != 1 or jnp.shape(out[0]) != ():
        return None
    return float(out[0])


def piece_factor(loss_fn: Any, factor: jax.Array, piece: Any, axes: tuple[str, ...]) -> Any:
    """What one piece's (microbatch's) sum is multiplied by: the step's ``factor``
    (``normalize="step"``), or ``N / W_j`` with ``W_j`` the global weight of
    microbatch ``j`` (``normalize="microbatch"``): the step's mean over ``N`` devices
    and ``k`` microbatches is then the mean over ``j`` of ``sum_j / W_j``."""
    if loss_fn.normalize == "step":
        return factor
    total = jax.lax.psum(_local_weight(loss_fn, piece), axes)
    n = jax.lax.psum(1, axes)
    # A microbatch of no weight: 0 / 0, a skipped step (as the global all-padding one).
    return jnp.where(total > 0, n / jnp.where(total > 0, total, 1.0), jnp.nan)


def piece_weight(loss_fn: Any, piece: Any, axes: tuple[str, ...] = ()) -> jax.Array | None:
    """The token weight of one piece (microbatch) of this device's rows, for the
    token-weighted mean of float aux (None for a plain loss); under
    ``normalize="microbatch"`` divided by the microbatch's global weight, so that
    each microbatch weighs the same."""
    if not isinstance(loss_fn, WeightedLoss):
        return None
    local = _local_weight(loss_fn, piece)
    if loss_fn.normalize == "step" or not axes:
        return local
    total = jax.lax.psum(local, axes)
    return jnp.where(total > 0, local / jnp.where(total > 0, total, 1.0), 0.0)


def _local_weight(loss_fn: WeightedLoss, piece: Any) -> jax.Array:
    return jnp.asarray(jax.lax.stop_gradient(loss_fn.weight_fn(piece)), jnp.float32)

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
    every device and microbatch by the weight of the whole global batch instead.
    """

    sum_fn: Callable[[Any, Any], Any]
    weight_fn: Callable[[Any], jax.Array]

    def __call__(self, params: Any, batch: Any) -> Any:
        out, weight = self.sum_fn(params, batch), self.weight_fn(batch)
        if isinstance(out, tuple) and len(out) == 2:  # (loss sum, aux)
            return out[0] / weight, out[1]
        return out / weight


def weighted_loss(
    sum_fn: Callable[[Any, Any], jax.Array], weight_fn: Callable[[Any], jax.Array]
) -> WeightedLoss:
    """A token-weighted loss for :func:`jaxsync.train_step`: equal to single-device
    training on the same global batch whatever the padding of each device's rows.

    Args:
      sum_fn: ``sum_fn(params_or_model, batch) -> scalar``: the loss *summed* over the
        tokens of ``batch`` (padding masked out).
      weight_fn: ``weight_fn(batch) -> scalar``: their weight (the count of real
        tokens); it must not depend on the params.

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
    return WeightedLoss(sum_fn, weight_fn)


def weight_factor(loss_fn: Any, batch: Any, axes: tuple[str, ...], k: int) -> jax.Array | None:
    """``N * k / W``: what turns the step's mean over ``N`` devices and ``k``
    microbatches of sums into the sum over the global batch divided by its weight
    ``W`` (None for a plain loss). ``batch`` is this device's rows, all microbatches."""
    if not isinstance(loss_fn, WeightedLoss):
        return None
    local = jnp.asarray(jax.lax.stop_gradient(loss_fn.weight_fn(batch)), jnp.float32)
    if local.shape != ():
        raise ValueError(
            f"`weight_fn` of jaxsync.weighted_loss must return a scalar (the weight of the "
            f"batch's tokens), got shape {local.shape}."
        )
    total = jax.lax.psum(local, axes)
    n = jax.lax.psum(1, axes)
    # An all-padding global batch: every sum is 0, and so is the gradient.
    return n * k / jnp.where(total > 0, total, 1.0)


def piece_weight(loss_fn: Any, piece: Any) -> jax.Array | None:
    """The token weight of one piece (microbatch) of this device's rows, for the
    token-weighted mean of float aux (None for a plain loss)."""
    if not isinstance(loss_fn, WeightedLoss):
        return None
    return jnp.asarray(jax.lax.stop_gradient(loss_fn.weight_fn(piece)), jnp.float32)

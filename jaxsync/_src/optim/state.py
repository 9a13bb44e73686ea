"""State of the distributed optimizer: NamedTuples of arrays only."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from .loss_scale import LossScaleState


class StepMetrics(NamedTuple):
    """Diagnostics of the last update, returned as data (never printed).

    Attributes:
      grad_norm: global L2 norm of the reduced, unscaled gradient (before clipping).
      num_zeros: number of exactly-zero gradient elements (padding excluded).
      skipped: whether the last step was skipped for non-finite gradients.
      skipped_steps: steps skipped so far.
      consecutive_skips: steps skipped in a row up to the last one (0 once a step
        is applied); a run that skips every step shows it here.
      nonfinite_devices: per param (in tree-leaf order), on the first step of the
        latest run of skipped steps: on how many devices its local gradient held
        NaN or Inf (all zero: the local gradients were finite and the overflow
        came from the reduction or the loss scale). In deterministic mode
        (:class:`jaxsync.Deterministic`): in how many *units*, so that the
        metrics too are the same at any data-parallel size.
      first_nonfinite_device: per param, the lowest such device (its index in
        ``mesh.devices.flat``; deterministic mode: the lowest unit), -1 where
        none. :func:`jaxsync.nonfinite_report` turns both into a message naming params and devices.
    """

    grad_norm: jax.Array
    num_zeros: jax.Array
    skipped: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    nonfinite_devices: jax.Array
    first_nonfinite_device: jax.Array


def initial_metrics(num_params: int) -> StepMetrics:
    """Metrics before the first step, for ``num_params`` param leaves."""
    zero_i = jnp.zeros((), jnp.int32)
    return StepMetrics(
        grad_norm=jnp.zeros((), jnp.float32),
        num_zeros=zero_i,
        skipped=jnp.zeros((), bool),
        skipped_steps=zero_i,
        consecutive_skips=zero_i,
        nonfinite_devices=jnp.zeros((num_params,), jnp.int32),
        first_nonfinite_device=jnp.full((num_params,), -1, jnp.int32),
    )




class DistributedOptimizerState(NamedTuple):
    """State of :func:`distributed_optimizer`; arrays only.

    Attributes:
      master: per buffer, this rank's fp32 master shard of the params. Kept for
        fp32 params too (Megatron reads those from the param itself): slicing
        the rank's piece out of the replicated params every step costs a full
        flatten, far more than the 4 bytes per sharded element.
      inner_state: per buffer, the inner transformation's state over the shard.
      loss_scale: the loss scaler (scale 1 when no scaling is used).
      metrics: diagnostics of the last step.
    """

    master: tuple[jax.Array, ...]
    inner_state: tuple[optax.OptState, ...]
    loss_scale: LossScaleState
    metrics: StepMetrics

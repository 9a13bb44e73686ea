"""State of the distributed optimizer: NamedTuples of arrays only."""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from .loss_scale import LossScaleState


class StepMetrics(NamedTuple):
    """Diagnostics of the last update, returned as data (never printed).

    Attributes:
      grad_norm: global L2 norm of the reduced, unscaled gradient (before clipping).
      num_zeros: number of exactly-zero gradient elements (padding excluded).
      skipped: whether the last step was skipped for non-finite gradients.
      skipped_steps: steps skipped so far.
    """

    grad_norm: jax.Array
    num_zeros: jax.Array
    skipped: jax.Array
    skipped_steps: jax.Array


class ShardedGrads(NamedTuple):
    """Gradients already reduced over the data axes, as this rank's shards.

    What :func:`jaxsync.value_and_grad` returns with ``sync=tx`` for a
    distributed optimizer: one array per buffer of ``tx``'s layout (``[shard]``,
    or ``[layers, shard]`` for a stacked buffer), averaged over ranks and
    microbatches, in the optimizer's reduce dtype. Stacked buffers were
    reduce-scattered inside the backward scan, layer by layer. ``tx.update``
    takes them as they are, without another reduction.
    """

    shards: tuple[jax.Array, ...]


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

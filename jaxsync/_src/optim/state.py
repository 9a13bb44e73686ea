"""State of the distributed optimizer: NamedTuples of arrays only."""

from __future__ import annotations

import collections
import functools
from typing import Any, NamedTuple

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
      update_norm: global L2 norm of the update the optimizer applied (optax's
        ``updates``, from the clipped gradient; 0 on a skipped step). ``None``
        unless the step was built with ``metrics=`` (:class:`jaxsync.TrainerMetrics`).
      param_norm: global L2 norm of the params after the step (fp32: the master
        weights where the mode keeps them); ``None`` unless ``metrics=``.
      learning_rate: the rate of the last applied update (a skipped step keeps the
        previous one; 0 before the first); ``None`` unless ``metrics=`` names or
        finds a learning rate.
      unit_prints: deterministic mode only, ``uint32[units, params]``: each unit's
        gradient of each param leaf (before the sync, summed over its rows) reduced
        to a 32-bit fingerprint of its bits, every step; row ``u`` is global unit
        ``u``, computed on the device ``u // (units per device)`` of
        ``mesh.devices.flat``. The same bits at any data-parallel size, so a rerun
        whose prints differ names the device that computed the unit
        (:class:`jaxsync.Rerun`). ``None`` unless
        ``metrics=jaxsync.TrainerMetrics(unit_prints=True)``.

    Why optional fields here and not a separate record: a trainer reads every
    diagnostic of the step in one place, ``state.metrics``, in every mode, and each
    mode already builds this tuple where the update is made. ``None`` is an empty
    pytree, so with the metrics off the state has the same leaves as before and the
    step the same program; older checkpoints (seven fields) restore unchanged, and a
    checkpoint restores across the setting (the fields dropped, or started at 0).
    """

    grad_norm: jax.Array
    num_zeros: jax.Array
    skipped: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    nonfinite_devices: jax.Array
    first_nonfinite_device: jax.Array
    update_norm: jax.Array | None = None
    param_norm: jax.Array | None = None
    learning_rate: jax.Array | None = None
    unit_prints: jax.Array | None = None


def initial_metrics(
    num_params: int, norms: bool = False, rate: bool = False, units: int = 0
) -> StepMetrics:
    """Metrics before the first step, for ``num_params`` param leaves; with ``norms``
    the update and param norms, with ``rate`` the learning rate, with ``units`` the
    units' gradient fingerprints (all zero)."""
    zero_i = jnp.zeros((), jnp.int32)
    zero_f = lambda: jnp.zeros((), jnp.float32)  # noqa: E731  (a buffer each)
    return StepMetrics(
        grad_norm=jnp.zeros((), jnp.float32),
        num_zeros=zero_i,
        skipped=jnp.zeros((), bool),
        skipped_steps=zero_i,
        consecutive_skips=zero_i,
        nonfinite_devices=jnp.zeros((num_params,), jnp.int32),
        first_nonfinite_device=jnp.full((num_params,), -1, jnp.int32),
        update_norm=zero_f() if norms else None,
        param_norm=zero_f() if norms else None,
        learning_rate=zero_f() if rate else None,
        unit_prints=jnp.zeros((units, num_params), jnp.uint32) if units else None,
    )



@functools.cache
def _saved_type(fields: tuple[str, ...]) -> type:
    return collections.namedtuple("StepMetrics", fields)


def saved_metrics(metrics: StepMetrics) -> Any:
    """``metrics`` as a checkpoint holds it: the fields that are not None, by name (a
    step without ``metrics=`` saves the seven fields checkpoints always held)."""
    present = [(k, v) for k, v in zip(metrics._fields, metrics, strict=True) if v is not None]
    return _saved_type(tuple(k for k, _ in present))(*(v for _, v in present))


def metrics_from(saved: Any, norms: bool, rate: bool, prints: bool = False) -> StepMetrics:
    """:class:`StepMetrics` from its checkpoint form (the fields that are not None, in
    order): the first seven, then the norms, the rate and the unit fingerprints where
    the step records them."""
    base, extra = tuple(saved[:7]), iter(saved[7:])
    pick = lambda on: next(extra) if on else None  # noqa: E731
    return StepMetrics(*base, pick(norms), pick(norms), pick(rate), pick(prints))


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

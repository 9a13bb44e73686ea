"""Loss scaling for fp16 training: constant or dynamic, with hysteresis.

The scale lives in the optimizer state as arrays, so it is checkpointed with it
and the step that skips on overflow needs no host round-trip.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Megatron's dynamic grad scaler.

    On a step with non-finite gradients the step is skipped and, once
    ``hysteresis`` such steps have been seen since the last growth, the scale is
    multiplied by ``backoff_factor`` (never below ``min_scale``). After
    ``growth_interval`` finite steps in a row it grows by ``growth_factor``.
    """

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.initial_scale <= 0 or self.min_scale <= 0:
            raise ValueError("`initial_scale` and `min_scale` must be positive.")
        if self.growth_factor < 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(
                f"need growth_factor >= 1 and 0 < backoff_factor < 1, got "
                f"{self.growth_factor} and {self.backoff_factor}."
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError("`growth_interval` and `hysteresis` must be >= 1.")


class LossScaleState(NamedTuple):
    """Arrays of the loss scaler.

    Attributes:
      scale: the current scale (fp32 scalar); multiply the loss by it.
      growth_tracker: finite steps since the scale last changed.
      hysteresis_tracker: non-finite steps still tolerated before a backoff.
    """

    scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array


LossScale = float | DynamicLossScale | None


def check_loss_scale(loss_scale: LossScale) -> None:
    if loss_scale is None or isinstance(loss_scale, DynamicLossScale):
        return
    if not isinstance(loss_scale, int | float) or loss_scale <= 0:
        raise ValueError(
            "`loss_scale` must be None (no scaling), a positive float (a constant "
            f"scale) or a jaxsync.DynamicLossScale, got {loss_scale!r}."
        )


def init_loss_scale(loss_scale: LossScale) -> LossScaleState:
    if isinstance(loss_scale, DynamicLossScale):
        scale, hyst = loss_scale.initial_scale, loss_scale.hysteresis
    else:
        scale, hyst = (1.0 if loss_scale is None else float(loss_scale)), 1
    return LossScaleState(
        scale=jnp.asarray(scale, jnp.float32),
        growth_tracker=jnp.zeros((), jnp.int32),
        hysteresis_tracker=jnp.asarray(hyst, jnp.int32),
    )


def update_loss_scale(
    loss_scale: LossScale, state: LossScaleState, finite: jax.Array
) -> LossScaleState:
    """The scaler's state after a step whose gradients were ``finite`` (or not)."""
    if not isinstance(loss_scale, DynamicLossScale):
        return state
    cfg = loss_scale
    grown = state.growth_tracker + 1
    grow = grown >= cfg.growth_interval
    ok = LossScaleState(
        scale=jnp.where(grow, state.scale * cfg.growth_factor, state.scale),
        growth_tracker=jnp.where(grow, 0, grown).astype(jnp.int32),
        hysteresis_tracker=jnp.where(grow, cfg.hysteresis, state.hysteresis_tracker).astype(
            jnp.int32
        ),
    )
    hyst = state.hysteresis_tracker - 1
    backoff = hyst <= 0
    bad = LossScaleState(
        scale=jnp.where(
            backoff, jnp.maximum(state.scale * cfg.backoff_factor, cfg.min_scale), state.scale
        ),
        growth_tracker=jnp.zeros((), jnp.int32),
        hysteresis_tracker=jnp.maximum(hyst, 0).astype(jnp.int32),
    )
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), ok, bad)

"""Loss scaling for fp16 training: constant or dynamic, with hysteresis.

The scale lives in the optimizer state as arrays, so it is checkpointed with it
and the step that skips on overflow needs no host round-trip.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


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
        # A NaN/Inf or non-positive scale makes every step non-finite, so every
        # step would be skipped without another sign: reject it here.
        for name in ("initial_scale", "min_scale"):
            _check_real(getattr(self, name), name, "a finite number > 0", lambda v: v > 0)
        _check_real(self.growth_factor, "growth_factor", "a finite number >= 1", lambda v: v >= 1)
        _check_real(
            self.backoff_factor, "backoff_factor", "a number in (0, 1)", lambda v: 0 < v < 1
        )
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"DynamicLossScale: `{name}` must be an integer >= 1 (steps), got {value!r}."
                )
        if self.min_scale > self.initial_scale:
            raise ValueError(
                f"DynamicLossScale: `min_scale` ({self.min_scale}) is above `initial_scale` "
                f"({self.initial_scale}); the scale must start at or above its floor."
            )


def _check_real(value: object, name: str, expected: str, ok: Callable[[float], bool]) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or not ok(float(value))
        or float(value) > FLOAT32_MAX
    ):
        raise ValueError(f"DynamicLossScale: `{name}` must be {expected}, got {value!r}.")


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
    """``None``, a :class:`DynamicLossScale`, or a finite positive constant.

    A NaN, Inf or non-positive scale makes every step's gradients non-finite, and
    the optimizer would skip every step: rejected here, when it is passed.
    """
    if loss_scale is None or isinstance(loss_scale, DynamicLossScale):
        return
    ok = isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool)
    if not ok or not (math.isfinite(float(loss_scale)) and float(loss_scale) > 0):
        raise ValueError(
            "`loss_scale` must be None (no scaling), a finite positive number (a constant "
            f"scale) or a jaxsync.DynamicLossScale, got {loss_scale!r}."
        )
    if float(loss_scale) > FLOAT32_MAX:
        raise ValueError(f"`loss_scale` {loss_scale!r} overflows float32 (max ~3.4e38).")


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


def active_scale(loss_scale: LossScale, state: LossScaleState) -> jax.Array | None:
    """The scale a step multiplies its loss by, or None without loss scaling: the
    scale is then 1, and the multiply of the loss and the divide of the gradients
    by it are left out of the program (each leaf's divide is a kernel to compile).
    One rule for the step, the distributed optimizer and deterministic mode."""
    return None if loss_scale is None else state.scale


def update_loss_scale(
    loss_scale: LossScale, state: LossScaleState, finite: jax.Array
) -> LossScaleState:
    """The scaler's state after a step whose gradients were ``finite`` (or not)."""
    if not isinstance(loss_scale, DynamicLossScale):
        return state
    cfg = loss_scale
    grown = state.growth_tracker + 1
    grown_scale = state.scale * cfg.growth_factor
    grow = grown >= cfg.growth_interval
    ok = LossScaleState(
        # Never grow to Inf (fp32 after ~100k clean steps with the defaults): an
        # Inf scale makes every later step non-finite, and Inf backs off to Inf.
        scale=jnp.where(grow & jnp.isfinite(grown_scale), grown_scale, state.scale),
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

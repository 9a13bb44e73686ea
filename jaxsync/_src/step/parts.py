"""What every mode's step body shares: the plan ``init`` fixed, the loss, the finish.

Kept apart from the bodies themselves (:mod:`body` for 1-D meshes,
:mod:`jaxsync._src.step.two_d.body` for 2-D ones), so that both build on it and neither
on the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..core.axes import to_varying, varying_axes
from ..core.cpu_order import on_cpu
from ..core.validate import check_loss
from ..optim.loss_scale import active_scale
from ..sync.views import is_view, trace_views
from .models.nnx_bridge import ModelDef
from .modes import deterministic_of
from .train_state import GuardState, TrainState, guarded_update
from .weighted import weight_factor

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What one ``TrainStep.init`` fixed: optimizer, FSDP units, specs, jitted step."""

    model: ModelDef | None
    template: PyTree  # the params' ShapeDtypeStructs (global)
    tx: Any
    fs: Any
    specs: TrainState
    fn: Callable[..., Any]
    dims: Any = None  # a two_d.plan.SpecLayout when params are sharded over other axes
    held: tuple[str, ...] = ()  # ZeRO's stacked groups held as master shards (see held.py)


class LossAux(NamedTuple):
    """What the loss returns beside its value: the model state after the call, and
    the user's aux (``has_aux=True``; None otherwise). Every gradient path carries
    it as one aux, the last microbatch's."""

    model_state: Any
    user: Any


def loss_of(
    cfg: Any, plan: Plan, state: TrainState, batch: Any
) -> Callable[[Any, Any], Any]:
    """``(params view, microbatch) -> (scaled local loss, model state after the call)``,
    merging an NNX module if any (the model state of a pytree loss is ``{}``).
    ``batch`` is this device's rows (all microbatches): a :func:`jaxsync.weighted_loss`
    is normalized by the weight of the global batch they are part of."""
    scale = scale_of(cfg, state)
    factor = weight_factor(cfg.loss_fn, batch, cfg.axis_name, cfg.microbatches)
    fn = cfg.loss_fn if factor is None else cfg.loss_fn.sum_fn

    def loss(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        with trace_views():
            if plan.model is None:
                out, rest = fn(params, batch), state.model_state
            else:
                plain, views = split_views(params, cfg.stacked, plan.template)
                model = plan.model.merge(plain, state.model_state, views)
                out = fn(model, batch)
                rest = model_state_of(model)
        user = None
        if cfg.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(
                    f"with `has_aux=True`, `loss_fn` must return `(loss, aux)`, got "
                    f"{type(out).__name__}."
                )
            out, user = out
        if not hasattr(out, "shape") or out.shape != ():
            raise ValueError(
                f"`loss_fn` must return a scalar loss (the mean over this device's rows), "
                f"got {type(out).__name__} of shape {getattr(out, 'shape', None)}. Reduce "
                "it with jnp.mean; return other values as `(loss, aux)` with "
                "`train_step(..., has_aux=True)`."
            )
        check_loss(out, cfg.axis_name, cfg.mode.name, "jaxsync.train_step")
        if factor is not None:
            out = out * factor.astype(out.dtype)
        if scale is not None:
            out = out * scale.astype(out.dtype)
        return out, LossAux(rest, user)

    return loss


def finish(
    cfg: Any,
    plan: Plan,
    state: TrainState,
    grads: Any,
    flags: Any,
    stats: Any,
    loss: Any,
    rest: Any,
    unit_flags: Any = None,
) -> tuple[TrainState, Any]:
    params, opt_state, scale, metrics, finite = guarded_update(
        state, plan.tx, grads, flags, stats,
        clip_grad_norm=cfg.clip_grad_norm, loss_scale=cfg.loss_scale, unit_flags=unit_flags,
        branch=on_cpu(cfg.mesh),
    )  # fmt: skip
    new = TrainState(
        state.step + finite.astype(jnp.int32), params, opt_state,
        settle(rest.model_state, state.model_state, finite), GuardState(scale, metrics),
    )  # fmt: skip
    return new, outputs(cfg, loss, rest, state)


def outputs(cfg: Any, loss: jax.Array, rest: LossAux, state: TrainState) -> Any:
    """The step's second output: the mean loss, and with ``has_aux`` the user's aux
    (floats averaged over the data devices, integers summed: counts add up)."""
    mean = mean_loss(cfg, loss, state)
    if not cfg.has_aux:
        return mean

    axes = cfg.axis_name

    def reduce(x: Any) -> Any:
        # Each device's own value (a constant too: every device counts its own rows).
        x = to_varying(jnp.asarray(x), axes)
        if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
            return jax.lax.psum(x.astype(jnp.int32), axes)
        return jax.lax.pmean(x, axes)

    return mean, jax.tree.map(reduce, rest.user)


def model_state_of(model: Any) -> Any:
    """An NNX module's state besides its ``nnx.Param``s, as a pure dict."""
    from flax import nnx

    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])


def settle(new: Any, old: Any, finite: jax.Array) -> Any:
    """The model state after a step, the same on every device.

    Floats that differ between devices (statistics of each device's rows) are
    averaged, integers (counters) take their maximum; on a skipped step float
    state stays as it was, so NaNs never reach it.
    """

    def one(x: Any, before: Any) -> Any:
        axes = tuple(sorted(varying_axes(x)))
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        if axes and floating:
            x = jax.lax.pmean(x, axes)
        elif axes and jnp.issubdtype(x.dtype, jnp.integer):
            x = jax.lax.pmax(x, axes)
        elif axes:
            raise ValueError(
                f"the model's state leaf of dtype {x.dtype} differs between devices after "
                f"the step (it varies over {axes}); only float (averaged) and integer "
                "(maximum) model state can be kept replicated. Keep it in the params, or "
                "use the explicit shard_map path."
            )
        return jnp.where(finite, x, before) if floating else x

    return jax.tree.map(one, new, old)


def mean_loss(cfg: Any, loss: jax.Array, state: TrainState) -> jax.Array:
    """The loss averaged over the data axes, and over any other axis it varies
    over (a sequence-parallel loss computed piecewise over ``"tensor"``)."""
    scale = scale_of(cfg, state)
    if scale is not None:
        loss = loss / scale.astype(loss.dtype)
    if deterministic_of(cfg.mode) is not None:  # already the exact global mean everywhere
        bad = jax.lax.pmax(jnp.logical_not(jnp.isfinite(loss)).astype(jnp.int32), cfg.axis_name)
        loss = jax.lax.pmax(loss, cfg.axis_name)
        # A skipped step: NaN, one bit pattern, at every N (its fixed-point sum is
        # no number: pmax would pick -inf at some sizes and NaN at others).
        return jnp.where(bad > 0, jnp.asarray(jnp.nan, loss.dtype), loss)
    extra = tuple(a for a in sorted(varying_axes(loss)) if a not in cfg.axis_name)
    loss = jax.lax.pmean(loss, cfg.axis_name + extra)
    return jnp.where(jnp.isnan(loss), jnp.asarray(jnp.nan, loss.dtype), loss)  # one NaN


def scale_of(cfg: Any, state: TrainState) -> jax.Array | None:
    """The step's :func:`active_scale` (None without loss scaling)."""
    return active_scale(cfg.loss_scale, state.loss_scale)


def unscale(grads: Any, scale: jax.Array | None) -> Any:
    if scale is None:
        return grads
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)


def split_views(params: Any, stacked: Sequence[str], template: Any) -> tuple[Any, dict]:
    """Replaces each stacked group's view in ``params`` (a nested dict) by plain values.

    A :class:`LayerStack` gives its params (arrays); FSDP's sharded layers give
    ``ShapeDtypeStruct`` placeholders, which fail loudly if read outside
    :func:`jaxsync.scan_layers`. Returns the plain dict and ``{group: view}``.
    """
    views: dict[str, Any] = {}
    if not stacked:
        return params, views

    def walk(node: Any, tmpl: Any, prefix: str) -> Any:
        if is_view(node):
            views[prefix] = node
            return tmpl if node.holds_shards else node.params
        if isinstance(node, dict):
            return {
                k: walk(v, tmpl[k], f"{prefix}.{k}" if prefix else str(k)) for k, v in node.items()
            }
        return node

    return walk(params, template, ""), views

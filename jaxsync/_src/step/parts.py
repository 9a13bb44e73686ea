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

from ..core.axes import varying_axes
from ..core.cpu_order import on_cpu
from ..core.validate import check_loss
from ..fsdp.gather import cast_floats
from ..optim.logged import TreeNorms, norms_on, rate_of, with_rate
from ..optim.loss_scale import active_scale
from ..sync.finalize import summed_axes
from ..sync.layer_tap import LayerStack
from ..sync.views import is_view, trace_views
from .models import collections
from .models.boxes import box_constraints_on_free_axes
from .models.nnx_bridge import ModelDef
from .modes import deterministic_of
from .pieces.meaning import check_aux, piece_rows, reduce_aux, reduce_state, stack_one, state_rules
from .pieces.rng import fold_model_keys, keep_model_keys, piece_args, rng_key_paths, user_batch
from .pieces.weighted import piece_factor, piece_weight, weight_factor
from .train_state import GuardState, TrainState, guarded_update

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
    state_share: float = 0.0  # of a GPU's memory, the state per device (xla_options)


class LossAux(NamedTuple):
    """What the loss returns beside its value: the model state after the call, the
    user's aux (``has_aux=True``; None otherwise) and the piece's token weight (a
    :func:`jaxsync.weighted_loss`; None otherwise). The gradient paths stack it over
    the step's pieces (microbatches; deterministic units): :mod:`meaning` combines
    the pieces into the one-device values."""

    model_state: Any
    user: Any
    weight: Any = None


def compute_view(params: Any, dtype: Any) -> Any:
    """The params as the loss reads them with ``DDP(param_dtype=...)``: each floating
    leaf cast, once per step. A stacked group's view casts its whole stack outside the
    layer loop; the tap still reduces each layer's gradient into sinks of the
    reduction's dtype, so the cast never rounds a gradient."""
    if dtype is None:
        return params

    def one(x: Any) -> Any:
        if isinstance(x, LayerStack):  # its params, never its sinks
            return LayerStack(cast_floats(x.params, dtype), x.sinks, x.acc, x.spec)
        return cast_floats(x, dtype)

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, LayerStack))


def loss_of(cfg: Any, plan: Plan, state: TrainState, batch: Any) -> Callable[[Any, Any], Any]:
    """``(params view, microbatch) -> (scaled local loss, model state after the call)``,
    merging an NNX module if any (the model state of a pytree loss is ``{}``, or the
    linen collections given to ``init``: :mod:`models.collections`).
    ``batch`` is this device's rows (all microbatches): a :func:`jaxsync.weighted_loss`
    is normalized by the weight of the global batch they are part of. A
    :class:`rng.Keyed` batch carries each piece's key (the loss's third argument) and
    index (folded into an NNX module's ``nnx.Rngs`` keys): :mod:`rng`."""
    scale = scale_of(cfg, state)
    factor = weight_factor(cfg.loss_fn, user_batch(batch), cfg.axis_name, cfg.microbatches)
    fn = cfg.loss_fn if factor is None else cfg.loss_fn.sum_fn
    key_paths = rng_key_paths(plan.model)

    dtype = getattr(cfg.mode, "param_dtype", None)

    def loss(params: Any, piece: Any) -> tuple[jax.Array, Any]:
        params = compute_view(params, dtype)
        batch, pid, extra = piece_args(piece)
        with trace_views(), box_constraints_on_free_axes():
            if plan.model is None and state.model_state:  # linen collections
                out, rest = collections.call(
                    fn, params, state.model_state, batch, cfg.has_aux, *extra
                )
            elif plan.model is None:
                out, rest = fn(params, batch, *extra), state.model_state
            else:
                plain, views = split_views(params, cfg.stacked, plan.template)
                kept = state.model_state
                if pid is not None:  # each piece draws its own streams
                    kept = fold_model_keys(kept, key_paths, pid)
                model = plan.model.merge(plain, kept, views)
                out = fn(model, batch, *extra)
                rest = model_state_of(model)
                if pid is not None:  # the state keeps the stream's own key
                    rest = keep_model_keys(rest, state.model_state, key_paths)
        user = None
        if cfg.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError(
                    f"with `has_aux=True`, `loss_fn` must return `(loss, aux)`, got "
                    f"{type(out).__name__}."
                )
            out, user = out
            user = check_aux(user)
        if not hasattr(out, "shape") or out.shape != ():
            raise ValueError(
                f"`loss_fn` must return a scalar loss (the mean over this device's rows), "
                f"got {type(out).__name__} of shape {getattr(out, 'shape', None)}. Reduce "
                "it with jnp.mean; return other values as `(loss, aux)` with "
                "`train_step(..., has_aux=True)`."
            )
        check_loss(out, cfg.axis_name, cfg.mode.name, "jaxsync.train_step")
        if factor is not None:  # this piece's share of the global weight
            out = out * piece_factor(cfg.loss_fn, factor, batch, cfg.axis_name).astype(out.dtype)
        if scale is not None:
            out = out * scale.astype(out.dtype)
        weight = piece_weight(cfg.loss_fn, batch, cfg.axis_name) if cfg.has_aux else None
        return out, LossAux(rest, user, weight)

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
    batch: Any,
    units: Any = None,
    norms: TreeNorms | None = None,
) -> tuple[TrainState, Any]:
    """The optimizer step, the state kept and the step's outputs. ``rest``: the
    :class:`LossAux` of every piece, stacked; ``batch``: this device's rows;
    ``units``: deterministic mode's record of this device's units (a ``UnitRecord``);
    ``norms``: how this mode's trees add up to the trainer's norms (``metrics=``)."""
    params, opt_state, scale, metrics, finite = guarded_update(
        state, plan.tx, grads, flags, stats,
        clip_grad_norm=cfg.clip_grad_norm, loss_scale=cfg.loss_scale, units=units,
        branch=on_cpu(cfg.mesh), norms=norms if norms_on(cfg.metrics) else None,
    )  # fmt: skip
    if cfg.metrics is not None:  # the rate at the optimizer's count before this update
        rate = rate_of(cfg.metrics, state.step, opt_state)
        metrics = with_rate(metrics, state.metrics, rate, finite)
    new = TrainState(
        state.step + finite.astype(jnp.int32), params, opt_state,
        settle(cfg, plan, rest, state, finite), GuardState(scale, metrics), state.layout,
    )  # fmt: skip
    return new, outputs(cfg, loss, rest, state, batch)


def outputs(cfg: Any, loss: jax.Array, rest: LossAux, state: TrainState, batch: Any) -> Any:
    """The step's second output: the mean loss, and with ``has_aux`` the user's aux
    with its one-device meaning over all pieces (:func:`meaning.reduce_aux`)."""
    mean = mean_loss(cfg, loss, state)
    if not cfg.has_aux:
        return mean
    leaves = jax.tree.leaves(rest.user)
    if not leaves:
        return mean, rest.user
    rows = piece_rows(user_batch(batch), leaves[0].shape[0])
    return mean, reduce_aux(rest.user, rest.weight, rows, cfg.axis_name, cfg.aux_reduce)


def one_piece(rest: LossAux) -> LossAux:
    """One piece's :class:`LossAux` as a stack of one (a step without microbatches)."""
    return stack_one(rest)


def model_state_of(model: Any) -> Any:
    """An NNX module's state besides its ``nnx.Param``s, as a pure dict."""
    from flax import nnx

    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])


def settle(cfg: Any, plan: Plan, rest: LossAux, state: TrainState, finite: jax.Array) -> Any:
    """The model state after a step, the same on every device: each piece's new state
    combined by its rule (:func:`meaning.reduce_state`)."""
    rules = state_rules(plan.model, cfg.state_reduce, state.model_state)
    return reduce_state(
        rest.model_state, state.model_state, finite, cfg.axis_name, rules, plan.model
    )


def mean_loss(cfg: Any, loss: jax.Array, state: TrainState) -> jax.Array:
    """The loss averaged over the data axes; over another axis it varies over, summed
    where the mode's rules sum the gradients over it (``Tied``, ``SequenceParallel``:
    the objective trained is then the sum of the pieces, each rank's share of the
    whole, and the step returns it, not 1/size of it), else averaged (a
    sequence-parallel loss computed piecewise, ``SequenceParallel(average=True)``)."""
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
    sums = summed_axes(getattr(cfg.mode, "rules", None))
    summed = tuple(a for a in extra if a in sums)
    loss = jax.lax.pmean(loss, cfg.axis_name + tuple(a for a in extra if a not in summed))
    if summed:
        loss = jax.lax.psum(loss, summed)
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

"""``jaxsync.train_step``: the arguments of a training step, checked, into a TrainStep.

Kept apart from :mod:`step` (what a built step does: init, the jitted step, the
state API) so each stays one concept: here every option is validated once, with
an error that names it, before anything is traced.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from ..core.axes import AxisName, mesh_axes_size, normalize_axes
from ..core.introspect import multi_steps_of
from ..core.validate import check_bool, check_positive
from ..layout.placement import normalize_stacked
from ..optim.logged import TrainerMetrics, check_metrics, check_zero_padding, norms_on
from ..optim.loss_scale import LossScale, check_loss_scale
from .checks import check_step_rules, labeled_tx
from .modes import Mode, deterministic_of, mode_of
from .pieces.meaning import AUX_RULES, STATE_RULES, check_rules
from .pieces.weighted import WeightedLoss
from .step import TrainStep


def train_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    mode: Mode | str = "zero",
    *,
    axis_name: AxisName = "data",
    microbatches: int = 1,
    stacked: str | Sequence[str] | None = None,
    clip_grad_norm: float | None = None,
    loss_scale: LossScale = None,
    donate: bool = True,
    labels: Any = None,
    has_aux: bool = False,
    aux_reduce: Mapping[str, str] | None = None,
    state_reduce: Mapping[str, str] | None = None,
    loss_axes: AxisName | None = (),
    metrics: TrainerMetrics | bool | None = None,
    **mode_options: Any,
) -> TrainStep:
    """Builds a jitted data-parallel training step: DDP, ZeRO or FSDP.

    From single-device optax, ``tx.init``/``jax.grad``/``tx.update`` become
    ``step = train_step(loss_fn, tx, mesh)``, ``state = step.init(params)``,
    ``state, loss = step(state, batch)``. Inside, the step is one
    ``jax.jit(jax.shard_map(...))`` over ``mesh`` with the state's specs and the
    state donated; ``loss_fn`` runs per device on its rows of the batch, the
    gradients are synced by jaxsync (never JAX's implicit all-reduce) and the
    returned loss is averaged over the data-parallel devices.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (the mean over the rows it is
        given), or ``loss_fn(model, batch)`` when ``init`` gets an ``nnx.Module``. For a
        loss whose rows weigh differently (padded tokens), a
        :func:`jaxsync.weighted_loss`: the step then divides by the global weight.
      tx: any optax optimizer; ZeRO and FSDP need an elementwise one (checked at
        ``init``). Do not put ``optax.clip_by_global_norm`` in it: pass
        ``clip_grad_norm``, which clips by the true global norm in every mode.
      mesh: the device mesh; ``axis_name`` must be among its axes.
      mode: a mode value carrying that mode's options: :class:`jaxsync.ZeRO`
        (sharded fp32 master and optimizer state; the default),
        :class:`jaxsync.DDP` (replicated optimizer, bucketed all-reduce) or
        :class:`jaxsync.FSDP` (params too sharded, gathered per unit); or the
        shorthand ``"zero"``, ``"ddp"``, ``"fsdp"`` for their defaults.
      axis_name: the data-parallel axis (or axes); the batch is split over it. Axes
        the model is sharded over (``"model"``, ``"expert"``) are not data axes, even
        when the batch is split over them too: place such a batch with its rows over
        the data axes first (``P(("data", "expert"))``) and the step keeps it so.
      microbatches: gradient accumulation: each device's rows are split into this
        many microbatches, run one after another and synced once.
      stacked: dotted name prefixes of scanned layer groups (``"blocks"``): their
        gradients are reduced inside the backward scan. The model runs them with
        :func:`jaxsync.scan_layers` (NNX) or ``lax.scan`` + :func:`jaxsync.tap`.
      clip_grad_norm: clip by this global L2 norm.
      loss_scale: ``None``, a constant, or a :class:`jaxsync.DynamicLossScale`
        (the loss is scaled and the gradients unscaled for you; non-finite steps
        are skipped in every mode).
      donate: donate the state to the step (its buffers are reused).
      labels: per-param labels (a pytree of strings shaped like the params, or a
        function of the params returning one) when ``tx`` is a mapping ``label ->
        optax optimizer``, in every mode: e.g. weight decay on matrices only,
        without ``adamw(mask=...)``, which ZeRO and FSDP cannot run on flat shards
        (each label's params get flat buffers, FSDP: pieces of each unit, of their own).
      has_aux: ``loss_fn`` returns ``(loss, aux)``, as for ``jax.value_and_grad``; the
        step then returns ``(state, (loss, aux))`` with ``aux`` as the same loss returns
        it on one device on the global batch, over devices and microbatches: a leaf
        whose leading axis is the rows comes back as the global rows in order; floats
        are means (token-weighted for a :func:`jaxsync.weighted_loss`), integers sums,
        bools ``any``. Strings and keys are refused.
      aux_reduce: ``{dotted aux name or prefix: rule}`` declaring a leaf's rule, one of
        ``"mean"``, ``"sum"``, ``"max"``, ``"min"``, ``"any"``, ``"all"``, ``"rows"``
        (e.g. ``{"max_logit": "max"}``).
      state_reduce: ``{dotted model-state name or prefix: rule}`` for an NNX module's
        state besides its params, one of ``"mean"``, ``"sum"`` (a counter: the old
        value plus every piece's change), ``"max"``, ``"min"``, ``"any"``, ``"all"``.
        Undeclared, ``nnx.BatchStat`` is a mean, ``nnx.RngCount`` the maximum, integer
        state a counter; a float state that differs between devices is refused.
      loss_axes: mesh axes the loss itself works over (its own collectives or
        ``axis_index``: tensor or sequence parallelism by hand over params replicated
        there); the step splits no rows over them. Every mesh axis of size > 1 must be a
        data axis, in a param's sharding, named by ``rules``, or here: an idle axis
        (a trainer's ``("replica", "data")`` mesh with the default ``axis_name``) would
        run each device's rows once per device along it, and is refused at ``init``.
        ``None`` or ``()`` (the default): none.
      metrics: a :class:`jaxsync.TrainerMetrics` (or ``True`` for its defaults): the
        step also records ``state.metrics.update_norm``, ``param_norm`` and
        ``learning_rate``, computed where the update is made (on the shards under
        ZeRO and FSDP: one more all-reduce of two floats); with
        ``TrainerMetrics(unit_prints=True)`` (deterministic mode) also each unit's
        gradient fingerprints, ``state.metrics.unit_prints``. Off by default: the step
        and its state are then those of a step without it.
      **mode_options: the keywords this function took before modes were values
        (``bucket_size``, ``reduce_dtype``, ``rules``, ``deterministic``, ``units``,
        ``policy``, ``reshard_after_forward``), still accepted beside a string
        ``mode`` they belong to; anything else is an error showing the mode value
        to write.

    Returns:
      A :class:`TrainStep`.

    Example:
      >>> step = jaxsync.train_step(loss_fn, optax.adamw(1e-3), mesh, jaxsync.ZeRO())
      >>> state = step.init(params)            # or an nnx.Module
      >>> state, loss = step(state, batch)     # host arrays are placed for you
      >>> params = step.params(state)
    """
    mode = mode_of(mode, mode_options)
    check_step_rules(mode, "jaxsync.train_step")
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable as loss_fn(params, batch), got {loss_fn!r}.")
    _check_tx(tx, labels, mode.name)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"`mesh` must be a jax.sharding.Mesh (jax.make_mesh), got {mesh!r}.")
    axes = normalize_axes(axis_name)
    mesh_axes_size(mesh, axes, "jaxsync.train_step")
    # None or an empty sequence: the loss works over no mesh axis (the default)
    empty = loss_axes is None or (isinstance(loss_axes, tuple | list) and not loss_axes)
    loss_axes = () if empty else normalize_axes(loss_axes, "loss_axes")
    missing = [a for a in loss_axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"`loss_axes` {missing} are not axes of the mesh; it has axes {dict(mesh.shape)}."
        )
    if set(loss_axes) & set(axes):
        raise ValueError(
            f"`loss_axes` {loss_axes} names data axes {tuple(a for a in loss_axes if a in axes)}"
            f" (axis_name={axis_name!r}): the batch is split over those already; name only the "
            "axes the loss itself works over."
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"`microbatches` must be a positive int, got {microbatches!r}.")
    check_loss_scale(loss_scale)
    check_bool(donate, "donate")
    check_bool(has_aux, "has_aux")
    aux_rules = check_rules(aux_reduce, "aux_reduce", AUX_RULES)
    state_rules = check_rules(state_reduce, "state_reduce", STATE_RULES)
    if aux_rules and not has_aux:
        raise ValueError("`aux_reduce` declares aux rules; pass `has_aux=True` too.")
    det = deterministic_of(mode)
    if det is not None and isinstance(loss_fn, WeightedLoss):
        raise ValueError(
            "`deterministic` sums each unit's mean loss exactly and does not take a "
            "jaxsync.weighted_loss; give every row the same weight, or drop `deterministic`."
        )
    if det is not None and (microbatches > 1 or stacked):
        what = f"microbatches={microbatches}" if microbatches > 1 else "`stacked`"
        fix = (
            "its units already run one after another on each device: raise "
            "Deterministic(units=...) instead" if microbatches > 1 else
            "drop `stacked`"
        )  # fmt: skip
        raise ValueError(f"`deterministic` does not support {what}; {fix}.")
    _check_multi_steps(tx, clip_grad_norm)
    logged = check_metrics(metrics)
    if logged is not None and logged.unit_prints and det is None:
        raise ValueError(UNIT_PRINTS_NEED_DETERMINISTIC.format(mode=mode.name))
    if norms_on(logged) and mode.name != "ddp":  # flat shards' padding must stay zero
        check_zero_padding(tx, "jaxsync.train_step")
    if labels is not None and mode.name == "ddp":  # a replicated optimizer: optax's own way
        tx = labeled_tx(tx, labels, normalize_stacked(stacked))
    return TrainStep(
        loss_fn=loss_fn,
        tx=tx,
        mesh=mesh,
        mode=mode,
        axis_name=axes,
        microbatches=microbatches,
        stacked=normalize_stacked(stacked),
        clip_grad_norm=check_positive(clip_grad_norm, "clip_grad_norm"),
        loss_scale=loss_scale,
        donate=donate,
        labels=labels if mode.name in ("zero", "fsdp") else None,
        has_aux=has_aux,
        aux_reduce=aux_rules,
        state_reduce=state_rules,
        loss_axes=loss_axes,
        metrics=logged,
    )


UNIT_PRINTS_NEED_DETERMINISTIC = (
    "jaxsync.train_step: `TrainerMetrics(unit_prints=True)` records each deterministic "
    "unit's gradient fingerprints, and this step (mode {mode!r}) is not in deterministic "
    "mode: its devices' gradients are float sums over their own rows, whose bits change "
    "with the data-parallel size, so no unit has a fingerprint to compare. Pass "
    "`deterministic=jaxsync.Deterministic(units=...)` in a DDP or ZeRO mode "
    "(`jaxsync.ZeRO(deterministic=jaxsync.Deterministic(units=8))`), or drop `unit_prints`."
)
MULTI_STEPS = (
    "jaxsync.train_step: `tx` holds optax.MultiSteps, which accumulates gradients after "
    "the step has synced them: every call communicates a whole gradient, and "
    "`state.step` counts calls (microbatches), not optimizer steps. Pass "
    "`microbatches={k}` instead, with `tx` the optimizer MultiSteps wraps (without "
    "MultiSteps) and a batch {k} times as large (the {k} batches MultiSteps accumulated, "
    "one step): the step accumulates locally, syncs once and trains the same params. "
    "A clip inside it becomes `clip_grad_norm=` (it clips the accumulated gradient, as "
    "MultiSteps' inner clip did); with a jaxsync.weighted_loss, "
    "`normalize='microbatch'` keeps MultiSteps' mean of microbatch means (docs/porting.md)."
)
MULTI_STEPS_CLIP = (
    "jaxsync.train_step: `tx` holds optax.MultiSteps (every {k} calls) and "
    "`clip_grad_norm={clip}` is given: the step clips each call's gradient, one "
    "microbatch's, before MultiSteps accumulates it, and `state.step` counts microbatches, "
    "so this does not train what `optax.MultiSteps(optax.chain("
    "optax.clip_by_global_norm({clip}), inner), {k})` trains (the clip of the mean of "
    "{k} microbatch gradients). Drop MultiSteps and write "
    "`jaxsync.train_step(loss_fn, inner, mesh, ..., microbatches={k}, "
    "clip_grad_norm={clip})`, with `inner` the optimizer MultiSteps wraps (no clip in it) "
    "and a batch {k} times as large (the {k} batches MultiSteps accumulated, one step)."
)


class MultiStepsWarning(UserWarning):
    """``optax.MultiSteps`` inside a step's ``tx`` syncs every microbatch."""


def _multi_steps_k(tx: Any) -> tuple[bool, Any]:
    """Whether ``tx`` (or a label's optimizer) is an ``optax.MultiSteps``, and its k
    when it is a constant (else ``"k"``)."""
    for t in tx.values() if isinstance(tx, Mapping) else (tx,):
        found = multi_steps_of(t)
        if found is not None:
            try:  # the k it was built with, when it is a constant
                return True, int(found._every_k_schedule(0))
            except Exception:
                return True, "k"
    return False, None


def _check_multi_steps(tx: Any, clip_grad_norm: float | None) -> None:
    """``clip_grad_norm`` beside ``MultiSteps`` is refused (it would clip every
    microbatch); ``MultiSteps`` alone trains right but syncs every call: a warning."""
    found, k = _multi_steps_k(tx)
    if not found:
        return
    if clip_grad_norm is not None:
        raise ValueError(MULTI_STEPS_CLIP.format(k=k, clip=clip_grad_norm))
    warnings.warn(MULTI_STEPS.format(k=k), MultiStepsWarning, stacklevel=3)


def _is_tx(tx: Any) -> bool:
    return hasattr(tx, "init") and hasattr(tx, "update")


def _check_tx(tx: Any, labels: Any, mode: str) -> None:
    """``tx`` is one optax optimizer, or a mapping of them with ``labels``."""
    if labels is None:
        if isinstance(tx, Mapping):
            raise ValueError(
                f"`tx` is a mapping of label -> optimizer ({sorted(tx)}); pass `labels` (a "
                "pytree of those labels shaped like the params, or a function of the params "
                "returning one)."
            )
        if not _is_tx(tx):
            raise TypeError(f"`tx` must be an optax GradientTransformation, got {tx!r}.")
        return
    bad = (
        [f"{k!r}: {type(v).__name__}" for k, v in tx.items() if not _is_tx(v)]
        if isinstance(tx, Mapping) else [type(tx).__name__]
    )  # fmt: skip
    if bad:
        raise TypeError(
            "with `labels`, `tx` must be a mapping of label -> optax GradientTransformation; "
            f"got {', '.join(bad)}."
        )

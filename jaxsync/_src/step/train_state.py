"""The state a :func:`jaxsync.train_step` trains: one shape for DDP, ZeRO and FSDP.

Arrays only (a NamedTuple), so ``jit``, donation, ``eval_shape`` and orbax all
just work. What differs between the modes lives inside ``params`` (FSDP: flat
sharded units) and ``opt_state``; the step counter, the loss scale and the last
step's metrics are the same fields everywhere, so a trainer reads
``state.metrics.grad_norm`` whatever the mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..core.axes import to_varying
from ..core.tree_reduce import sq_sum_and_zeros
from ..optim.clip import clip_to_norm
from ..optim.logged import TreeNorms, with_norms
from ..optim.loss_scale import LossScale, LossScaleState, update_loss_scale
from ..optim.master import MasterState, master_update
from ..optim.metrics import next_metrics
from ..optim.state import StepMetrics
from .checks import check_state_dtypes

PyTree = Any


class GuardState(NamedTuple):
    """What the distributed optimizer keeps in its own state, for DDP and FSDP steps.

    Attributes:
      loss_scale: the loss scaler (scale 1 without scaling).
      metrics: diagnostics of the last step.
    """

    loss_scale: LossScaleState
    metrics: StepMetrics


class TrainState(NamedTuple):
    """Everything a training step reads and writes; global (sharded) arrays.

    ``state.metrics`` (:class:`jaxsync.StepMetrics`: grad norm, skipped steps...)
    and ``state.loss_scale`` read the same in every mode (for ``"fsdp"`` the
    per-param NaN/Inf fields are per unit, in ``fs.units`` order).

    Attributes:
      step: steps applied so far (skipped steps not counted), int32.
      params: the params, replicated (``"ddp"``, ``"zero"``; a 1-D ``"zero"`` step
        holds its stacked groups in the optimizer's master shards and keeps a
        ``HeldLayers`` marker in their place), or FSDP's :class:`jaxsync.FsdpShards`
        (``{unit: flat fp32 shard}``, padded: not the params; ``"fsdp"``); read them
        whole with ``TrainStep.params(state)``.
      opt_state: the optimizer's state: replicated optax state (``"ddp"``), a
        :class:`jaxsync.DistributedOptimizerState` (``"zero"``, which holds the
        loss scale and metrics itself), or optax state over the shards (``"fsdp"``).
      model_state: a flax NNX model's state besides its ``nnx.Param``s (a pure
        dict, replicated: batch statistics, RNG counters), as the model left it
        after the last step (floats averaged over devices); ``{}`` otherwise.
      guard: ``"ddp"``/``"fsdp"``: the loss scale and metrics; ``None`` for
        ``"zero"`` (they are in ``opt_state``).
      layout: int32 ``[2]``, replicated: the data-parallel size the flat shards were
        cut for (0 when no leaf depends on it) and a fingerprint of the layout options;
        a state restored by plain orbax onto a step of another layout is refused by
        name (:mod:`jaxsync._src.step.shard_tag`).
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    guard: GuardState | None
    layout: jax.Array | None = None

    @property
    def metrics(self) -> StepMetrics:
        """The last step's :class:`jaxsync.StepMetrics`, in every mode."""
        return (self.guard or self.opt_state).metrics

    @property
    def loss_scale(self) -> LossScaleState:
        """The loss scaler's state, in every mode."""
        return (self.guard or self.opt_state).loss_scale


def clip_and_check(
    grads: PyTree,
    sq_sum: jax.Array,
    zeros: jax.Array,
    clip_grad_norm: float | None,
) -> tuple[PyTree, jax.Array, jax.Array, jax.Array]:
    """Clips by the global norm (optax's arithmetic); returns grads, norm, finite, zeros."""
    grad_norm = jnp.sqrt(sq_sum)
    finite = jnp.isfinite(grad_norm)
    if clip_grad_norm is not None:
        grads = clip_to_norm(grads, grad_norm, clip_grad_norm)
    return grads, grad_norm, finite, zeros


def global_stats(grads: PyTree, axes: Sequence[str] = (), padding: int = 0) -> tuple[Any, Any]:
    """Squared L2 norm and count of exact zeros of ``grads``, summed over ``axes``.

    With ``axes`` the leaves are shards (disjoint over ``axes``), so the local sums
    are added up; ``padding`` zeros (shard padding, all devices together) are
    not counted.
    """
    sq, zeros = sq_sum_and_zeros(jax.tree.leaves(grads))
    if axes:
        stats = jax.lax.psum(to_varying(jnp.stack([sq, zeros]), tuple(axes)), tuple(axes))
        sq, zeros = stats[0], stats[1]
    return sq, jnp.round(zeros - padding).astype(jnp.int32)


def guarded_update(
    state: TrainState,
    tx: Any,
    grads: PyTree,
    flags_from: PyTree,
    stats: tuple[jax.Array, jax.Array],
    *,
    clip_grad_norm: float | None,
    loss_scale: LossScale,
    units: Any = None,
    branch: bool = False,
    norms: TreeNorms | None = None,
) -> tuple[PyTree, PyTree, LossScaleState, StepMetrics, jax.Array]:
    """One optax step on reduced, unscaled ``grads``, skipped if they are not finite.

    What the distributed optimizer does for ZeRO, for DDP and FSDP: global-norm
    clip, skip with state unchanged on NaN/Inf, loss-scale update, metrics.
    ``flags_from``: the gradients whose per-leaf NaN/Inf flags the metrics record
    (the local ones, before the reduction, where the step still has them);
    ``units`` (deterministic mode, a ``UnitRecord``) flags units instead, as ZeRO
    does, and may hold their gradient fingerprints for the metrics.
    ``branch``: skip with a ``lax.cond`` instead of a select per output. On XLA:CPU
    the predicate is host memory, so the branch is free, and the update compiles
    without the selects (the linen MLP's DDP step: 0.8-1.1 s against 1.1-1.3 s; the
    GPT's: 13.9 against 16.4 MB of temporaries). XLA:GPU must copy the predicate to
    the host and, on the 1.1B Llama-style model, gave the DDP step 9.3 GiB more
    temporaries: selects there.
    ``norms`` (a step built with ``metrics=``): how the update and the params add up
    to the norms in the metrics (:mod:`jaxsync._src.optim.logged`); None: not made.

    Returns:
      ``(params, opt_state, loss_scale, metrics, finite)``.
    """
    sq, zeros = stats
    grads, grad_norm, finite, zeros = clip_and_check(grads, sq, zeros, clip_grad_norm)
    # No zeroing of non-finite grads first: a skipped step keeps the old params and
    # state whole, so a NaN never leaves it (one select less per leaf).
    old = (state.params, state.opt_state)

    def update(grads: PyTree, old: tuple[PyTree, PyTree]) -> tuple[Any, ...]:
        if norms is not None and isinstance(old[1], MasterState):  # measure the inner's
            updates, opt_state, measured = master_update(norms.inner, grads, old[1], old[0])
        else:
            updates, opt_state = tx.update(grads, old[1], old[0])
            measured = updates
        params = jax.tree.map(lambda p, u: jnp.asarray(p + u).astype(p.dtype), old[0], updates)
        check_state_dtypes(opt_state, old[1])
        # optax.apply_updates' arithmetic; with norms, the update's local sums too
        return (params, opt_state) if norms is None else (params, opt_state, norms.local(measured))

    # With norms, selects: a branch would need the update's sums typed alike on both
    # sides (device-varying on shards), and those are what the update makes.
    if branch and norms is None:
        params, opt_state = jax.lax.cond(finite, update, lambda g, o: o, grads, old)
        sums = []
    else:
        params, opt_state, *sums = update(grads, old)
        params, opt_state = jax.tree.map(
            lambda a, b: jnp.where(finite, a, b), (params, opt_state), old
        )
        sums = [tuple(jnp.where(finite, x, 0.0) for x in s) for s in sums]
    scale = update_loss_scale(loss_scale, state.loss_scale, finite)
    metrics = next_metrics(state.metrics, flags_from, finite, grad_norm, zeros, units)
    if norms is not None:
        kept = opt_state.master if isinstance(opt_state, MasterState) else params
        metrics = with_norms(metrics, norms.total(sums[0], kept))
    return params, opt_state, scale, metrics, finite


def padding_of(layouts: Sequence[Any]) -> int:
    """Padding elements of FSDP unit buffers (over all devices)."""
    return sum((b.size - b.used) * math.prod(b.lead) for layout in layouts for b in layout.buffers)

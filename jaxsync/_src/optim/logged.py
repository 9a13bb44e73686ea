"""What a trainer logs beside the gradient norm: update norm, param norm, learning rate.

Opt-in, once per step (``train_step(..., metrics=jaxsync.TrainerMetrics())``), because
each costs a pass the default step does not make: the norms read the update and the
params once more where the update is made (on the shards under ZeRO and FSDP, then
one all-reduce of two floats), and a state saved with them has three more leaves.
With the option off nothing here runs and ``state.metrics`` holds ``None`` for them.
In deterministic mode it can also turn on the units' gradient fingerprints
(``unit_prints``, computed in :mod:`jaxsync._src.deterministic.exact`), the record
:class:`jaxsync.Rerun` names a one-off fault's device from.

The values mean what they mean with plain optax on one device on the global batch:
``optax.global_norm(updates)`` of the ``updates`` the optimizer returned (after
clipping), ``optax.global_norm(params)`` after the step, and the rate the update used.

Padding of flat shards counts nothing: its gradients and master values start at
zero, and the elementwise optimizers that may run on flat shards (``sgd``, ``adam``,
``adamw``, ``lion``..., probed at ``init``) map a zero gradient on a zero param to a
zero update, so it stays zero (whole-matrix owners write zeros between their
matrices themselves). :func:`check_zero_padding` asks the optimizer once at ``init``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.axes import to_varying
from ..core.validate import check_bool, check_option
from ..deterministic.fixed_point import exact_total
from .state import StepMetrics

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainerMetrics:
    """Turns on the metrics a trainer logs: ``state.metrics.update_norm``,
    ``param_norm`` and ``learning_rate`` (see :class:`jaxsync.StepMetrics`).

    Attributes:
      learning_rate: the optimizer's learning rate: an optax schedule (evaluated at
        the optimizer's step count before the update, as optax does) or a constant.
        ``None``: read from an ``optax.inject_hyperparams`` state in the optimizer
        (its ``hyperparams["learning_rate"]``, the first in tree order), else not
        recorded (``state.metrics.learning_rate`` stays ``None``).
      norms: record ``update_norm`` and ``param_norm`` (default). ``False``: only
        what the other fields turn on (``TrainerMetrics(norms=False,
        unit_prints=True)``: the units' fingerprints alone).
      unit_prints: deterministic mode only (:class:`jaxsync.Deterministic`): also
        record ``state.metrics.unit_prints``, ``uint32[units, param leaves]``, every
        unit's gradient of every param reduced to a fingerprint of its bits, so that
        :class:`jaxsync.Rerun` names the device of a one-off fault that left the
        gradients finite (a flipped bit). Cheap: one integer reduction per unit over
        the unit gradients the step holds anyway for its exact sync, then one
        all-gather of ``4 * units * leaves`` bytes. On 8 CPU devices (1.6M-param
        MLP): with 8 units no more temporaries and no step time above noise; with 32
        (four per device) ZeRO +0.13 MB of temporaries and +3% time, DDP +6.4 MB
        and +6% (docs/checks.md). A step without ``Deterministic`` refuses it.

    Example:
      >>> schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000)
      >>> step = jaxsync.train_step(loss_fn, optax.adamw(schedule), mesh,
      ...                           metrics=jaxsync.TrainerMetrics(learning_rate=schedule))
      >>> state, loss = step(state, batch)
      >>> m = state.metrics   # m.grad_norm, m.update_norm, m.param_norm, m.learning_rate
    """

    learning_rate: Callable[[Any], Any] | float | None = None
    norms: bool = True
    unit_prints: bool = False

    def __post_init__(self) -> None:
        check_bool(self.norms, "TrainerMetrics.norms")
        check_bool(self.unit_prints, "TrainerMetrics.unit_prints")
        lr = self.learning_rate
        number = isinstance(lr, numbers.Real) and not isinstance(lr, bool)
        if lr is not None and not callable(lr) and not number:
            raise TypeError(
                "TrainerMetrics: `learning_rate` must be an optax schedule (a function of "
                f"the step count), a number or None, got {type(lr).__name__}."
            )


def check_metrics(metrics: Any) -> TrainerMetrics | None:
    """``train_step``'s ``metrics=``: None/False (off), True (defaults) or a value."""
    return check_option(metrics, TrainerMetrics, "`metrics` must be a jaxsync.TrainerMetrics")


def norms_on(cfg: TrainerMetrics | None) -> bool:
    """Whether a step with ``metrics=cfg`` records the update and param norms."""
    return cfg is not None and cfg.norms


# ---------------------------------------------------------------- learning rate
def _injected(opt_state: PyTree) -> list[Any]:
    """``hyperparams["learning_rate"]`` of every ``optax.inject_hyperparams`` state."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "learning_rate")
    return [
        v for path, v in found
        if len(path) >= 2 and getattr(path[-2], "name", None) == "hyperparams"
        and hasattr(v, "shape") and tuple(v.shape) == ()
    ]  # fmt: skip


def records_rate(cfg: TrainerMetrics | None, opt_state: PyTree) -> bool:
    """Whether the metrics hold a learning rate (given, or found in ``opt_state``)."""
    return cfg is not None and (cfg.learning_rate is not None or bool(_injected(opt_state)))


def rate_of(cfg: TrainerMetrics | None, count: jax.Array, opt_state: PyTree) -> jax.Array | None:
    """This step's learning rate: ``cfg``'s schedule at ``count`` (the optimizer's
    count before the update), or the one ``opt_state`` (after the update) holds."""
    if cfg is None:
        return None
    lr = cfg.learning_rate
    if lr is None:
        found = _injected(opt_state)
        return jnp.asarray(found[0], jnp.float32) if found else None
    return jnp.asarray(lr(count) if callable(lr) else lr, jnp.float32)


def with_rate(metrics: StepMetrics, prev: StepMetrics, rate: Any, finite: jax.Array) -> Any:
    """``metrics`` with the rate of the last applied update (``prev``'s on a skip)."""
    if rate is None or prev.learning_rate is None:
        return metrics
    return metrics._replace(learning_rate=jnp.where(finite, rate, prev.learning_rate))


def with_norms(metrics: StepMetrics, sums: jax.Array | None) -> StepMetrics:
    """``metrics`` with the norms from ``sums`` = [update sq, param sq] (None: off)."""
    if sums is None:
        return metrics
    return metrics._replace(update_norm=jnp.sqrt(sums[0]), param_norm=jnp.sqrt(sums[1]))


# ------------------------------------------------------------------------ norms
def sq(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def tree_sq(tree: PyTree) -> jax.Array:
    """Sum of squares of every float leaf of ``tree``, in fp32."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum((sq(x) for x in leaves), jnp.zeros((), jnp.float32))


@dataclasses.dataclass(frozen=True)
class TreeNorms:
    """How a step's ``(updates, params)`` trees add up to global sums of squares.

    ``cut``: per leaf (in tree-leaf order), whether it is a shard disjoint over
    ``axes`` (its local sums are added over them) or whole on every device;
    ``None``: every leaf is a shard (``axes`` non-empty) or every leaf whole.
    ``inner``: the user's optimizer, where the step's runs it under
    :func:`~jaxsync._src.optim.master.with_fp32_master` (its updates are the ones
    measured, not the master's distance to the low-precision params).
    """

    axes: tuple[str, ...] = ()
    cut: tuple[bool, ...] | None = None
    inner: Any = None

    def local(self, tree: PyTree) -> tuple[jax.Array, jax.Array]:
        """``(sum over shard leaves, sum over whole leaves)`` of this device."""
        leaves = jax.tree.leaves(tree)
        cut = self.cut if self.cut is not None else (bool(self.axes),) * len(leaves)
        zero = jnp.zeros((), jnp.float32)
        part = sum((sq(x) for x, c in zip(leaves, cut, strict=True) if c), zero)
        whole = sum((sq(x) for x, c in zip(leaves, cut, strict=True) if not c), zero)
        return part, whole

    def total(self, updates: tuple[jax.Array, jax.Array], params: PyTree) -> jax.Array:
        """``[update sq, param sq]`` over the mesh: one psum of two floats (none when
        every leaf is whole)."""
        (u_cut, u_whole), (p_cut, p_whole) = updates, self.local(params)
        out = jnp.stack([u_whole, p_whole])
        if self.axes and (self.cut is None or any(self.cut)):
            out = out + jax.lax.psum(to_varying(jnp.stack([u_cut, p_cut]), self.axes), self.axes)
        return out


def shard_weights(layout: Any) -> tuple[float, ...]:
    """Per buffer of the distributed optimizer's ``layout``: 1 / (copies of each of its
    shards over the mesh), as its gradient norm counts them. Shards are disjoint over
    the buffer's axes and distinct over its ``varying`` axes; the other axes hold
    copies."""
    mesh = dict(jax.sharding.get_abstract_mesh().shape)
    return tuple(
        1.0 / math.prod(n for a, n in mesh.items() if a not in b.key.axes + b.key.varying)
        for b in layout.buffers
    )


def shard_sums(
    plan: Any,
    layout: Any,
    updates: Sequence[jax.Array],
    masters: Sequence[jax.Array],
    finite: jax.Array,
) -> jax.Array:
    """``[update sq, param sq]`` from the distributed optimizer's shards (``[layers,
    shard]`` for stacked groups, held or not: summed whole), per buffer weighted by
    :func:`shard_weights` and summed over the whole mesh.

    In deterministic mode (``plan.deterministic``: plain data parallelism, the data
    axes the whole mesh) they are summed in fixed point (:func:`exact_total`), so no
    bit depends on where the shards are cut, that is on the data-parallel size.
    """
    ups = [jnp.where(finite, u.astype(jnp.float32), 0.0) for u in updates]
    if plan.deterministic is not None:
        u = exact_total([jnp.square(x) for x in ups], plan.axes)
        p = exact_total([jnp.square(m.astype(jnp.float32)) for m in masters], plan.axes)
        return jnp.stack([u, p])
    weights = shard_weights(layout)
    local = sum(
        (jnp.stack([sq(u), sq(m)]) * w for u, m, w in zip(ups, masters, weights, strict=True)),
        jnp.zeros((2,), jnp.float32),
    )
    every = tuple(jax.sharding.get_abstract_mesh().axis_names)
    return jax.lax.psum(to_varying(local, every), every)


# ------------------------------------------------------------------ padding check
ZERO_PADDING = (
    "{fn}: `metrics=` counts the norms on flat shards, whose padding holds zero "
    "gradients on zero params, and needs the optimizer{what} to leave those at zero; it "
    "made a non-zero update ({value:.3g}) of zero gradients on zero params. Turn the "
    "metrics off, or use an optimizer whose update of a zero gradient on a zero param "
    "is zero (sgd, adam, adamw, lion, rmsprop...)."
)


def check_zero_padding(tx: Any, fn: str) -> None:
    """Refuses an optimizer that moves zero params under zero gradients (padding would
    then count in the norms); one tiny update on the host, per optimizer."""
    txs = tx.items() if isinstance(tx, Mapping) else [(None, tx)]
    for label, t in txs:
        if not (hasattr(t, "init") and hasattr(t, "update")):
            continue
        try:  # on a device of this process (with several, jax.devices() lists others')
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                zeros = jnp.zeros((4,), jnp.float32)
                u, s = t.update(zeros, t.init(zeros), zeros)
                u, _ = t.update(zeros, s, zeros)
            value = float(np.max(np.abs(np.asarray(u))))
        except Exception:  # whole-matrix optimizers (muon) own their padding
            continue
        if not math.isfinite(value) or value != 0.0:
            what = "" if label is None else f" for label {label!r}"
            raise ValueError(ZERO_PADDING.format(fn=fn, what=what, value=value))

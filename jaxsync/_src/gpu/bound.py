"""The communication bound: the fastest a data-parallel step could be, by XLA's model.

A data-parallel step cannot beat one GPU doing its own share of the work alone:
the forward and backward of its rows, and its 1/N of the optimizer. Nor can it
beat the collectives it must make, run alone on the mesh. With every byte hidden
behind compute, the step takes the larger of the two; with none hidden, their
sum. :func:`communication_bound` prices both halves with
:func:`~jaxsync.schedule_report` (so with XLA's own cost model, as the steps it is
set beside), and a report's ``step_us`` over the bound is the method's
*efficiency*: how much of what is possible it reaches.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..optim.elementwise import check_elementwise
from .schedule import schedule_report
from .target import gpu_kind, gpu_topology
from .timings import ScheduleReport

#: What ZeRO and FSDP-that-keeps-its-layers must move per step: the gradients
#: reduce-scattered and the new params all-gathered, both in bf16.
ZERO_MOVES: tuple[tuple[str, Any], ...] = (
    ("reduce-scatter", jnp.bfloat16),
    ("all-gather", jnp.bfloat16),
)
_KINDS = ("reduce-scatter", "all-gather", "all-reduce")


@dataclasses.dataclass(frozen=True)
class CommunicationBound:
    """Both halves of the bound, in microseconds per step.

    Attributes:
      compute_us: one GPU's rows forward and backward, compiled alone, plus its
        1/N of the optimizer update.
      comm_us: the method's collectives, one of each over the whole parameter
        vector, run alone on the mesh.
      moved_bytes: bytes of those collectives' results per GPU.
      devices: the data-parallel size N.
    """

    compute_us: float
    comm_us: float
    moved_bytes: int
    devices: int

    @property
    def bound_us(self) -> float:
        """Every byte hidden behind compute: the larger half."""
        return max(self.compute_us, self.comm_us)

    @property
    def serial_us(self) -> float:
        """Nothing hidden: both halves one after the other."""
        return self.compute_us + self.comm_us

    def efficiency(self, report: ScheduleReport, reading: str = "statistics") -> float:
        """``bound / step`` of a priced step (1.0: at the bound); ``reading`` is
        ``"statistics"`` (``step_us``) or ``"timeline"`` (``makespan_us``)."""
        if reading not in ("statistics", "timeline"):
            raise ValueError(f"`reading` must be 'statistics' or 'timeline', got {reading!r}.")
        step = report.step_us if reading == "statistics" else report.makespan_us
        return self.bound_us / step

    def __str__(self) -> str:
        return (
            f"bound {self.bound_us / 1e3:.2f} ms per step on {self.devices} GPUs: compute "
            f"{self.compute_us / 1e3:.2f} ms, communication {self.comm_us / 1e3:.2f} ms "
            f"({self.moved_bytes / 2**20:.0f} MiB per GPU)"
        )


def communication_bound(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    rows: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: str = "data",
    moves: Sequence[tuple[str, Any]] = ZERO_MOVES,
    options: Mapping[str, Any] | None = None,
) -> CommunicationBound:
    """Prices the bound of a data-parallel step of ``loss_fn`` on a compile-only mesh.

    Args:
      loss_fn: ``loss_fn(params, rows) -> scalar``, as the step runs it.
      params: the model's params as the forward reads them (``ShapeDtypeStruct``s
        or arrays; e.g. bf16).
      rows: ONE GPU's batch (``ShapeDtypeStruct``s or arrays).
      optimizer: the update each GPU applies to its 1/N of the fp32 master
        (an elementwise optax optimizer, with clipping if the step clips).
      mesh: a :func:`jaxsync.gpu_topology` mesh; ``axis_name`` is its data axis.
      moves: the method's collectives and their wire dtype, each over the whole
        parameter vector (default :data:`ZERO_MOVES`; DDP: ``(("all-reduce",
        jnp.float32),)``).
      options: XLA options for all three compiles.

    Returns:
      A :class:`CommunicationBound`.

    Raises:
      ValueError: ``axis_name`` is not an axis of ``mesh``, the mesh is not a
        :func:`jaxsync.gpu_topology` one, an unknown ``moves`` kind, or an
        ``optimizer`` that is not elementwise (factored adafactor, lamb, a global-norm
        clip: the bound would price other work than it does).
      TypeError: ``optimizer`` is not an optax transformation, ``mesh`` not a Mesh.
    """
    _check_args(params, optimizer, mesh, axis_name)
    n = mesh.shape[axis_name]
    kind = gpu_kind(mesh)
    if kind is None:
        raise ValueError(
            "communication_bound needs a jaxsync.gpu_topology mesh of a GPU in jaxsync.GPUS; "
            f"this mesh's devices are {mesh.devices.flat[0].device_kind!r}."
        )
    for move, _ in moves:
        if move not in _KINDS:
            raise ValueError(f"`moves` kinds must be among {_KINDS}, got {move!r}.")
    size = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    shard = -(-size // n)
    # One GPU alone: a two-GPU mesh with everything replicated compiles to exactly
    # the one-GPU program (the pricing twin needs a second GPU for its probe).
    pair = gpu_topology(kind, gpus_per_host=2)
    rep = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(pair, P())), tree
    )
    grads = schedule_report(
        jax.jit(jax.value_and_grad(loss_fn)).lower(rep(params), rep(rows)), options=options
    )
    vec = jax.ShapeDtypeStruct((shard,), jnp.float32, sharding=NamedSharding(pair, P()))

    def update(g, state, master):
        updates, state = optimizer.update(g, state, master)
        master = optax.apply_updates(master, updates)
        return master.astype(jnp.bfloat16), master, state

    state = rep(jax.eval_shape(optimizer.init, vec))
    opt = schedule_report(jax.jit(update).lower(vec, state, vec), options=options)
    if n == 1:  # nothing to move (and no collective for XLA to schedule)
        return CommunicationBound(grads.step_us + opt.step_us, 0.0, 0, n)
    comm, moved = _comm(mesh, axis_name, moves, shard * n, options)
    return CommunicationBound(grads.step_us + opt.step_us, comm.step_us, moved, n)


NOT_ELEMENTWISE_BOUND = (
    "communication_bound: `optimizer` is not elementwise ({detail}). The bound prices "
    "each GPU's update of its 1/N of the parameters as one flat fp32 vector, which only "
    "an elementwise optimizer (sgd, momentum, adam, adamw, lion, rmsprop, ...) updates as "
    "it would the parameter tree: a factored or whole-matrix one (adafactor, lamb, lars, "
    "muon, `optax.clip_by_global_norm`) would be priced for other work than it does. Pass "
    "the elementwise part of your optimizer (e.g. `optax.adamw(lr)` for "
    "`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))`)."
)


def _check_args(params: Any, optimizer: Any, mesh: Any, axis_name: Any) -> None:
    """The arguments' checks, before anything is compiled."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh from jaxsync.gpu_topology(...), got {mesh!r}."
        )
    if not isinstance(axis_name, str) or axis_name not in mesh.shape:
        raise ValueError(
            f"`axis_name` must name the data axis of `mesh`, one of its axes "
            f"{dict(mesh.shape)}; got {axis_name!r}. Pass the axis the batch is split "
            "over (e.g. `axis_name='data'`), or build the mesh with that axis: "
            f"jaxsync.gpu_topology(..., axes={{{axis_name!r}: ...}})."
        )
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "`optimizer` must be an optax.GradientTransformation (the update each GPU "
            "applies to its 1/N of the fp32 master, e.g. `optax.adamw(1e-4)`), got "
            f"{optimizer!r}."
        )
    try:
        check_elementwise(optimizer, params, "`optimizer` of jaxsync.communication_bound")
    except ValueError as e:
        if e.__cause__ is not None and str(e).startswith("could not probe"):
            raise ValueError(
                "communication_bound: `optimizer` raised on a tree shaped like `params` "
                f"({e.__cause__!r}); pass the optax optimizer the step runs on these params."
            ) from e
        raise ValueError(NOT_ELEMENTWISE_BOUND.format(detail=_probe_detail(str(e)))) from e


def _probe_detail(message: str) -> str:
    """What the elementwise probe saw, out of its message (written for train_step)."""
    for pattern in (
        r"first seen for param .*?elements differ",
        r"\d+ update elements on shards, \d+ on the tree",
        r"on a flat shard it raised .*?(?=\)\. |\)$)",
    ):
        m = re.search(pattern, message, re.S)
        if m:
            return m.group(0)
    return "the probe's message is chained below"


def _comm(mesh: Mesh, axis: str, moves, padded: int, options) -> tuple[ScheduleReport, int]:
    """The collectives alone, each fed by the one before (as in a step: the gathered
    params come from the update of the scattered gradients)."""
    n = mesh.shape[axis]
    first = moves[0]
    length = padded // n if first[0] == "all-gather" else padded
    x = jax.ShapeDtypeStruct((length * n,), first[1], sharding=NamedSharding(mesh, P(axis)))

    @partial(jax.shard_map, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False)
    def run(v):
        for move, dtype in moves:
            v = v.astype(dtype)
            if move == "all-gather":
                v = jax.lax.all_gather(v[: padded // n], axis, tiled=True)
            elif move == "reduce-scatter":
                v = jax.lax.psum_scatter(_fill(v, padded), axis, tiled=True)
            else:
                v = jax.lax.psum(_fill(v, padded), axis)
        return v[:length] if v.shape[0] >= length else _fill(v, length)

    out = schedule_report(jax.jit(run).lower(x), options=options)
    return out, sum(c.bytes * c.runs for c in out.collectives)


def _fill(v: jax.Array, length: int) -> jax.Array:
    """``v`` at ``length``: itself, or tiled (the bytes, not the values, matter here)."""
    return v if v.shape[0] == length else jnp.tile(v, -(-length // v.shape[0]))[:length]

"""Skipped-step metrics as data, and the report that reads them back on the host.

:func:`next_metrics` runs inside the step with no host sync; :func:`nonfinite_report`
is the one function here that reads values: the metrics the step recorded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.axes import to_varying
from ..core.names import param_name
from ..core.tree_reduce import nonfinite_leaves
from ..sync.scan_sync import ShardedGrads
from .state import StepMetrics

PyTree = Any


# ------------------------------------------------------- skipped-step metrics
def next_metrics(
    prev: Any,
    grads: PyTree,
    finite: jax.Array,
    grad_norm: jax.Array,
    num_zeros: jax.Array,
    units: Any = None,
) -> Any:
    """The step's :class:`~jaxsync.StepMetrics`, with no host sync.

    On the first step of a run of skipped steps it records which params had
    non-finite *local* gradients and on which devices: a ``psum`` and a ``pmin`` of
    one int per param over the mesh (run every step, kept only then).
    With ``units`` (a :class:`~jaxsync._src.deterministic.exact.UnitRecord`,
    deterministic mode) it counts and names *units* instead of devices, so the
    metrics do not depend on the data-parallel size either; where the record holds
    fingerprints, it gathers them, every step, into ``unit_prints`` (``[units,
    params]``, the same on every device: one all-gather of 4 bytes per unit and param).
    """
    unit_flags = None if units is None else units.flags
    skipped = jnp.logical_not(finite)
    record = skipped & (prev.consecutive_skips == 0)
    # One small reduction per leaf, computed where the grads are made; the
    # conditional then holds only these flags, not the grads (holding the grads
    # for it kept them all alive to the end of the step: +40% temporaries).
    if unit_flags is not None:
        flags = unit_flags.astype(jnp.int32)
    elif isinstance(grads, ShardedGrads):
        flags = grads.nonfinite.astype(jnp.int32)  # recorded before the in-loop reduction
    else:
        flags = nonfinite_leaves(jax.tree.leaves(grads)).astype(jnp.int32)

    def locate(flags: jax.Array) -> tuple[jax.Array, jax.Array]:
        # The manual axes: on a 2-D step the compiler's axes hold no per-device flags.
        mesh = jax.sharding.get_abstract_mesh()
        mesh_axes = tuple(a for a in mesh.axis_names if a in mesh.manual_axes)
        flags = to_varying(flags, mesh_axes)
        device = jax.lax.axis_index(mesh_axes)
        if unit_flags is not None:  # global unit index of each row, then per param
            k = flags.shape[0]
            unit = (device * k + jnp.arange(k, dtype=jnp.int32))[:, None]
            none = jnp.iinfo(jnp.int32).max
            count = jax.lax.psum(jnp.sum(flags, axis=0), mesh_axes)
            first = jax.lax.pmin(jnp.min(jnp.where(flags > 0, unit, none), axis=0), mesh_axes)
            return count, jnp.where(count > 0, first, -1).astype(jnp.int32)
        count = jax.lax.psum(flags, mesh_axes)
        none = jnp.iinfo(jnp.int32).max
        first = jax.lax.pmin(jnp.where(flags > 0, device, none), mesh_axes)
        return count, jnp.where(count > 0, first, -1).astype(jnp.int32)

    # Run every step and selected, not under a `lax.cond`: XLA:CPU runs a conditional
    # concurrently with the collectives it does not depend on (the params' all-gather),
    # so devices could enter its psum and another collective in different orders and
    # deadlock (seen with whole-matrix owners, whose switch makes ranks finish apart).
    # Two all-reduces of one int per param: no measurable cost.
    count, first = locate(flags)
    prints = prev.unit_prints
    if units is not None and units.prints is not None:
        mesh = jax.sharding.get_abstract_mesh()
        axes = tuple(a for a in mesh.axis_names if a in mesh.manual_axes)
        # Device-major: global unit d * k + j, as `first_nonfinite_device` numbers them.
        mine = to_varying(units.prints, axes)
        prints = jax.lax.all_gather(mine, axes, axis=0, tiled=True, to="invarying")
    count = jnp.where(record, count, prev.nonfinite_devices)
    first = jnp.where(record, first, prev.first_nonfinite_device)
    return StepMetrics(
        grad_norm=grad_norm,
        num_zeros=num_zeros,
        skipped=skipped,
        skipped_steps=prev.skipped_steps + skipped.astype(jnp.int32),
        consecutive_skips=jnp.where(finite, 0, prev.consecutive_skips + 1).astype(jnp.int32),
        nonfinite_devices=count,
        first_nonfinite_device=first,
        # The trainer's metrics (optim.logged) carried over until the step sets them.
        update_norm=prev.update_norm,
        param_norm=prev.param_norm,
        learning_rate=prev.learning_rate,
        unit_prints=prints,
    )


def nonfinite_report(state: Any, params: PyTree, mesh: Any = None) -> str:
    """A message about skipped steps and the params and devices at fault ("" if none).

    Runs on the host, from the metrics the step recorded (see
    :class:`jaxsync.StepMetrics`); call it every few hundred steps or when
    ``metrics.skipped`` is set.

    Args:
      state: a :class:`jaxsync.DistributedOptimizerState` (or its ``metrics``).
      params: the params pytree (for names; arrays or ShapeDtypeStructs).
      mesh: the step's mesh, to name each device by its mesh coordinates.

    Example:
      >>> if msg := jaxsync.nonfinite_report(opt_state, params, mesh):
      ...     print(msg)
    """
    metrics = getattr(state, "metrics", state)
    m = jax.device_get(metrics)
    if int(m.skipped_steps) == 0:
        return ""
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    count = np.asarray(m.nonfinite_devices).ravel()
    first = np.asarray(m.first_nonfinite_device).ravel()
    if count.size != len(names):
        raise ValueError(
            f"`params` has {len(names)} leaves, but the metrics were recorded for "
            f"{count.size} params; pass the params the optimizer was built for (a "
            "jaxsync.train_step state in mode 'fsdp' records its units: pass "
            "`state.params`)."
        )

    def where(d: int) -> str:
        if mesh is None:
            return f"device {d}"
        coords = np.unravel_index(d, mesh.devices.shape)
        at = ", ".join(f"{a}={int(c)}" for a, c in zip(mesh.axis_names, coords, strict=True))
        return f"device {d} ({at})"

    run = int(m.consecutive_skips)
    lines = [
        f"the optimizer skipped {int(m.skipped_steps)} step(s) for non-finite gradients"
        + (f"; the last {run} step(s) in a row" if run else "; the last step was applied")
        + "."
    ]
    bad = [i for i in range(len(names)) if count[i] > 0]
    lines.append(
        "On the first step of the latest run of skipped steps, local gradients held NaN/Inf:"
        if bad
        else "On the first step of the latest run of skipped steps, every device's local "
        "gradients were finite: the overflow came from the reduction (an fp16/bf16 "
        "`reduce_dtype`?) or from the loss scale."
    )
    lines += [
        f"  {names[i]} on {int(count[i])} device(s), first on {where(int(first[i]))}"
        for i in bad[:20]
    ]
    if len(bad) > 20:
        lines.append(f"  ... and {len(bad) - 20} more params")
    if bad:
        lines.append(
            "Lower the learning rate, use loss scaling for fp16, or check the data those "
            "devices were fed."
        )
    return "\n".join(lines)



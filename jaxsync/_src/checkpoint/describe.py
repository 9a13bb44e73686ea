"""What a checkpoint records about the optimizer, to catch a restore into another one.

The arrays of a checkpoint do not say which settings produced them: a state
saved with ``loss_scale=DynamicLossScale(4096)`` restores without complaint into
an optimizer with no loss scaling, which then keeps dividing every gradient by
4096. So :class:`~jaxsync.Checkpointer` stores a small JSON description of the
optimizer next to the arrays and compares it at restore.

Described are the settings that change what the saved state means or how the
next step uses it: the loss scaler and its settings, the labels of each param,
the structure and dtypes of the inner optimizer's state, global-norm clipping,
the reduction dtype, the data-parallel axis names and the finalize rules. Not
described are the bucket size and the data-parallel size: checkpoints are meant
to move between those.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..layout.ownership import WholeMatrices
from ..optim.loss_scale import DynamicLossScale, LossScale
from ..optim.optimizer import DistributedOptimizer
from ..optim.portable import param_name

PyTree = Any

#: ``kind`` of a :func:`jaxsync.distributed_optimizer`'s description.
DISTRIBUTED = "jaxsync.distributed_optimizer"
#: ``kind`` of any other optimizer state (plain optax, ``sync_grads`` + optax).
OPTAX = "optax"

# Labels that differ are listed up to this many params.
_MAX_LISTED = 8


def _structure(tree: PyTree) -> str:
    """Tree structure and leaf dtypes: what an optax state's *type* is made of."""
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = [str(jnp.dtype(getattr(x, "dtype", type(x)))) for x in leaves]
    return f"{treedef} with leaf dtypes {dtypes}"


def _inner_structure(inner: Any) -> str:
    # The inner transformation runs on flat fp32 shards: probe it on one. Owned
    # (whole-matrix) ones run on each matrix: probe them on a matrix.
    shape, prefix = ((8, 8), "whole matrices: ") if isinstance(inner, WholeMatrices) else ((8,), "")
    try:
        return prefix + _structure(
            jax.eval_shape(inner.init, jax.ShapeDtypeStruct(shape, jnp.float32))
        )
    except Exception as e:  # an init that cannot be traced abstractly: not comparable
        return f"unknown ({type(e).__name__})"


def _loss_scale(loss_scale: LossScale) -> dict[str, Any]:
    if loss_scale is None:
        return {"kind": "none"}
    if isinstance(loss_scale, DynamicLossScale):
        return {"kind": "dynamic", **dataclasses.asdict(loss_scale)}
    return {"kind": "constant", "scale": float(loss_scale)}


def describe_optimizer(tx: Any, params: PyTree, opt_state: PyTree) -> dict[str, Any]:
    """A JSON-serialisable description of the optimizer that made ``opt_state``.

    Args:
      tx: the optimizer; a :class:`~jaxsync.DistributedOptimizer` is described by
        its settings, anything else by the structure of ``opt_state``.
      params: the params (arrays or ``ShapeDtypeStruct``s), for the labels.
      opt_state: the optimizer state (or its abstract form).
    """
    if not isinstance(tx, DistributedOptimizer):
        return {"kind": OPTAX, "state": _structure(opt_state)}
    plan = tx.__dict__["config"]
    labels = plan.label_tree(params)
    if labels is not None:
        tree = jax.tree.map(lambda _, lab: lab, params, labels)
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        labels = {param_name(path): str(lab) for path, lab in flat}
    inner = plan.inner if isinstance(plan.inner, Mapping) else {"all": plan.inner}
    return {
        "kind": DISTRIBUTED,
        "axis_name": list(plan.axes),
        "labels": labels,
        "inner": {k: _inner_structure(v) for k, v in sorted(inner.items())},
        "clip_grad_norm": None if plan.clip_grad_norm is None else float(plan.clip_grad_norm),
        "loss_scale": _loss_scale(plan.loss_scale),
        "reduce_dtype": str(jnp.dtype(plan.reduce_dtype)),
        "rules": None if plan.rules is None else repr(plan.rules),
    }


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def optimizer_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One line per setting that differs between two :func:`describe_optimizer` results."""
    if saved.get("kind") != now.get("kind"):
        return [f"  optimizer: saved from {saved.get('kind')}, restoring into {now.get('kind')}"]
    problems = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        # The data axes' names are recorded for the reader; a state restores under
        # others (layout.buffer_names.saved_entry matches its buffers by their params).
        if key in ("kind", "axis_name") or a == b:
            continue
        if key == "labels" and isinstance(a, dict) and isinstance(b, dict):
            changed = [
                f"{n}: {a[n]} -> {b[n]}"
                # Params only in one of them are the model's difference, not the
                # optimizer's: the comparison of the arrays reports those.
                for n in sorted(set(a) & set(b))
                if a[n] != b[n]
            ]
            if not changed:
                continue
            more = f" (and {len(changed) - _MAX_LISTED} more)" if len(changed) > _MAX_LISTED else ""
            problems.append(
                f"  labels differ for {len(changed)} param(s): "
                + ", ".join(changed[:_MAX_LISTED])
                + more
            )
        elif key == "inner" and isinstance(a, dict) and isinstance(b, dict):
            for label in sorted(set(a) | set(b)):
                x, y = a.get(label), b.get(label)
                if x != y and not (str(x).startswith("unknown") or str(y).startswith("unknown")):
                    problems.append(
                        f"  inner optimizer state for label {label!r}: saved {x}, now {y}"
                    )
        else:
            problems.append(f"  {key}: saved {_show(a)}, now {_show(b)}")
    return problems

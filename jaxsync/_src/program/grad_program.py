"""How the library takes a gradient: traced once, rewritten, evaluated.

``jax.value_and_grad`` leaves six things to XLA that cost memory or time in a
scanned model, and XLA cannot undo them: the loop-invariant broadcasts JAX hoists
out of a differentiated scan (:mod:`sink`), where the scheduler places the gradients
that are ready before the backward loop and the first layer's recompute beside the
loss's backward (:mod:`ready`), the CSE barrier of a layer rematerialised inside
the loop, which keeps the backward from gathering the next layer early
(:mod:`loop_remat`), the logits-sized scatter a label gather transposes to
(:mod:`row_scatter`), and the stack of reduced gradients the backward loop fills
beside the stack of saved inputs whose rows it has already read (:mod:`grad_rows`;
across hosts it also runs the reductions ready before the loop beside the loop's first
layer, :mod:`beside`).
:func:`value_and_grad` traces ``jax.value_and_grad(fun)`` to its program, applies the
rewrites, and evaluates the rewritten program: the same values, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .grad_rows import grads_in_activation_rows
from .loop_remat import drop_loop_barriers
from .ready import ready_first, recompute_late
from .row_scatter import select_row_scatters
from .sink import sink_broadcasts


def value_and_grad(fun: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``jax.value_and_grad(fun, **kwargs)`` run from its rewritten program."""
    return rewritten(jax.value_and_grad(fun, **kwargs))


def rewritten(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` traced once, its program rewritten (:func:`loop_remat.drop_loop_barriers`,
    :func:`row_scatter.select_row_scatters`, :func:`sink.sink_broadcasts`,
    :func:`ready.ready_first`, :func:`ready.recompute_late`, then
    :func:`grad_rows.grads_in_activation_rows`) and evaluated from that program."""

    def run(*args: Any, **kwargs: Any) -> Any:
        closed, shape = jax.make_jaxpr(lambda a, k: fun(*a, **k), return_shape=True)(args, kwargs)
        closed = select_row_scatters(drop_loop_barriers(closed))
        closed = recompute_late(ready_first(sink_broadcasts(closed)))
        closed = grads_in_activation_rows(closed)
        return run_jaxpr(closed, shape, args, kwargs)

    return run


def run_jaxpr(closed: Any, out_shape: Any, *args: Any) -> Any:
    """``closed`` (traced from a function of ``args``, which returned ``out_shape``)
    evaluated on ``args``' leaves, its outputs in ``out_shape``'s tree: what the
    library does wherever it traces a function once to check or rewrite its program
    and then runs that program instead of tracing the function again."""
    flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
    # an output the trace found constant comes back as the literal's value
    flat = [x if isinstance(x, jax.Array) else jnp.asarray(x, s.dtype)
            for x, s in zip(flat, jax.tree.leaves(out_shape), strict=True)]  # fmt: skip
    return jax.tree.unflatten(jax.tree.structure(out_shape), flat)

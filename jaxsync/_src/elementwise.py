"""Checks that an optax transformation can run on flat shards without changing.

The distributed optimizer runs the inner transformation on a contiguous slice
of a flat buffer that ignores parameter boundaries. That is only correct for
transformations that treat every element on its own (sgd, momentum, adam,
adamw with a scalar decay, lion, rmsprop...). Anything that looks at a whole
parameter or the whole tree (lamb, lars, adafactor, per-parameter masks,
``clip_by_global_norm``, ``scale_by_trust_ratio``) would train silently wrong,
so we probe: run the transformation on a small tree shaped like the params and
on the same numbers flattened and cut into two shards, and compare.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

NOT_ELEMENTWISE = (
    "the optimizer for {what} is not elementwise: run on flat shards that ignore "
    "parameter boundaries it gives different updates than on the parameter tree "
    "({detail}). The distributed optimizer can only shard transformations that "
    "treat each element on its own (sgd, momentum, adam, adamw, lion, rmsprop, "
    "...). For global-norm clipping pass `clip_grad_norm=` instead of "
    "`optax.clip_by_global_norm`; for weight-decay masks or per-group settings "
    "pass `labels=` with one transformation per label; lamb, lars, adafactor and "
    "other per-parameter-norm methods cannot be sharded this way. To skip this "
    "check (at your own risk) pass `check_elementwise=False`."
)


def _probe_tree(shapes: tuple[tuple[int, ...], ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    leaves = []
    for i, shape in enumerate(shapes):
        small = tuple(min(d, 3) for d in shape)
        scale = 10.0 ** ((i % 3) * 2 - 2)  # leaves of very different magnitude
        leaves.append((rng.standard_normal(small) * scale).astype(np.float32))
    return leaves


def _run(tx: optax.GradientTransformation, params: Any, grads: list[Any]) -> Any:
    """Total change of ``params`` over the steps (compared instead of the params,
    so that small terms such as weight decay are not lost in rounding)."""
    start, state = params, tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(lambda a, b: a - b, params, start)


@functools.lru_cache(maxsize=64)
def _check_cached(tx: Any, treedef: Any, shapes: tuple[tuple[int, ...], ...], what: str) -> None:
    params = _probe_tree(shapes, 0)
    grads = [_probe_tree(shapes, s) for s in (1, 2)]
    # Magnify one half's grads so that clipping or trust ratios kick in.
    grads = [[g * (1e4 if i % 2 else 1e-3) for i, g in enumerate(gs)] for gs in grads]
    small = [tuple(min(d, 3) for d in s) for s in shapes]
    tree = lambda leaves: jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])  # noqa: E731
    try:
        ref = jax.tree.leaves(_run(tx, tree(params), [tree(g) for g in grads]))
        flat = np.concatenate([p.ravel() for p in params])
        flat_grads = [np.concatenate([g.ravel() for g in gs]) for gs in grads]
        cut = max(1, flat.size // 2 + 1)
        shards = [
            _run(tx, jnp.asarray(flat[lo:hi]), [jnp.asarray(g[lo:hi]) for g in flat_grads])
            for lo, hi in ((0, cut), (cut, flat.size))
            if hi > lo
        ]
        got = np.concatenate([np.asarray(s) for s in shards])
    except Exception as e:  # a mask pytree or a shape-dependent transform
        raise ValueError(
            NOT_ELEMENTWISE.format(what=what, detail=f"on a flat shard it raised {e!r}")
        ) from e
    want = np.concatenate([np.asarray(r).ravel() for r in ref])
    sizes = [int(np.prod(s)) for s in small]
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-6):
        bad = int(np.argmax(~np.isclose(got, want, rtol=1e-4, atol=1e-6)))
        leaf = int(np.searchsorted(np.cumsum(sizes), bad, side="right"))
        raise ValueError(
            NOT_ELEMENTWISE.format(
                what=what, detail=f"first mismatch in leaf {leaf} of the probe tree"
            )
        )


def check_elementwise(tx: optax.GradientTransformation, params: Any, what: str) -> None:
    """Raises ``ValueError`` if ``tx`` is not elementwise on a tree shaped like ``params``.

    Runs eagerly on tiny arrays (at most 3 per dimension) once per
    (transformation, tree structure); safe to call while tracing.
    """
    leaves, treedef = jax.tree.flatten(params)
    shapes = tuple(tuple(int(d) for d in np.shape(x)) for x in leaves)
    with jax.ensure_compile_time_eval():
        try:
            _check_cached(tx, treedef, shapes, what)
        except TypeError as e:  # unhashable transformation: probe without the cache
            if "unhashable" not in str(e):
                raise
            _check_cached.__wrapped__(tx, treedef, shapes, what)

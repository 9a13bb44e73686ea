"""Checks that an optax transformation can run on flat shards without changing.

The distributed optimizer (and the fully sharded units) run the inner
transformation on contiguous slices of flat buffers that ignore parameter
boundaries. That is only correct for transformations that treat every element
on its own (sgd, momentum, adam, adamw with a scalar decay, lion, rmsprop...).
Anything that looks at a whole parameter or the whole tree (lamb, lars,
adafactor's factored moments, masks that depend on a param's path or shape,
``clip_by_global_norm``, ``scale_by_trust_ratio``) would train silently wrong.

So we probe, once per (transformation, tree of shapes): run it on random
params of the *real* shapes and structure, and on the same numbers flattened
and cut into uneven shards, for a few steps, and compare the updates to within
two ulps. The steps are chosen so nothing hides: a step of zero gradients (the
only update left is weight decay and the like, which a wrong mask then shows as
zero against non-zero), then steps whose gradients differ by orders of magnitude
between leaves (global-norm clipping and trust ratios kick in). Elementwise
transformations give the same bits either way.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.introspect import factory_of, functions, is_muon, multi_steps_of

NOT_ELEMENTWISE = (
    "the optimizer for {what} is not elementwise: run on flat shards that ignore "
    "parameter boundaries it gives different updates than on the parameter tree "
    "({detail}). Sharded optimizers can only run transformations that "
    "treat each element on its own (sgd, momentum, adam, adamw, lion, rmsprop, "
    "adagrad, ...). For global-norm clipping pass `clip_grad_norm=` (FSDP: "
    "`jaxsync.clip_by_global_norm(max_norm, axis_name=...)`) instead of "
    "`optax.clip_by_global_norm`; for weight-decay masks or per-group settings "
    "pass `labels=` with one optimizer per label instead of `mask=`, which works in "
    "every mode: `train_step(..., tx={{'decay': optax.adamw(lr, weight_decay=0.1), "
    "'no_decay': optax.adamw(lr, weight_decay=0.0)}}, labels=...)`, "
    "`distributed_optimizer(inner={{...}}, labels=...)`, or "
    "`fs = jaxsync.fully_shard(..., labels=...)` with `fs.multi_transform({{...}})`. A "
    "transformation keyed by param names (optax.masked with a function, a multi_transform "
    "labels function, your own) sees no names on a flat shard: give the params it picks "
    "a label of their own instead. Optimizers "
    "that need whole matrices (optax.contrib.muon, factored adafactor, lamb, lars, "
    "Shampoo) cannot run on flat shards: with `jaxsync.distributed_optimizer`, route "
    "their params by `labels=` to `jaxsync.whole_matrices(tx)` (each matrix is then "
    "owned whole by one rank). `optax.contrib.muon` itself needs none of this: "
    "`jaxsync.train_step` in 'zero' and 'fsdp' and `jaxsync.distributed_optimizer` run "
    "it as you wrote it, with its own dimension numbers. "
    "To skip this check (at your own risk) pass `check_elementwise=False` to "
    "`jaxsync.distributed_optimizer` or `FullyShard.init_optimizer` (the explicit path; "
    "`train_step` always probes)."
)
MUON_ON_SHARDS = (
    "the optimizer for {what} is optax.contrib.muon, which is not elementwise: it "
    "orthogonalizes whole matrices (and runs its own Adam on the rest, by its dimension "
    "numbers), which the flat shards here cut apart ({detail}). Keep the optimizer as "
    "it is and let jaxsync hand it whole params: `jaxsync.train_step(loss_fn, tx, mesh, "
    "jaxsync.ZeRO(), stacked=...)` with the same `tx` (and the same `labels`, if any) "
    "owns each param whole on one rank and hands it to muon in the param tree, so its "
    "dimension numbers hold and it trains what it trains on one device; "
    "`jaxsync.FSDP()` does the same for a `tx` that is muon itself (no `labels`); "
    "on the explicit path `jaxsync.distributed_optimizer(tx, axis_name=..., "
    "labels=...)`."
)
GLOBAL_NORM_ON_SHARDS = (
    "the optimizer for {what} holds optax.clip_by_global_norm, which is not "
    "elementwise: on a flat shard it clips by that shard's norm, not the whole "
    "gradient's ({detail}). Drop it from the optimizer and pass "
    "`clip_grad_norm=max_norm` to `jaxsync.train_step` or "
    "`jaxsync.distributed_optimizer`, which clip by the norm of the whole reduced "
    "gradient with optax's arithmetic; on the explicit FSDP path chain "
    "`jaxsync.clip_by_global_norm(max_norm, axis_name=...)` instead, which sums the "
    "norm over the shards."
)
IN_MULTI_STEPS = (
    "This optimizer is inside optax.MultiSteps: drop MultiSteps too, not only the clip "
    "or mask (`clip_grad_norm=` beside MultiSteps would clip each microbatch's gradient "
    "and is refused). With `jaxsync.train_step` write `tx=<the optimizer MultiSteps "
    "wraps, no clip>, microbatches=k, clip_grad_norm=max_norm` and a batch k times as "
    "large: it clips the mean of the k microbatch gradients, as MultiSteps did."
)
PROBE_FAILED = (
    "could not probe the optimizer for {what} on a tree shaped like the params: it "
    "raised {error!r}. Check that it accepts these params, or pass "
    "`check_elementwise=False` to `jaxsync.distributed_optimizer` or "
    "`FullyShard.init_optimizer` to skip the probe (`train_step` always probes)."
)

#: Probe cost cap in elements: above it, dimensions are capped (never below
#: ``MIN_PROBE_DIM``), so a huge model is probed on a smaller tree of the same
#: structure, ranks and size classes.
PROBE_ELEMENTS = 1 << 22
MIN_PROBE_DIM = 512
#: Allowed difference between tree and shard updates: ulps of the larger, plus a
#: fraction of the leaf's largest update in that step (see :func:`_mismatch`).
ULPS = 4
LEAF_REL = 2.0**-20
#: Shards per flat buffer in the probe (uneven cuts, never on a leaf boundary
#: by design).
PROBE_SHARDS = 3

Units = tuple[tuple[str, tuple[int, ...]], ...] | None


def probe_shapes(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The real shapes, or with every dimension capped when they exceed the budget."""
    total = sum(math.prod(s) for s in shapes)
    if total <= PROBE_ELEMENTS:
        return shapes
    cap = max(max(s, default=1) for s in shapes)
    while cap > MIN_PROBE_DIM:
        cap = max(cap // 2, MIN_PROBE_DIM)
        capped = tuple(tuple(min(d, cap) for d in s) for s in shapes)
        if sum(math.prod(s) for s in capped) <= PROBE_ELEMENTS:
            break
    return tuple(tuple(min(d, cap) for d in s) for s in shapes)


def _values(shapes: tuple[tuple[int, ...], ...], seed: int, kind: str) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i, shape in enumerate(shapes):
        if kind == "zeros":
            out.append(np.zeros(shape, np.float32))
            continue
        if kind == "params":  # large, so that decay terms dominate small updates
            scale = 10.0 ** (i % 3)
        elif kind == "spread":  # clipping and trust ratios kick in
            scale = 1e4 if i % 2 else 1e-3
        else:
            scale = 10.0 ** (i % 5 - 2)
        out.append((rng.standard_normal(shape) * scale).astype(np.float32))
    return out


def _run(tx: optax.GradientTransformation, params: Any, grads: list[Any]) -> list[list[Any]]:
    """Per step, the update leaves."""
    state = tx.init(params)
    out = []
    for g in grads:
        updates, state = tx.update(g, state, params)
        out.append(jax.tree.leaves(updates))
        params = optax.apply_updates(params, updates)
    return out


def _run_ranks(
    tx: optax.GradientTransformation, params: Any, grads: list[Any], axes: tuple[str, ...]
) -> list[list[np.ndarray]]:
    """``_run`` on every rank at once: leaves carry a leading rank axis, mapped
    with ``jax.vmap`` under the sharded axis names, so collectives in ``tx``
    (``jaxsync.clip_by_global_norm``) sum over the probe's ranks as over the mesh."""
    n = jax.tree.leaves(params)[0].shape[0]
    fn = lambda p, gs: _run(tx, p, gs)  # noqa: E731
    shape = (n,) + (1,) * max(len(axes) - 1, 0)
    for name in reversed(axes or (None,)):
        fn = jax.vmap(fn, axis_name=name)
    split = lambda t: jax.tree.map(lambda x: x.reshape(shape + x.shape[1:]), t)  # noqa: E731
    out = jax.jit(fn)(split(params), [split(g) for g in grads])
    return [[np.asarray(u).reshape(n, -1) for u in step] for step in out]


def _views(sizes: list[int], units: Units) -> tuple[Any, list[list[np.ndarray]]]:
    """What the sharded transformation sees on each probe rank: its structure
    (one flat array, or ``{unit: flat array}``) and, per rank and leaf of it,
    the indices into the concatenation of all param leaves."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    groups = units if units is not None else (("", tuple(range(len(sizes)))),)
    flat_idx = [
        np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members] or [[]])
        for _, members in groups
    ]
    per_rank: list[list[np.ndarray]] = [[] for _ in range(PROBE_SHARDS)]
    for idx in flat_idx:
        n = idx.size
        cuts = sorted({0, n, *(min(n, k * n // PROBE_SHARDS + k) for k in (1, 2))})
        cuts += [n] * PROBE_SHARDS
        for r in range(PROBE_SHARDS):
            per_rank[r].append(idx[cuts[r] : cuts[r + 1]].astype(np.int64))
    if units is None:
        return jax.tree.structure(0), per_rank
    struct = jax.tree.structure({name: 0 for name, _ in units})
    order = np.argsort([name for name, _ in units], kind="stable")  # dict flattening order
    return struct, [[pieces[k] for k in order] for pieces in per_rank]


def _mismatch(got: np.ndarray, want: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Where ``got`` and ``want`` differ by more than rounding.

    Rounding is ``ULPS`` ulps of the larger value, plus ``LEAF_REL`` of the
    largest update of the same leaf: XLA:CPU evaluates the same elementwise op
    a few ulps differently in the vectorised body and the tail of a loop
    (measured: adam 4 ulps), and optimizers that subtract nearly equal terms
    (nadam) turn that into more ulps of a result near zero.
    """
    mag = np.abs(want).astype(np.float32)
    seg = np.repeat(np.arange(len(sizes)), sizes)
    leaf_max = np.zeros(len(sizes), np.float32)
    np.maximum.at(leaf_max, seg, np.where(np.isfinite(mag), mag, 0))
    both_nan = np.isnan(got) & np.isnan(want)
    tol = ULPS * np.spacing(np.maximum(np.abs(got), mag)) + LEAF_REL * leaf_max[seg]
    with np.errstate(invalid="ignore"):
        close = np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tol
    return ~(close | both_nan | (got == want))


STEPS = (
    ("zeros", "zero gradients"),
    ("spread", "gradients of very different size per leaf"),
    ("mixed", "random gradients"),
)


def _probe(
    tx: Any,
    treedef: Any,
    shapes: tuple[tuple[int, ...], ...],
    names: tuple[str, ...],
    units: Units,
    axes: tuple[str, ...],
    what: str,
) -> None:
    shapes = probe_shapes(shapes)
    params = _values(shapes, 0, "params")
    grads = [_values(shapes, 1 + k, kind) for k, (kind, _) in enumerate(STEPS)]
    tree = lambda leaves: jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])  # noqa: E731
    try:
        one = lambda leaves: tree([x[None] for x in leaves])  # noqa: E731
        ref = _run_ranks(tx, one(params), [one(g) for g in grads], axes)
        want = [np.concatenate([u.ravel() for u in step]).astype(np.float32) for step in ref]
    except Exception as e:
        raise ValueError(PROBE_FAILED.format(what=what, error=e)) from e
    sizes = [math.prod(s) for s in shapes]
    flat_params = np.concatenate([p.ravel() for p in params])
    flat_grads = [np.concatenate([g.ravel() for g in gs]) for gs in grads]
    struct, idx = _views(sizes, units)
    # Ranks own uneven pieces: each piece is zero-padded to the longest, as the
    # real buffers are padded.
    width = [max(r[j].size for r in idx) for j in range(len(idx[0]))]

    def view(flat: np.ndarray) -> Any:
        leaves = []
        for j, w in enumerate(width):
            x = np.zeros((len(idx), max(w, 1)), np.float32)
            for r, pieces in enumerate(idx):
                x[r, : pieces[j].size] = flat[pieces[j]]
            leaves.append(jnp.asarray(x))
        return jax.tree.unflatten(struct, leaves)

    got = [np.full(flat_params.size, np.nan, np.float32) for _ in STEPS]
    try:
        out = _run_ranks(tx, view(flat_params), [view(g) for g in flat_grads], axes)
    except Exception as e:  # a mask pytree or a shape-dependent transform
        raise ValueError(
            _not_elementwise(tx, what, f"on a flat shard it raised {e!r}")
        ) from e
    for step, leaves in zip(got, out, strict=True):
        for j, u in enumerate(leaves):
            for r, pieces in enumerate(idx):
                step[pieces[j]] = u[r, : pieces[j].size]
    for (_, step_name), g, w in zip(STEPS, got, want, strict=True):
        if g.shape != w.shape:
            raise ValueError(
                _not_elementwise(
                    tx, what, f"{g.size} update elements on shards, {w.size} on the tree"
                )
            )
        bad = np.flatnonzero(_mismatch(g, w, sizes))
        if bad.size:
            pos = int(bad[0])
            leaf = int(np.searchsorted(np.cumsum(sizes), pos, side="right"))
            raise ValueError(
                _not_elementwise(
                    tx,
                    what,
                    f"first seen for param {names[leaf]} after a step of {step_name}: "
                    f"update {float(w[pos]):.6g} on the tree, {float(g[pos]):.6g} on a "
                    f"shard; {bad.size} of {w.size} elements differ",
                )
            )


def _not_elementwise(tx: Any, what: str, detail: str) -> str:
    if _optax_global_norm_clip(tx):  # first: muon beside it is not run as written
        message = GLOBAL_NORM_ON_SHARDS
    elif is_muon(tx):
        message = MUON_ON_SHARDS
    else:
        message = NOT_ELEMENTWISE
    return message.format(what=what, detail=detail)


def _optax_global_norm_clip(tx: Any) -> bool:
    """``tx`` holds optax's own ``clip_by_global_norm`` (jaxsync's has the name too)."""
    return any(
        factory_of(fn) == "clip_by_global_norm"
        and getattr(fn, "__module__", "").split(".")[0] == "optax"
        for fn in functions(tx)
    )


#: optax factories whose transformations treat each element on its own, whatever the
#: tree: an optimizer built only from these (and optax's module-level helpers) needs
#: no probe, which was most of a step's ``init`` (3 of 3.4 s on the example GPT).
#: Anything else (masks, clipping by a global norm, a user's own function, noise
#: drawn per shape) is probed.
ELEMENTWISE_FACTORIES = frozenset({
    "chain", "named_chain", "with_extra_args_support", "identity", "scale",
    "scale_by_learning_rate", "scale_by_schedule", "add_decayed_weights", "trace", "ema",
    "scale_by_adam", "scale_by_adamax", "scale_by_amsgrad", "scale_by_adan", "scale_by_belief",
    "scale_by_lion", "scale_by_rms", "scale_by_rss", "scale_by_sm3", "scale_by_stddev",
    "scale_by_yogi", "scale_by_radam", "scale_by_sign", "clip", "keep_params_nonnegative",
    "zero_nans", "sgd", "adam", "adamw", "adamax", "adamaxw", "amsgrad", "adabelief",
    "adagrad", "lion", "nadam", "nadamw", "radam", "rmsprop", "yogi", "sm3",
    "constant_schedule", "linear_schedule", "cosine_decay_schedule", "exponential_decay",
    "polynomial_schedule", "piecewise_constant_schedule", "join_schedules",
    "warmup_cosine_decay_schedule", "warmup_exponential_decay_schedule",
    "cosine_onecycle_schedule", "linear_onecycle_schedule", "sgdr_schedule",
})  # fmt: skip


def known_elementwise(tx: Any) -> bool:
    """``tx`` is made only of optax code from :data:`ELEMENTWISE_FACTORIES` (a user's
    function anywhere in it, or any other factory, means: probe it)."""
    reached = functions(tx)
    if not reached:
        return False
    for fn in reached:
        if not isinstance(fn, types.FunctionType):  # an opaque callable: probe it
            return False
        if not (fn.__module__ or "").startswith("optax."):
            return False
        factory = factory_of(fn)
        if factory is not None and factory not in ELEMENTWISE_FACTORIES:
            return False
    return True


@functools.lru_cache(maxsize=64)
def _probe_cached(
    tx: Any, treedef: Any, shapes: Any, names: Any, units: Units, axes: Any, what: str
) -> None:
    _probe(tx, treedef, shapes, names, units, axes, what)


def _cpu() -> Any:
    # A device of this process: with several processes, jax.devices() lists the
    # others' devices too, and a value placed there cannot be read back here.
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # no CPU backend: probe on the default device
        return None


def check_elementwise(
    tx: optax.GradientTransformation,
    params: Any,
    what: str,
    *,
    units: Units = None,
    axes: tuple[str, ...] = (),
) -> None:
    """Raises ``ValueError`` if ``tx`` is not elementwise on a tree shaped like ``params``.

    Args:
      tx: the transformation to probe.
      params: arrays, tracers or ``ShapeDtypeStruct``s: only the structure and
        shapes are used.
      what: names the transformation in the error.
      units: ``None``: the sharded transformation sees one flat array (the
        distributed optimizer); else ``((unit, leaf indices), ...)``: it sees
        ``{unit: flat array of those leaves}`` (fully sharded units).
      axes: the mesh axes the shards are split over: the probe's ranks are
        ``jax.vmap``-ed under these names, so a transformation that reduces over
        them (``jaxsync.clip_by_global_norm``) sees all probe ranks.

    Runs eagerly on the CPU once per (transformation, tree of shapes), on the
    real shapes (capped for very large models, see :func:`probe_shapes`); safe
    to call while tracing.
    """
    multi = multi_steps_of(tx)
    if multi is not None:
        # It applies its inner optimizer to the gradients it accumulated: elementwise
        # exactly when the inner one is. Probed whole, its first k-1 steps give empty
        # updates on both sides and a mask or a global-norm clip inside went unseen.
        try:
            check_elementwise(multi.inner_opt, params, what, units=units, axes=axes)
        except ValueError as e:  # the fix must not leave a clip beside MultiSteps
            raise ValueError(f"{e} {IN_MULTI_STEPS}") from None
        return
    if known_elementwise(tx):
        return
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    shapes = tuple(tuple(int(d) for d in np.shape(x)) for _, x in path_leaves)
    names = tuple(jax.tree_util.keystr(p) for p, _ in path_leaves)
    cpu = _cpu()
    with jax.ensure_compile_time_eval(), jax.default_device(cpu):
        try:
            _probe_cached(tx, treedef, shapes, names, units, tuple(axes), what)
        except TypeError as e:  # unhashable transformation: probe without the cache
            if "unhashable" not in str(e):
                raise
            _probe(tx, treedef, shapes, names, units, tuple(axes), what)

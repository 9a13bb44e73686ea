"""The whole :class:`jaxsync.TrainState` in one checkpoint, at any data-parallel size.

``Checkpointer.save_state(train_step, state)`` saves every field of the state:
the step counter, the params, the optimizer state, the model state (flax NNX
batch statistics, RNG counters) and the guard state (loss scale, skip
counters and the last step's metrics), in a form that does not depend on the
number of data-parallel devices:

- ``"ddp"``: everything is replicated already, saved as it is;
- ``"zero"``: the distributed optimizer's portable form (per-param master and
  moments; the loss scale and metrics are in it);
- ``"fsdp"``: the flat unit shards, and every optimizer-state dict of them,
  gathered into per-param arrays (fp32, without padding); with labels, each
  label's state of its pieces as ``{param name: array}`` of that label's params.

``Checkpointer.restore_state(train_step, state_like)`` rebuilds the state for
the step's mesh, whatever its DP size, into the shardings of ``state_like``
(the state ``train_step.init`` returns, or ``train_step.abstract_state``'s).
What the checkpoint lacks is named, never re-initialised.

A state of a step whose params are also sharded over other mesh axes (2-D,
tensor parallelism by specs) is written in the same form as a 1-D step's
(:mod:`jaxsync._src.step.two_d.portable`): a checkpoint moves between ``data=8`` and
``(data=4, model=2)`` in both directions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.cpu_order import put
from ..core.names import param_name
from ..fsdp import shards as fsdp_shards
from ..fsdp.held import FsdpShards
from ..optim.state import StepMetrics, saved_metrics
from ..step.held import strip
from ..step.shard_tag import tag_of
from ..step.train_state import TrainState
from ..step.two_d import portable as two_d_portable
from .checksum import tree_checksums
from .describe import describe_optimizer, optimizer_differences
from .records import CheckpointMismatchError, compare_trees, inner_as_saved, saved_names

PyTree = Any

#: The record's key for a whole-state checkpoint.
WHOLE_STATE = "train_state"
_VERSION = 1

NOT_WHOLE_STATE = (
    "checkpoint step {step} in {dir} was saved with `Checkpointer.save` (params and "
    "optimizer state only), not `save_state`: restore it with `Checkpointer.restore`."
)
NO_RECORD = (
    "checkpoint step {step} in {dir} has no `jaxsync` item (the JSON record jaxsync writes "
    "beside the arrays: mode, optimizer, checksums), so it cannot be restored as a whole "
    "TrainState: it was written by another tool or by plain orbax, or its `jaxsync` "
    "folder was removed. Read its arrays with orbax, or restore an intact checkpoint."
)
DONATED = (
    "Checkpointer.save_state: the state's arrays {names} were deleted: this state was "
    "donated to a training step (`state, loss = step(state, batch)` reuses its buffers). "
    "Save the state the step returned, or build the step with `donate=False`."
)
MODE_CHANGED = (
    "checkpoint step {step} in {dir} holds a mode={saved!r} TrainState, and the step "
    "restoring it has mode={now!r}. Restore with a step built with mode={saved!r}."
)
PARTS_MISSING = (
    "checkpoint step {step} in {dir} does not hold the whole state this step needs "
    "(saved vs now):\n{problems}\nNothing was re-initialised. Restore with the model, mode "
    "and options the run was saved with (the data-parallel size, and the names and "
    "grouping of the data axes, e.g. ('replica', 'data') -> 'data', may differ)."
)


class RestoredState(NamedTuple):
    """What :meth:`Checkpointer.restore_state` returns."""

    step: int
    state: TrainState
    extra: PyTree
    meta: dict[str, Any]


def _keys_to_data(tree: PyTree) -> PyTree:
    """Typed PRNG keys (NNX RNG state) as their key data, which orbax can write."""
    is_key = lambda x: jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def _data_to_keys(tree: PyTree, like: PyTree) -> PyTree:
    def one(x: Any, ref: Any) -> Any:
        if jax.dtypes.issubdtype(ref.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
        return x

    return jax.tree.map(one, tree, like)


def to_portable(ts: Any, state: TrainState, fn: str) -> dict[str, Any]:
    """``state`` as per-param arrays independent of the DP size."""
    plan = ts._plan(state, fn)
    params, opt, guard = state.params, state.opt_state, state.guard
    if plan.dims is not None:
        params, opt, guard = two_d_portable.to_portable(ts, plan, state, fn)
    elif ts.mode.name == "zero":
        if plan.held:  # the params as the user wrote them, from the master shards
            params = ts.params(state)
        opt = plan.tx.to_portable(opt, params, ts.mesh)
    elif ts.mode.name == "fsdp":
        params = plan.fs.unshard(params, ts.mesh)
        opt = fsdp_shards.to_portable(plan.fs, opt, ts.mesh)
    return {
        "step": state.step,
        "params": params,
        "opt_state": opt,
        "model_state": _keys_to_data(state.model_state),
        "guard": saved_guard(guard),
    }


def saved_guard(guard: Any) -> Any:
    """A guard's saved form (``{}`` for none): its metrics without the fields the step
    does not record (restored by count into the step's structure, :func:`from_portable`)."""
    if guard is None or not hasattr(guard, "metrics"):
        return {} if guard is None else guard
    return guard._replace(metrics=saved_metrics(guard.metrics))


def portable_like(ts: Any, like: TrainState, fn: str) -> dict[str, Any]:
    """The abstract form (``ShapeDtypeStruct``s with shardings) of :func:`to_portable`'s
    result for ``like``, which may itself be abstract (``TrainStep.abstract_state``)."""
    plan = ts._plan(like, fn)
    sds = lambda x, s=None: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s or x.sharding)  # noqa: E731
    params, opt = jax.tree.map(sds, like.params), jax.tree.map(sds, like.opt_state)
    guard = {} if like.guard is None else jax.tree.map(sds, like.guard)
    if plan.dims is not None:
        params, opt, guard = two_d_portable.portable_like(ts, plan, like, fn)
    elif ts.mode.name == "zero":
        if plan.held:
            rep = NamedSharding(ts.mesh, P())
            params = jax.tree.map(lambda t: sds(t, rep), plan.template)
        opt = plan.tx.portable_shapes(params, ts.mesh)
    elif ts.mode.name == "fsdp":
        rep = NamedSharding(ts.mesh, P())
        params = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32, sharding=rep),
                              plan.template)  # fmt: skip
        opt = fsdp_shards.portable_like(plan.fs, opt, plan.template, ts.mesh)
    model_state = jax.tree.map(
        lambda x: sds(jax.eval_shape(jax.random.key_data, x), x.sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else sds(x),
        like.model_state,
    )  # fmt: skip
    return {
        "step": sds(like.step),
        "params": params,
        "opt_state": opt,
        "model_state": model_state,
        "guard": saved_guard(guard),
    }


def from_portable(ts: Any, portable: dict[str, Any], like: TrainState, fn: str) -> TrainState:
    """Inverse of :func:`to_portable` onto ``like``'s mesh and shardings."""
    plan = ts._plan(like, fn)
    params, opt = portable["params"], portable["opt_state"]
    guard = None
    if plan.dims is not None:
        params, opt, guard = two_d_portable.from_portable(ts, plan, portable, like)
    elif ts.mode.name == "zero":
        opt = plan.tx.from_portable(opt, params, ts.mesh)
        params = strip(params, plan.held)
    elif ts.mode.name == "fsdp":
        params = FsdpShards(plan.fs.shard(params, ts.mesh), plan.fs.units)
        opt = fsdp_shards.from_portable(plan.fs, opt, plan.template, ts.mesh)
    if guard is None and like.guard is not None:
        guard = jax.tree.unflatten(
            jax.tree.structure(like.guard), jax.tree.leaves(portable["guard"])
        )
    model_state = _data_to_keys(portable["model_state"], like.model_state)
    tag = None if like.layout is None else tag_of(ts)  # this step's layout: shards rebuilt
    state = TrainState(portable["step"], params, opt, model_state, guard, tag)
    state = jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(state))
    return jax.tree.map(lambda x, ref: put(x, ref.sharding), state, like)  # cpu_order


def _described_tx(ts: Any, state: TrainState, fn: str) -> Any:
    """The optimizer a checkpoint records: ZeRO's distributed optimizer (on a 2-D
    mesh the one a 1-D step would build, whose portable form the state takes)."""
    if ts.mode.name != "zero":
        return None
    plan = ts._plan(state, fn)
    return plan.tx if plan.dims is None else two_d_portable.zero_optimizer(ts)


def save_state(
    ckpt: Any,
    ts: Any,
    state: TrainState,
    *,
    step: int | None,
    extra: PyTree,
    meta: dict[str, Any] | None,
) -> None:
    fn = "Checkpointer.save_state"
    deleted = [
        param_name(path)
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if getattr(x, "is_deleted", lambda: False)()
    ]
    if deleted:
        more = f" and {len(deleted) - 4} more" if len(deleted) > 4 else ""
        raise ValueError(DONATED.format(names=", ".join(deleted[:4]) + more))
    portable = to_portable(ts, state, fn)
    step = int(state.step) if step is None else step
    step, meta = ckpt._check_save(step, meta)
    tx = _described_tx(ts, state, fn)
    tree = {**portable, "extra": extra or {}}
    checks = {
        "version": 1,
        WHOLE_STATE: {"version": _VERSION, "mode": ts.mode.name},
        "optimizer": describe_optimizer(tx, portable["params"], portable["opt_state"]),
        "checksums": tree_checksums(tree),
    }
    ckpt._write(step, tree, meta, checks)


def restore_state(
    ckpt: Any,
    ts: Any,
    state_like: TrainState,
    *,
    step: int | None,
    extra_like: PyTree,
) -> RestoredState:
    fn = "Checkpointer.restore_state"
    step = ckpt._complete_step(step)
    checks, saved = ckpt._record(step)
    if checks is None:
        raise CheckpointMismatchError(NO_RECORD.format(step=step, dir=ckpt.directory))
    record = checks.get(WHOLE_STATE)
    if record is None:
        raise CheckpointMismatchError(NOT_WHOLE_STATE.format(step=step, dir=ckpt.directory))
    if record.get("mode") != ts.mode.name:
        raise CheckpointMismatchError(
            MODE_CHANGED.format(
                step=step, dir=ckpt.directory, saved=record.get("mode"), now=ts.mode.name
            )
        )
    like = portable_like(ts, state_like, fn)
    if ts.mode.name == "zero":
        like = inner_as_saved(like, saved)
    extra = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        extra_like or {},
    )
    target, as_step = metrics_as_saved(saved, {**like, "extra": extra})
    tx = _described_tx(ts, state_like, fn)
    changed = optimizer_differences(
        checks.get("optimizer", {}), describe_optimizer(tx, like["params"], like["opt_state"])
    )
    problems = compare_trees(saved, target) or changed
    if problems:
        raise CheckpointMismatchError(
            PARTS_MISSING.format(step=step, dir=ckpt.directory, problems="\n".join(problems))
        )
    tree = as_step(ckpt._read(step, target, checks, saved))
    meta = ckpt._read_json(step, "meta", "meta (JSON)")
    state = from_portable(ts, tree, state_like, fn)
    return RestoredState(step, state, tree["extra"], dict(meta or {}))


#: The metrics a step records only with ``metrics=`` (optim.logged), after the seven.
OPTIONAL_METRICS = ("update_norm", "param_norm", "learning_rate", "unit_prints")


def metrics_as_saved(saved: PyTree, target: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``target`` with its metrics as the checkpoint holds them, and the function that
    puts what was read back into this step's form.

    The trainer's metrics (``train_step(metrics=...)``) are the last step's diagnostics,
    so a checkpoint saved with another setting restores: the ones this step does not
    record are dropped, the ones it records start at 0 (their value before a first
    step; the units' fingerprints too where the number of units changed). DDP and FSDP
    keep them by name in ``guard.metrics``; ZeRO by position in ``opt_state.metrics``
    (7 fields, then the 2 norms and the rate, scalars, then the 2-D fingerprints), read
    back from the saved shapes.
    """
    names = saved_names(saved)
    guard, opt = target["guard"], target["opt_state"]
    if hasattr(guard, "metrics"):
        mine = guard.metrics
        want = {f: getattr(mine, f) for f in OPTIONAL_METRICS if f in mine._fields}
        have = {f: names[k] for f in OPTIONAL_METRICS if (k := f"guard.metrics.{f}") in names}
        placed, into = _optional_form(want, have, mine.grad_norm.sharding)
        if placed is None:
            return target, lambda tree: tree

        def form(m: Any, values: dict[str, Any]) -> Any:
            return saved_metrics(StepMetrics(*m[:7], *(values.get(f) for f in OPTIONAL_METRICS)))

        def back(tree: dict[str, Any]) -> dict[str, Any]:
            read = tree["guard"].metrics
            values = into({f: getattr(read, f) for f in have})
            return {**tree, "guard": tree["guard"]._replace(metrics=form(read, values))}

        return {**target, "guard": guard._replace(metrics=form(mine, placed))}, back
    if not (isinstance(opt, dict) and isinstance(opt.get("metrics"), tuple)):
        return target, lambda tree: tree
    mine = opt["metrics"]
    prefix = "opt_state.metrics."
    saved_rest = sorted(
        (int(k[len(prefix) :]), v) for k, v in names.items()
        if k.startswith(prefix) and k[len(prefix) :].isdigit() and int(k[len(prefix) :]) >= 7
    )  # fmt: skip
    saved_fields = _positional([v[0] for _, v in saved_rest])
    my_fields = _positional([x.shape for x in mine[7:]])
    if saved_fields is None or my_fields is None:
        return target, lambda tree: tree  # not a form of ours: compare_trees names it
    have = dict(zip(saved_fields, (v for _, v in saved_rest), strict=True))
    want = dict(zip(my_fields, mine[7:], strict=True))
    placed, into = _optional_form(want, have, mine[0].sharding)
    if placed is None:
        return target, lambda tree: tree

    def back_zero(tree: dict[str, Any]) -> dict[str, Any]:
        read = tree["opt_state"]["metrics"]
        values = into(dict(zip(have, read[7:], strict=True)))
        rest = tuple(values[f] for f in OPTIONAL_METRICS if f in values)
        return {**tree, "opt_state": {**tree["opt_state"], "metrics": (*read[:7], *rest)}}

    rest = tuple(placed[f] for f in OPTIONAL_METRICS if f in placed)
    return {**target, "opt_state": {**opt, "metrics": (*mine[:7], *rest)}}, back_zero


def _positional(shapes: list[tuple[int, ...]]) -> list[str] | None:
    """The optional metrics a ZeRO metrics tuple holds after its seven, from their
    shapes: the 2 norms and/or the rate (scalars), then the units' prints (2-D); None
    for any other form."""
    scalars = [tuple(s) for s in shapes if tuple(s) == ()]
    fields = ["update_norm", "param_norm"] if len(scalars) >= 2 else []
    fields += ["learning_rate"] if len(scalars) % 2 else []
    fields += ["unit_prints"] if len(shapes) > len(scalars) else []
    ordered = [tuple(s) == () for s in shapes] == sorted(
        [tuple(s) == () for s in shapes], reverse=True
    )
    return fields if len(fields) == len(shapes) and ordered else None


def _optional_form(want: dict[str, Any], have: dict[str, Any], sharding: Any) -> tuple[Any, Any]:
    """``(the saved optional metrics as placeholders, fn: read values -> this step's)``;
    ``(None, None)`` where the checkpoint holds what this step records, alike."""
    same = lambda f: f in have and tuple(have[f][0]) == tuple(want[f].shape)  # noqa: E731
    if list(want) == list(have) and all(same(f) for f in want):
        return None, None
    placed = {
        f: jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
        for f, (shape, dtype) in have.items()
    }

    def into(read: dict[str, Any]) -> dict[str, Any]:
        return {f: read[f] if same(f) else _zero(want[f], sharding) for f in want}

    return placed, into


def _zero(like: Any, sharding: Any) -> jax.Array:
    """A metric's value before a first step, shaped as ``like`` and placed replicated."""
    return jax.device_put(np.zeros(like.shape, like.dtype), sharding)

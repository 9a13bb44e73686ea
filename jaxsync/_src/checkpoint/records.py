"""What a checkpoint records besides its arrays, and the messages of its checks.

Shared by :class:`jaxsync.Checkpointer` (``checkpoint.py``) and the whole-state
checkpoints (``checkpoint.train_state.py``): names and shapes compared in a
neutral dotted form, the JSON check of ``meta``, and the error texts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from ..core.names import param_name
from ..layout.buffer_names import keyed_as_saved

PyTree = Any

#: Name of the checkpoint item holding jaxsync's own record (optimizer, checksums).
CHECKS_ITEM = "jaxsync"

NO_CHECKPOINT = (
    "no complete checkpoint in {dir}{detail}. Checkpoints that were being written when "
    "a run died are left as temporary directories and never used. Restore from the "
    "directory the run saved into, pass `step=` one of the complete steps, or start "
    "the run afresh without restoring."
)
INCOMPLETE_STEP = (
    "checkpoint step {step} in {dir} is incomplete: {missing}, so its arrays cannot be "
    "read (a copy or a save cut short). {fix}"
)
INCOMPLETE_FIX = (
    "The newest complete step is {good}: restore it with `step={good}` (e.g. "
    "`ckpt.restore(..., step={good})` or `ckpt.restore_state(train_step, state_like, "
    "step={good})`), and delete {path} before saving again (a save must be newer than "
    "every step in the directory)."
)
INCOMPLETE_NONE = (
    "No other step in {dir} is complete{others}: start the run afresh without restoring, "
    "or restore from a copy of the directory."
)
STEP_NOT_NEWER = (
    "cannot save step {step} in {dir}: it already holds step {newest}, and a checkpoint "
    "is only written for a step newer than the newest one (orbax would skip it without "
    "a word). If this is a new run, give it a fresh directory or delete the old "
    "checkpoints first; if it resumes a run, restore that run's newest step before saving."
)
OTHER_WRITER = (
    "cannot save step {step} in {dir}: another writer ({writer}) saved step(s) {steps} "
    "there since this Checkpointer last read the directory{newest}, and a save must be "
    "newer than every step in it: this one would overwrite or fall behind the other run's "
    "steps, which stay as they are. Two runs saving into one directory lose each other's "
    "checkpoints: give this run its own directory; or, to continue from the other run's "
    "checkpoints, restore its newest step (`ckpt.restore(...)` or `ckpt.restore_state(...)`) "
    "and save only newer steps."
)
META_NOT_JSON = (
    "`meta` must be JSON-serialisable (it is saved as JSON); {where} is {value!r} of type "
    "{type}. Convert it to a str, int, float, bool, None, list or dict with str keys "
    "(e.g. `int(x)` for a NumPy integer), or save arrays through `extra=`."
)
NEEDS_TX = (
    "checkpoint step {step} in {dir} holds a jaxsync.distributed_optimizer state (in "
    "its portable form); restore it with `tx=` (the distributed optimizer, configured "
    "as when saved) and `mesh=` (the mesh to rebuild the state on; its data-parallel "
    "size may differ), e.g. `ckpt.restore(params_like=params, tx=tx, mesh=mesh)`."
)
NEEDS_MESH = (
    "restoring a jaxsync.distributed_optimizer state needs `mesh=` (the mesh to rebuild "
    "the sharded state on; its data-parallel size may differ from the saved run's)."
)
NEEDS_OPT_STATE_LIKE = (
    "checkpoint step {step} in {dir} holds an optimizer state; pass `opt_state_like=` "
    "(e.g. `tx.init(params)` or its `jax.eval_shape`) to restore a plain optax state, "
    "or `tx=` and `mesh=` for a jaxsync.distributed_optimizer."
)
OPTIMIZER_CHANGED = (
    "checkpoint step {step} in {dir} was saved with other optimizer settings than the "
    "`tx` restoring it (saved vs now):\n{problems}\nRestore with the optimizer the run "
    "was saved with. To change the settings on purpose, pass "
    "`allow_optimizer_change=True`: the saved master weights and inner state are kept, "
    "and a changed loss scaler starts again from its initial scale."
)
CHECKSUM_MISMATCH = (
    "checkpoint step {step} in {dir} is damaged: {n} array(s) read back differ from "
    "what was saved (checksum saved -> read):\n{arrays}\nThe files under {path} were "
    "changed after the save (disk or copy error, or an edit). Restore an earlier step "
    "with `step=`{others}."
)
UNREADABLE = (
    "checkpoint step {step} in {dir}: the {what} could not be read ({error}). The files "
    "under {path} are damaged (truncated or overwritten) or were not written by orbax. "
    "Restore an earlier step with `step=`{others}."
)
NOT_PARTS = (
    "checkpoint step {step} in {dir} holds a whole TrainState saved with `save_state`; "
    "restore it with `Checkpointer.restore_state(train_step, state_like)`."
)
FSDP_PADDING = (
    " If the arrays whose shapes differ are FSDP shards (`fs.shard`, or a mode='fsdp' "
    "TrainState), their flat length is padded to a multiple of the data-parallel size "
    "they were sharded for, so `restore` reads them only at DP sizes that give the same "
    "padded lengths (the saved ones above). To restore FSDP at any DP size, save with "
    "`Checkpointer.save_state(train_step, state)` and restore with `restore_state`, "
    "or save `fs.unshard(shards)` (per-param arrays) instead of the shards."
)
CLOSED = (
    "this Checkpointer for {dir} is closed; create a new jaxsync.Checkpointer to save or restore."
)


class CorruptCheckpointError(ValueError):
    """A checkpoint's files cannot be read, or read back other values than were saved."""


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model or the optimizer restoring it."""


class Restored(NamedTuple):
    """What :meth:`Checkpointer.restore` returns."""

    step: int
    params: PyTree
    opt_state: PyTree
    extra: PyTree
    meta: dict[str, Any]


def _names(tree: PyTree) -> dict[str, tuple[tuple[int, ...], str]]:
    # Orbax's metadata turns NamedTuples into dicts and tuples into lists, so
    # names are compared in a neutral dotted form (``opt_state.master.layer0.w``).
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = str(getattr(leaf, "dtype", type(leaf).__name__))
        out[param_name(path)] = (shape, dtype)
    return out


def saved_names(tree: PyTree) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{dotted name: (shape, dtype)}`` of a tree's leaves, as :func:`compare_trees`
    names them."""
    return _names(tree)


def compare_trees(saved: PyTree, expected: PyTree) -> list[str]:
    """Human-readable differences in names and shapes between two trees."""
    a, b = _names(saved), _names(expected)
    problems = [f"  missing from checkpoint: {k} {b[k][0]}" for k in sorted(set(b) - set(a))]
    problems += [f"  not in the model: {k} {a[k][0]}" for k in sorted(set(a) - set(b))]
    problems += [
        f"  shape differs: {k} saved {a[k][0]}, model {b[k][0]}"
        for k in sorted(set(a) & set(b))
        if a[k][0] != b[k][0]
    ]
    return problems


def _json_problem(value: Any, where: str) -> tuple[str, Any] | None:
    """The first place in ``value`` that JSON cannot hold unchanged, or None."""
    if value is None or isinstance(value, str | bool):
        return None
    if isinstance(value, int | float):  # NumPy's float64 is a float; its int64 is no int
        return None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _json_problem(v, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"the key {k!r} in {where}", k
            found = _json_problem(v, f"{where}[{k!r}]")
            if found:
                return found
        return None
    return where, value


def _first_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(e).__name__}: {text}"


def inner_as_saved(like: dict[str, Any], saved: PyTree) -> dict[str, Any]:
    """``like`` (a checkpoint's target; ``opt_state`` a distributed optimizer's
    portable state) with its buffers under the names the checkpoint holds them by. A
    run saved with other data axes' names (``axis_name=("replica", "data")``, restored
    with ``"data"``) wrote the same params' state under other buffer names."""
    opt = saved.get("opt_state") if isinstance(saved, Mapping) else None
    inner = opt.get("inner_state") if isinstance(opt, Mapping) else None
    mine = like["opt_state"]
    if inner is None or not isinstance(mine, dict) or "inner_state" not in mine:
        return like
    return {
        **like,
        "opt_state": {**mine, "inner_state": keyed_as_saved(mine["inner_state"], inner)},
    }

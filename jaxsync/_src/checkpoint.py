"""Train-state checkpoints through orbax, resumable on another number of DP ranks.

What is saved: the params, the distributed optimizer's state in its portable
(per-parameter) form, any extra arrays (rng keys, ...), a JSON dict (step,
data position, config), and jaxsync's own record for the checks at restore: a
description of the optimizer and a checksum of every array. Saving is
asynchronous and atomic (orbax writes into a temporary directory and renames it
when complete, so a killed save never replaces the last good checkpoint), the
manager keeps the last N, and a save still in flight when the interpreter exits
is finished first.

What restore refuses, instead of training on silently wrong state: arrays whose
names or shapes differ from the model, an optimizer configured otherwise than
the one saved (loss scaling, labels, inner optimizer, clipping, ...), arrays
whose checksum differs from the one saved (bytes changed on disk), and files
that cannot be read; each error names the step, and the array or file at fault.
"""

from __future__ import annotations

import atexit
import logging
import operator
import os
import threading
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .checksum import tree_checksums
from .describe import DISTRIBUTED, describe_optimizer, optimizer_differences
from .loss_scale import init_loss_scale
from .names import param_name
from .optimizer import DistributedOptimizer
from .optimizer_state import DistributedOptimizerState

PyTree = Any

#: Name of the checkpoint item holding jaxsync's own record (optimizer, checksums).
CHECKS_ITEM = "jaxsync"
_CHECKS_VERSION = 1

NO_CHECKPOINT = (
    "no complete checkpoint in {dir}{detail}. Checkpoints that were being written when "
    "a run died are left as temporary directories and never used; start without "
    "--resume, or point to the directory the run saved into."
)
STEP_NOT_NEWER = (
    "cannot save step {step} in {dir}: it already holds step {newest}, and a checkpoint "
    "is only written for a step newer than the newest one (orbax would skip it without "
    "a word). If this is a new run, give it a fresh directory or delete the old "
    "checkpoints first (the example trainer's --overwrite does that); if it resumes a "
    "run, restore that run's newest step before saving."
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
CLOSED = (
    "this Checkpointer for {dir} is closed; create a new jaxsync.Checkpointer to save or restore."
)

logger = logging.getLogger(__name__)


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


# Checkpointers with saves that may still be in flight, finished at exit.
_OPEN: set[Checkpointer] = set()
_HOOK = threading.Lock()
_HOOKED = False


def _finish_open_checkpointers() -> None:
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except Exception:  # at exit there is no caller left to raise to
            logger.exception("jaxsync: finishing the checkpoint in %s failed", ckpt.directory)


def _finish_at_exit() -> None:
    global _HOOKED
    with _HOOK:
        if _HOOKED:
            return
        # The threading module's exit hooks run before the interpreter shuts down
        # the thread pools orbax writes with (those hooks were registered when orbax
        # was imported, and they run last-in first-out); `atexit` runs too late, when
        # the pools accept no more work and the save stays a temporary directory.
        register = getattr(threading, "_register_atexit", None)
        try:
            (register or atexit.register)(_finish_open_checkpointers)
        except RuntimeError:  # the interpreter is already shutting down
            atexit.register(_finish_open_checkpointers)
        _HOOKED = True


class Checkpointer:
    """Saves and restores a training run's state with an orbax ``CheckpointManager``.

    Use it as a context manager (or call :meth:`close`): an asynchronous save
    returns before the checkpoint is on disk. A save still in flight when the
    interpreter exits normally is finished then, so a script that forgets to
    close does not lose its last checkpoint.

    Args:
      directory: where step directories are written.
      max_to_keep: keep the newest N checkpoints.
      async_save: return from :meth:`save` while the write goes on in the
        background (the next save, :meth:`wait` or :meth:`close` waits for it).

    Example:
      >>> with jaxsync.Checkpointer("runs/ckpt", max_to_keep=3) as ckpt:
      ...     ckpt.save(step, params=params, opt_state=opt_state, tx=tx, mesh=mesh,
      ...               meta={"data_position": step})
      ...     r = ckpt.restore(params_like=params, tx=tx, mesh=mesh)
    """

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True
    ):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"`max_to_keep` must be an int >= 1, got {max_to_keep!r}.")
        self.directory = os.path.abspath(os.fspath(directory))
        self._closed = False
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
            ),
            # Handlers named up front, so a fresh manager (a resumed run) can read
            # the saved tree's metadata before restoring.
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
                CHECKS_ITEM: ocp.JsonCheckpointHandler(),
            },
        )
        _finish_at_exit()
        _OPEN.add(self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(CLOSED.format(dir=self.directory))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (after a pending save)."""
        self._reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (after a pending save)."""
        self._reload()
        return list(self._manager.all_steps())

    def _reload(self) -> None:
        # A save in flight is only on disk once finished; reading the directory
        # before that would also make the manager forget it.
        if not self._closed:
            self._manager.wait_until_finished()
        self._manager.reload()

    def save(
        self,
        step: int,
        *,
        params: PyTree,
        opt_state: PyTree,
        tx: Any = None,
        mesh: Mesh | None = None,
        extra: PyTree = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Starts saving ``step``.

        A distributed optimizer's state (pass ``tx`` and ``mesh``) is saved in its
        portable form; other optimizer states as they are. ``tx`` is also
        described in the checkpoint, so that a restore with other settings fails.

        Raises:
          ValueError: ``step`` is not newer than the newest checkpoint in the
            directory (it would not be written), a distributed optimizer's state
            comes without ``tx`` and ``mesh``, or ``meta`` is not JSON.
        """
        self._check_open()
        try:
            if isinstance(step, bool):
                raise TypeError
            step = operator.index(step)
        except TypeError:
            raise TypeError(f"`step` must be an int, got {step!r}.") from None
        if step < 0:
            raise ValueError(f"`step` must be >= 0, got {step}.")
        # The manager's own record includes saves still in flight.
        newest = self._manager.latest_step()
        if newest is not None and step <= newest:
            raise ValueError(STEP_NOT_NEWER.format(step=step, dir=self.directory, newest=newest))
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"`meta` must be a dict, got {type(meta).__name__}.")
        meta = dict(meta or {})
        problem = _json_problem(meta, "meta")
        if problem:
            where, value = problem
            raise TypeError(META_NOT_JSON.format(where=where, value=value, type=type(value)))
        if isinstance(opt_state, DistributedOptimizerState):
            if not isinstance(tx, DistributedOptimizer) or mesh is None:
                raise ValueError(
                    "saving a DistributedOptimizerState needs `tx` (the "
                    "jaxsync.distributed_optimizer) and `mesh`, to write it in a form that "
                    "does not depend on the number of data-parallel ranks."
                )
            description = describe_optimizer(tx, params, opt_state)
            opt_state = tx.to_portable(opt_state, params, mesh)
        else:
            description = describe_optimizer(None, params, opt_state)
        state = {"params": params, "opt_state": opt_state, "extra": extra or {}}
        checks = {
            "version": _CHECKS_VERSION,
            "optimizer": description,
            "checksums": tree_checksums(state),
        }
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                **{CHECKS_ITEM: ocp.args.JsonSave(checks)},
            ),
            force=True,  # the step was checked above; no save policy may drop it
        )
        if not saved:
            raise ValueError(STEP_NOT_NEWER.format(step=step, dir=self.directory, newest="?"))

    def _others(self, step: int) -> str:
        others = [s for s in self.all_steps() if s != step]
        return f" (other complete steps: {others})" if others else " (there is no other step)"

    def _unreadable(self, step: int, what: str, item: str, e: BaseException) -> Exception:
        return CorruptCheckpointError(
            UNREADABLE.format(
                step=step,
                dir=self.directory,
                what=what,
                error=_first_line(e),
                path=os.path.join(self.directory, str(step), item),
                others=self._others(step),
            )
        )

    def _read_json(self, step: int, item: str, what: str) -> Any:
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
            )
        except Exception as e:
            raise self._unreadable(step, what, item, e) from e
        return out[item]

    def _complete_step(self, step: int | None) -> int:
        self._check_open()
        if step is None:
            step = self.latest_step()
        elif step not in self.all_steps():
            step = None
        if step is None:
            found = self.all_steps()
            detail = f" (complete steps: {found})" if found else ""
            raise FileNotFoundError(NO_CHECKPOINT.format(dir=self.directory, detail=detail))
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` dict saved with ``step`` (default: the newest), without the arrays.

        A resumed run can compare the config it was saved with before building
        anything. Raises ``FileNotFoundError`` without a complete checkpoint.
        """
        step = self._complete_step(step)
        return dict(self._read_json(step, "meta", "meta (JSON)") or {})

    def restore(
        self,
        *,
        params_like: PyTree,
        opt_state_like: PyTree = None,
        tx: Any = None,
        mesh: Mesh | None = None,
        extra_like: PyTree = None,
        step: int | None = None,
        allow_optimizer_change: bool = False,
    ) -> Restored:
        """Restores ``step`` (default: the newest complete one) onto ``mesh``.

        Args:
          params_like: arrays or ``ShapeDtypeStruct``s (with shardings) shaped like
            the params; restored params get their shardings (replicated if none).
          opt_state_like: the optimizer state's abstract form, for optimizers
            other than a :class:`DistributedOptimizer` (pass ``tx`` and ``mesh``
            for those: the state is rebuilt for ``mesh``'s DP size).
          tx: the :class:`DistributedOptimizer`, configured as when saved.
          mesh: the mesh to restore onto (its data-parallel size may differ).
          extra_like: abstract form of the ``extra`` arrays saved.
          step: which checkpoint; default the latest.
          allow_optimizer_change: restore even though ``tx`` is configured
            otherwise than the saved optimizer (e.g. to turn clipping on
            mid-run); a changed loss scaler restarts from its initial scale.

        Raises:
          FileNotFoundError: no complete checkpoint in the directory.
          CheckpointMismatchError: the checkpoint's names or shapes do not match
            the model, or its optimizer settings differ from ``tx``'s; the
            message lists every difference.
          CorruptCheckpointError: files that cannot be read, or arrays that read
            back other values than were saved; the message names the step and
            the file or array.
        """
        step = self._complete_step(step)

        # jaxsync's record; checkpoints written before it existed have none.
        checks = None
        if os.path.isdir(os.path.join(self.directory, str(step), CHECKS_ITEM)):
            checks = self._read_json(step, CHECKS_ITEM, "checks record (JSON)")
        saved_opt = (checks or {}).get("optimizer")
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as e:
            raise self._unreadable(step, "array metadata", "state", e) from e
        saved = getattr(saved, "tree", saved)
        if saved is None:
            raise FileNotFoundError(
                NO_CHECKPOINT.format(dir=self.directory, detail=f" (step {step} has no state)")
            )
        saved_names = _names(saved)

        distributed = isinstance(tx, DistributedOptimizer)
        saved_distributed = (saved_opt or {}).get("kind") == DISTRIBUTED or (
            saved_opt is None and any(n.startswith("opt_state.master.") for n in saved_names)
        )
        if saved_distributed and not distributed:
            raise ValueError(NEEDS_TX.format(step=step, dir=self.directory))
        if (
            not distributed
            and opt_state_like is None
            and any(n.startswith("opt_state.") for n in saved_names)
        ):
            raise ValueError(NEEDS_OPT_STATE_LIKE.format(step=step, dir=self.directory))

        def abstract(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
            s = sharding or getattr(x, "sharding", None)
            if s is None and mesh is not None:
                s = NamedSharding(mesh, P())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

        params_abs = jax.tree.map(abstract, params_like)
        if distributed:
            if mesh is None:
                raise ValueError(NEEDS_MESH)
            opt_abs = tx.portable_shapes(params_like, mesh)
        else:
            opt_abs = jax.tree.map(abstract, opt_state_like)
        target = {
            "params": params_abs,
            "opt_state": opt_abs,
            "extra": jax.tree.map(abstract, extra_like or {}),
        }
        # The optimizer first: a changed setting explains missing arrays better.
        changed = []
        if saved_opt is not None:
            # A plain optax state is described as it is held in memory, as at save.
            now = describe_optimizer(tx, params_like, opt_abs if distributed else opt_state_like)
            changed = optimizer_differences(saved_opt, now)
            if changed and not allow_optimizer_change:
                raise CheckpointMismatchError(
                    OPTIMIZER_CHANGED.format(
                        step=step, dir=self.directory, problems="\n".join(changed)
                    )
                )

        problems = compare_trees(saved, target)
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} does not match the model:\n"
                + "\n".join(problems)
                + "\nRestore with the model and optimizer settings the run was saved "
                "with (the data-parallel size may differ)."
            )

        # Read every array in the dtype it was saved in, so its checksum can be
        # checked, and cast afterwards where the model wants another dtype.
        def as_saved(path: Any, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            dtype = saved_names[param_name(path)][1]
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)

        read_target = jax.tree_util.tree_map_with_path(as_saved, target)
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(read_target))
            )
        except Exception as e:
            raise self._unreadable(step, "arrays", "state", e) from e
        state = out["state"]
        if checks is not None:
            self._verify(step, checks.get("checksums", {}), state)
        state = jax.tree.map(
            lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), state, target
        )
        meta = self._read_json(step, "meta", "meta (JSON)")
        opt_state = state["opt_state"]
        if distributed:
            opt_state = tx.from_portable(opt_state, state["params"], mesh)
            if any(line.startswith("  loss_scale:") for line in changed):
                # The saved scale belongs to the old scaler (e.g. 4096 from a dynamic
                # one): start the new one from its own initial state.
                fresh = jax.device_put(
                    init_loss_scale(tx.__dict__["config"].loss_scale), NamedSharding(mesh, P())
                )
                opt_state = opt_state._replace(loss_scale=fresh)
        return Restored(step, state["params"], opt_state, state["extra"], dict(meta or {}))

    def _verify(self, step: int, expected: dict[str, str], state: PyTree) -> None:
        got = tree_checksums(state)
        bad = [
            f"  {name}: {expected[name]} -> {got[name]}"
            for name in sorted(got)
            if name in expected and expected[name] != got[name]
        ]
        if bad:
            raise CorruptCheckpointError(
                CHECKSUM_MISMATCH.format(
                    step=step,
                    dir=self.directory,
                    n=len(bad),
                    arrays="\n".join(bad),
                    path=os.path.join(self.directory, str(step), "state"),
                    others=self._others(step),
                )
            )

    def wait(self) -> None:
        """Blocks until a pending asynchronous save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes a pending save and releases the manager (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._manager.wait_until_finished()
        self._manager.close()

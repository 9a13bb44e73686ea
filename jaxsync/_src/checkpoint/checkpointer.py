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
import os
import threading
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..multihost.watchdog import CHECKPOINT, phase  # names the phase in a hang report
from ..optim.loss_scale import init_loss_scale
from ..optim.optimizer import DistributedOptimizer
from ..optim.state import DistributedOptimizerState
from ..step.handed import dropped_by_save
from .checksum import tree_checksums
from .describe import DISTRIBUTED, describe_optimizer, optimizer_differences
from .io import CheckpointIO
from .lock import WriterLock
from .placement import abstract_on
from .records import (
    CHECKS_ITEM,
    FSDP_PADDING,
    NEEDS_MESH,
    NEEDS_OPT_STATE_LIKE,
    NEEDS_TX,
    NOT_PARTS,
    OPTIMIZER_CHANGED,
    CheckpointMismatchError,
    CorruptCheckpointError,
    Restored,
    _names,
    compare_trees,
    inner_as_saved,
)
from .train_state import restore_state, save_state

__all__ = [
    "CHECKS_ITEM",
    "CheckpointMismatchError",
    "Checkpointer",
    "CorruptCheckpointError",
    "Restored",
    "compare_trees",
]
_CHECKS_VERSION = 1
logger = logging.getLogger(__name__)

PyTree = Any

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


PARTIAL_SAVE = (
    "Checkpointer.save: `opt_state` is a jaxsync.train_step state's (mode={mode!r}); `save` "
    "writes params and optimizer state only, so {lost} would not be saved, and a resumed "
    "run would restart them. Save the whole state with `ckpt.save_state(step, state)`."
)


class PartialSaveWarning(UserWarning):
    """``Checkpointer.save`` was handed part of a TrainState that holds more."""


class Checkpointer(CheckpointIO):
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
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        take_over: bool = False,
    ):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"`max_to_keep` must be an int >= 1, got {max_to_keep!r}.")
        self.directory = os.path.abspath(os.fspath(directory))
        self._closed = False
        self._lock = WriterLock(self.directory, self, take_over=take_over)
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
        # What the directory holds now is no other writer's (a run resumed from it);
        # a step that appears there later is, unless this Checkpointer saved it.
        self._seen = set(self._manager.all_steps())
        self._mine = set()
        self._claimed = False
        _finish_at_exit()
        _OPEN.add(self)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @phase(CHECKPOINT)
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
            directory (it would not be written, or would overwrite a step another
            writer saved there: the message names the steps and that writer), another
            live run holds the directory, a distributed optimizer's state comes
            without ``tx`` and ``mesh``, or ``meta`` is not JSON.
        """
        step, meta = self._check_save(step, meta)
        dropped = dropped_by_save(opt_state)
        if dropped is not None:
            warnings.warn(
                PARTIAL_SAVE.format(mode=dropped[0].mode.name, lost=dropped[1]),
                PartialSaveWarning,
                stacklevel=2,
            )
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
        self._write(step, state, meta, checks)

    @phase(CHECKPOINT)
    def save_state(
        self,
        train_step: Any,
        state: Any,
        *,
        step: int | None = None,
        extra: PyTree = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Starts saving the whole :class:`jaxsync.TrainState` of ``train_step``.

        Every field is saved (step counter, params, optimizer state, model state
        such as BatchNorm statistics, loss scale and skip counters), in a form
        independent of the data-parallel size, in every mode. ``step`` (the
        checkpoint's number) defaults to ``int(state.step)``.

        Example:
          >>> ckpt.save_state(train_step, state, step=i, meta={"data_position": i})
        """
        self._check_open()
        save_state(self, train_step, state, step=step, extra=extra, meta=meta)

    @phase(CHECKPOINT)
    def restore_state(
        self,
        train_step: Any,
        state_like: Any,
        *,
        step: int | None = None,
        extra_like: PyTree = None,
    ) -> Any:
        """Restores a whole TrainState saved by :meth:`save_state` onto ``train_step``'s mesh.

        ``state_like`` is ``train_step.init(params_or_module)`` or
        ``train_step.abstract_state(...)`` (only its shapes and shardings are
        used; the data-parallel size may differ from the saved run's). Returns a
        ``RestoredState(step, state, extra, meta)``. Raises
        :class:`CheckpointMismatchError` naming any part of the state the
        checkpoint does not hold; nothing is re-initialised.
        """
        return restore_state(self, train_step, state_like, step=step, extra_like=extra_like)

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The ``meta`` dict saved with ``step`` (default: the newest), without the arrays.

        A resumed run can compare the config it was saved with before building
        anything. Raises ``FileNotFoundError`` without a complete checkpoint.
        """
        step = self._complete_step(step)
        return dict(self._read_json(step, "meta", "meta (JSON)") or {})

    @phase(CHECKPOINT)
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
            the params; restored params get their shardings, moved onto ``mesh``
            when given (a ``NamedSharding`` keeps its spec; anything else, a single
            device's or none, is replicated there).
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
          CorruptCheckpointError: files that cannot be read or are missing (an
            incomplete step: the message names the newest complete one and the
            ``step=`` to restore), or arrays that read back other values than were
            saved; the message names the step and the file or array.
        """
        step = self._complete_step(step)

        # jaxsync's record; checkpoints written before it existed have none.
        checks, saved = self._record(step)
        if (checks or {}).get("train_state") is not None:
            raise CheckpointMismatchError(NOT_PARTS.format(step=step, dir=self.directory))
        saved_opt = (checks or {}).get("optimizer")
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

        params_abs = abstract_on(params_like, mesh, "params_like")
        if distributed:
            if mesh is None:
                raise ValueError(NEEDS_MESH)
            opt_abs = tx.portable_shapes(params_like, mesh)
        else:
            opt_abs = abstract_on(opt_state_like, mesh, "opt_state_like")
        target = {
            "params": params_abs,
            "opt_state": opt_abs,
            "extra": abstract_on(extra_like or {}, mesh, "extra_like"),
        }
        if distributed:  # saved under other data axes' names, its buffers are named so
            target = inner_as_saved(target, saved)
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
                "with (the data-parallel size may differ for a distributed optimizer's "
                "state)." + (FSDP_PADDING if any("shape differs" in p for p in problems) else "")
            )

        state = self._read(step, target, checks, saved)
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

    @phase(CHECKPOINT)
    def wait(self) -> None:
        """Blocks until a pending asynchronous save is complete on disk."""
        self._manager.wait_until_finished()

    @phase(CHECKPOINT)
    def close(self) -> None:
        """Finishes a pending save and releases the manager (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._manager.wait_until_finished()
        self._manager.close()
        self._lock.release()

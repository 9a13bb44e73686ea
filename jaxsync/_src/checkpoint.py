"""Train-state checkpoints through orbax, resumable on another number of DP ranks.

What is saved: the params, the distributed optimizer's state in its portable
(per-parameter) form, any extra arrays (rng keys, ...) and a JSON dict (step,
data position, config). Saving is asynchronous and atomic (orbax writes into a
temporary directory and renames it when complete, so a killed save never
replaces the last good checkpoint), and the manager keeps the last N.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .names import param_name
from .optimizer import DistributedOptimizer
from .optimizer_state import DistributedOptimizerState

PyTree = Any

NO_CHECKPOINT = (
    "no complete checkpoint in {dir}{detail}. Checkpoints that were being written when "
    "a run died are left as temporary directories and never used; start without "
    "--resume, or point to the directory the run saved into."
)


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


class Checkpointer:
    """Saves and restores a training run's state with an orbax ``CheckpointManager``.

    Args:
      directory: where step directories are written.
      max_to_keep: keep the newest N checkpoints.
      async_save: return from :meth:`save` while the write goes on in the
        background (call :meth:`wait` or :meth:`close` before exiting).

    Example:
      >>> ckpt = jaxsync.Checkpointer("runs/ckpt", max_to_keep=3)
      >>> ckpt.save(step, params=params, opt_state=opt_state, tx=tx, mesh=mesh,
      ...           meta={"data_position": step})
      >>> r = ckpt.restore(params_like=params, tx=tx, mesh=mesh)
    """

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True
    ):
        self.directory = os.path.abspath(os.fspath(directory))
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
            },
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self._manager.reload()
        return list(self._manager.all_steps())

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
        """Starts saving ``step``. A distributed optimizer's state (pass ``tx`` and
        ``mesh``) is saved in its portable form; other optimizer states as they are."""
        if isinstance(opt_state, DistributedOptimizerState):
            if not isinstance(tx, DistributedOptimizer) or mesh is None:
                raise ValueError(
                    "saving a DistributedOptimizerState needs `tx` (the "
                    "jaxsync.distributed_optimizer) and `mesh`, to write it in a form that "
                    "does not depend on the number of data-parallel ranks."
                )
            opt_state = tx.to_portable(opt_state, params, mesh)
        state = {"params": params, "opt_state": opt_state, "extra": extra or {}}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta or {}))
            ),
        )

    def restore(
        self,
        *,
        params_like: PyTree,
        opt_state_like: PyTree = None,
        tx: Any = None,
        mesh: Mesh | None = None,
        extra_like: PyTree = None,
        step: int | None = None,
    ) -> Restored:
        """Restores ``step`` (default: the newest complete one) onto ``mesh``.

        Args:
          params_like: arrays or ``ShapeDtypeStruct``s (with shardings) shaped like
            the params; restored params get their shardings (replicated if none).
          opt_state_like: the optimizer state's abstract form, for optimizers
            other than a :class:`DistributedOptimizer` (pass ``tx`` and ``mesh``
            for those: the state is rebuilt for ``mesh``'s DP size).
          extra_like: abstract form of the ``extra`` arrays saved.
          step: which checkpoint; default the latest.

        Raises:
          FileNotFoundError: no complete checkpoint in the directory.
          ValueError: the checkpoint's names or shapes do not match the model; the
            message lists every mismatch.
        """
        if step is None:
            step = self.latest_step()
        elif step not in self.all_steps():
            step = None
        if step is None:
            found = self.all_steps()
            detail = f" (complete steps: {found})" if found else ""
            raise FileNotFoundError(NO_CHECKPOINT.format(dir=self.directory, detail=detail))

        def abstract(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
            s = sharding or getattr(x, "sharding", None)
            if s is None and mesh is not None:
                s = NamedSharding(mesh, P())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

        params_abs = jax.tree.map(abstract, params_like)
        distributed = isinstance(tx, DistributedOptimizer)
        if distributed:
            if mesh is None:
                raise ValueError("restoring a distributed optimizer's state needs `mesh`.")
            opt_abs = tx.portable_shapes(params_like, mesh)
        else:
            opt_abs = jax.tree.map(abstract, opt_state_like)
        target = {
            "params": params_abs,
            "opt_state": opt_abs,
            "extra": jax.tree.map(abstract, extra_like or {}),
        }
        saved = self._manager.item_metadata(step)["state"]
        saved = getattr(saved, "tree", saved)
        if saved is None:
            raise FileNotFoundError(
                NO_CHECKPOINT.format(dir=self.directory, detail=f" (step {step} has no state)")
            )
        problems = compare_trees(saved, target)
        if problems:
            raise ValueError(
                f"checkpoint step {step} in {self.directory} does not match the model:\n"
                + "\n".join(problems)
                + "\nRestore with the model and optimizer settings the run was saved "
                "with (the data-parallel size may differ)."
            )
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        state, meta = out["state"], out["meta"]
        opt_state = state["opt_state"]
        if distributed:
            opt_state = tx.from_portable(opt_state, state["params"], mesh)
        return Restored(step, state["params"], opt_state, state["extra"], dict(meta or {}))

    def wait(self) -> None:
        """Blocks until a pending asynchronous save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

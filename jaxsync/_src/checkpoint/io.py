"""The reading and writing under :class:`jaxsync.Checkpointer`: one orbax manager.

Every save goes through :meth:`CheckpointIO._check_save` and ``_write`` (which
takes the directory's writer marker, see ``checkpoint.lock.py``), every
restore through ``_record`` (jaxsync's JSON record and the saved tree's
metadata) and ``_read`` (arrays in their saved dtypes, checksums verified).
The public methods live in ``checkpoint.py`` (params and optimizer state) and
``checkpoint.train_state.py`` (a whole TrainState).
"""

from __future__ import annotations

import operator
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from ..core.names import param_name
from .checksum import tree_checksums
from .lock import describe
from .records import (
    CHECKS_ITEM,
    CHECKSUM_MISMATCH,
    CLOSED,
    INCOMPLETE_FIX,
    INCOMPLETE_NONE,
    INCOMPLETE_STEP,
    META_NOT_JSON,
    NO_CHECKPOINT,
    OTHER_WRITER,
    STEP_NOT_NEWER,
    UNREADABLE,
    CorruptCheckpointError,
    _first_line,
    _json_problem,
    _names,
)

PyTree = Any


class CheckpointIO:
    """Orbax reads and writes with jaxsync's checks (the base of Checkpointer)."""

    directory: str
    _closed: bool
    _manager: Any
    _lock: Any
    # Steps this Checkpointer has seen in the directory (when opened, and each time
    # it read the directory on a caller's behalf), those it saved itself, and whether
    # its saves have checked the directory since it took the writer marker.
    _seen: set[int]
    _mine: set[int]
    _claimed: bool

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (after a pending save)."""
        self._reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (after a pending save)."""
        self._reload()
        return list(self._manager.all_steps())

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(CLOSED.format(dir=self.directory))

    def _reload(self) -> None:
        # A save in flight is only on disk once finished; reading the directory
        # before that would also make the manager forget it.
        if not self._closed:
            self._manager.wait_until_finished()
        self._manager.reload()
        self._seen.update(self._manager.all_steps())

    def _check_save(self, step: Any, meta: Any) -> tuple[int, dict[str, Any]]:
        """The checks every save makes before writing: ``(step, meta)``."""
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
            foreign = sorted(set(self._manager.all_steps()) - self._seen - self._mine)
            if foreign:  # read when this writer took the marker, or on a caller's behalf
                raise ValueError(self._other_writer(step, foreign))
            raise ValueError(STEP_NOT_NEWER.format(step=step, dir=self.directory, newest=newest))
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"`meta` must be a dict, got {type(meta).__name__}.")
        meta = dict(meta or {})
        problem = _json_problem(meta, "meta")
        if problem:
            where, value = problem
            raise TypeError(META_NOT_JSON.format(where=where, value=value, type=type(value)))
        return step, meta

    def _write(self, step: int, state: PyTree, meta: dict[str, Any], checks: Any) -> None:
        self._claim(step)
        # Each step names its writer, so that another writer refused by it is told whose.
        checks = {**checks, "writer": self._lock.identity()}
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                **{CHECKS_ITEM: ocp.args.JsonSave(checks)},
            ),
            # `_check_save` and `_claim` made sure the step is new and no other
            # writer's; no save policy may drop it.
            force=True,
        )
        if not saved:
            raise ValueError(STEP_NOT_NEWER.format(step=step, dir=self.directory, newest="?"))
        self._mine.add(step)

    def _claim(self, step: int) -> None:
        """Takes (or keeps) the writer marker, and refuses ``step`` if it would overwrite
        (or fall behind) a step another writer saved since this Checkpointer last read
        the directory.

        The manager's cached steps are this writer's view: a run that saved and closed
        while this one held no marker is not in it, and a forced save would overwrite
        its step. So the first save after the marker is taken reads the directory
        again (on every process; the marker itself is process 0's), and every save
        checks that its step is not on disk. A step newer than every step there is
        saved: the directory was free again.
        """
        fresh = jax.process_index() == 0 and self._lock.acquire()
        if fresh or not self._claimed:
            self._manager.wait_until_finished()  # this writer's own saves, if any
            self._manager.reload()
            on_disk = set(self._manager.all_steps())
            foreign = sorted(on_disk - self._seen - self._mine)
            if foreign and step <= max(on_disk):
                if fresh:  # hand the marker back: this Checkpointer will not write
                    self._lock.release()
                raise ValueError(self._other_writer(step, foreign))
            self._seen.update(on_disk)
            self._claimed = True
        if step not in self._mine and os.path.exists(os.path.join(self.directory, str(step))):
            raise ValueError(self._other_writer(step, [step]))

    def _other_writer(self, step: int, steps: list[int]) -> str:
        try:
            args = ocp.args.Composite(**{CHECKS_ITEM: ocp.args.JsonRestore()})
            checks = self._manager.restore(steps[-1], args=args)[CHECKS_ITEM]
            writer = describe((checks or {}).get("writer") or {})
        except Exception:  # the step's record is not readable: say so, refuse anyway
            writer = "a writer whose record cannot be read"
        newest = self._manager.latest_step()
        return OTHER_WRITER.format(
            step=step,
            dir=self.directory,
            writer=writer,
            steps=steps,
            newest=f" (its newest: step {newest})" if newest is not None else "",
        )

    def _record(self, step: int) -> tuple[Any, PyTree]:
        """jaxsync's record of ``step`` (None for checkpoints older than it) and the
        saved arrays' metadata tree."""
        checks = None
        if os.path.isdir(os.path.join(self.directory, str(step), CHECKS_ITEM)):
            checks = self._read_json(step, CHECKS_ITEM, "checks record (JSON)")
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as e:
            raise self._unreadable(step, "array metadata", "state", e) from e
        saved = getattr(saved, "tree", saved)
        if saved is None:
            raise self._incomplete(step)
        return checks, saved

    def _incomplete(self, step: int) -> CorruptCheckpointError:
        """A step without its arrays' metadata: name it, and the newest step to restore."""
        path = os.path.join(self.directory, str(step))
        meta_file = os.path.join(path, "state", "_METADATA")
        if not os.path.isdir(os.path.join(path, "state")):
            missing = f"it has no `state` item ({os.path.join(path, 'state')} is missing)"
        elif not os.path.exists(meta_file):
            missing = f"{meta_file} is missing"
        else:
            missing = f"the metadata under {os.path.join(path, 'state')} names no arrays"
        others = [s for s in self.all_steps() if s != step]
        good = next((s for s in reversed(others) if self._has_state(s)), None)
        if good is not None:
            fix = INCOMPLETE_FIX.format(good=good, path=path, step=step)
        else:
            seen = f" (steps {others} are not either)" if others else ""
            fix = INCOMPLETE_NONE.format(dir=self.directory, others=seen)
        return CorruptCheckpointError(
            INCOMPLETE_STEP.format(step=step, dir=self.directory, missing=missing, fix=fix)
        )

    def _has_state(self, step: int) -> bool:
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception:
            return False
        return getattr(saved, "tree", saved) is not None

    def _read(self, step: int, target: PyTree, checks: Any, saved: PyTree) -> PyTree:
        """Reads ``target`` in the dtypes it was saved in (so checksums can be
        checked), verifies them, then casts to ``target``'s dtypes."""
        saved_names = _names(saved)

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
        return jax.tree.map(
            lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), state, target
        )

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

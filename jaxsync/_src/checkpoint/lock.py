"""One writer per checkpoint directory: an owner marker that a second writer hits.

Two runs saving into one directory at once (a requeued job started beside the
live one) would each keep deleting the other's steps, or skip their own saves,
without a word. The first :meth:`Checkpointer.save` of a run writes
``<directory>/.jaxsync-writer.json`` (host, pid, the process's start time and a
token of this Checkpointer) and :meth:`Checkpointer.close` removes it. Another
writer finding it raises, unless the owner is gone: the same host with no
process of that pid and start time, or this very process after the owning
Checkpointer was closed or dropped. An owner on another host cannot be checked
from here; ``Checkpointer(..., take_over=True)`` takes the directory anyway.
Only process 0 of a multi-process run holds the marker.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
import weakref
from typing import Any

LOCK_NAME = ".jaxsync-writer.json"

HELD = (
    "checkpoint directory {dir} is being written by another run: {owner} (marker {path}). "
    "Two writers in one directory lose each other's checkpoints. Stop the other run, or "
    "give this run its own directory. If the other run is dead (its host cannot be "
    "checked from here), pass `take_over=True` to jaxsync.Checkpointer or delete {path}."
)

TAKEN = (
    "checkpoint directory {dir} was taken over by another writer: {owner} (marker {path}), "
    "after this Checkpointer's last save. Its saves are refused from here on, so that the "
    "two runs do not overwrite each other's steps: stop one of them, or give this run "
    "its own directory."
)


def describe(rec: dict[str, Any]) -> str:
    """A writer record (the marker's, or a step's) in words."""
    if not rec.get("pid"):
        return "a writer that left no record of itself"
    same = rec.get("pid") == os.getpid() and rec.get("host") == socket.gethostname()
    who = ", another jaxsync.Checkpointer of this very process" if same else ""
    pid, host, since = rec.get("pid"), rec.get("host"), rec.get("since")
    return f"process {pid} on host {host!r}{who}, writing since {since}"


# Tokens of the locks this process holds now (a closed or collected Checkpointer
# drops out, so its marker counts as stale).
_LIVE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    now = _start_time(pid)
    return started is None or now is None or now == started  # else the pid was reused


class WriterLock:
    """The owner marker of one directory, held by one Checkpointer."""

    def __init__(self, directory: str, owner: Any, *, take_over: bool = False):
        self.path = os.path.join(directory, LOCK_NAME)
        self.directory = directory
        self.take_over = take_over
        self.token = uuid.uuid4().hex
        self.held = False
        self._taken: dict[str, Any] | None = None
        self._owner = owner  # kept alive only as long as the Checkpointer

    def _record(self) -> dict[str, Any]:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": _start_time(os.getpid()),
            "token": self.token,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def _stale(self, rec: dict[str, Any]) -> bool:
        if rec.get("host") != socket.gethostname():
            return False
        if rec.get("pid") == os.getpid():
            return rec.get("token") not in _LIVE
        return not _alive(int(rec.get("pid", -1)), rec.get("started"))

    def identity(self) -> dict[str, Any]:
        """Who writes: recorded in each step this writer saves (to name it to another)."""
        return self._taken or self._record()

    def _read(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> bool:
        """Takes the directory, or raises naming the live owner; checked at every save.

        Returns True when the marker was taken now (this writer's first save, or the
        marker had been deleted): the caller then reads the directory again, since
        another writer may have saved steps while no marker was this one's.
        """
        if self.held:
            rec = self._read()
            if rec is not None and rec.get("token") == self.token:
                return False
            if rec:  # another writer took the directory over (`take_over=True`)
                raise ValueError(
                    TAKEN.format(dir=self.directory, owner=describe(rec), path=self.path)
                )
            self.held = False  # the marker was deleted: take it again
            _LIVE.pop(self.token, None)
        os.makedirs(self.directory, exist_ok=True)
        record = json.dumps(self._record())
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(self.path) as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                rec = {}
            if rec.get("token") != self.token and not (self.take_over or self._stale(rec)):
                raise ValueError(
                    HELD.format(dir=self.directory, owner=describe(rec), path=self.path)
                ) from None
            tmp = f"{self.path}.{self.token}"
            with open(tmp, "w") as f:
                f.write(record)
            os.replace(tmp, self.path)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(record)
        self.held = True
        self._taken = json.loads(record)
        _LIVE[self.token] = self._owner
        return True

    def release(self) -> None:
        """Removes the marker if this lock still owns it."""
        if not self.held:
            return
        self.held = False
        _LIVE.pop(self.token, None)
        try:
            with open(self.path) as f:
                mine = json.load(f).get("token") == self.token
            if mine:
                os.remove(self.path)
        except (OSError, ValueError):
            pass

"""A fault names itself: what a failing process tells the others, and what they say.

When one process of a multi-process run fails, the others learn it only as a
broken collective (gloo's "Connection reset by peer") or as JAX aborting them
once the coordination service in process 0 is gone; neither names the process
at fault. So a process that fails (an uncaught exception, or a fault a check
finds, such as a batch that changed shape on this process only) first writes a
*fault record* into the coordination service's key-value store: its rank, the
step and phase it was at, and what happened. The others read every record
(:mod:`.watchdog`'s monitor thread, about once a second, and their own error
path) and exit naming it. A process killed outright publishes nothing: the
others name it by its heartbeat that stopped, and the coordinator's loss by the
service that no longer answers.

Under ``python -m jaxsync.launch`` a process that ends because of another's
fault also writes ``blame.<rank>`` into the launcher's directory, naming the
process at fault, so that the launcher blames that one, whichever exited first.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

#: Exit code of a process that ends because another process failed (EX_PROTOCOL).
PEER_EXIT_CODE = 76
#: Key-value store directory of fault records, one key per rank.
KEY = "jaxsync/fault/"
#: Written by the launcher's processes: the rank they blame, and why (see launch.py).
ENV_LAUNCH_DIR = "JAXSYNC_LAUNCH_DIR"

COORDINATOR_GONE = (
    "the coordinator (process 0) is gone: JAX's coordination service, which runs in "
    "process 0, no longer answers ({detail}). Process 0 was killed, crashed or exited{last}; "
    "its own output says why."
)


def client() -> Any:
    from jax._src.distributed import global_state

    return global_state.client


def call(fn: Callable[..., Any], *args: Any, timeout: float = 2.0) -> Any:
    """``fn(*args)`` in a daemon thread, given up on after ``timeout`` s (an RPC to a
    coordinator that is stopped can block far longer); raises what it raised."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn(*args)))
        except Exception as e:  # handed to the caller
            box.append((False, e))

    t = threading.Thread(target=run, name="jaxsync-rpc", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"no answer from the coordination service in {timeout:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def record(
    rank: int, step: int, phase: str, what: str, after: int | None = None, hang: bool = False
) -> str:
    """The text of a fault record; ``after``: the rank whose fault caused this one;
    ``hang``: a hang verdict, which every process reaches on its own."""
    rec = {"rank": rank, "step": step, "phase": phase, "what": what, "after": after, "hang": hang}
    return json.dumps(rec)


_sent: list[str] = []  # this process's own fault (not caused by another), once published


def publish(rank: int, text: str, timeout: float = 2.0) -> bool:
    """Writes this process's fault record (``text`` from :func:`record`; its first
    own fault stays); False when the store did not take it (the coordinator is gone)."""
    c = client()
    if c is None:
        return False
    if _sent:
        return True
    if json.loads(text).get("after") is None:
        _sent.append(text)
    try:
        call(c.key_value_set, f"{KEY}{rank}", text, True, timeout=timeout)
    except Exception:
        return False
    return True


def parse(entries: list[tuple[str, str]]) -> dict[int, dict]:
    """Fault records by rank, from ``key_value_dir_get`` entries (other keys ignored)."""
    out = {}
    for key, value in entries:
        if key.startswith(KEY):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec = json.loads(value)
                out[int(rec["rank"])] = rec
    return out


def read(timeout: float = 2.0) -> dict[int, dict]:
    """Every fault record the store holds; raises when it does not answer."""
    return parse(call(client().key_value_dir_get, KEY, timeout=timeout))


def first(records: dict[int, dict], me: int, hangs: bool = True) -> dict | None:
    """The fault another process published that no other fault caused, if any
    (``hangs=False``: not a hang verdict)."""
    own = [
        r
        for k, r in sorted(records.items())
        if k != me and r.get("after") is None and (hangs or not r.get("hang"))
    ]
    return own[0] if own else None


def describe(rec: dict) -> str:
    what = str(rec["what"]).rstrip(".")
    return f"process {rec['rank']} failed at step {rec['step']} (phase {rec['phase']}): {what}"


def peer_failed(rec: dict, me: int) -> str:
    """What a process says when it ends because of ``rec``'s fault."""
    return (
        f"jaxsync (process {me}): {describe(rec)}. This process ends because of it "
        f"(exit code {PEER_EXIT_CODE}); process {rec['rank']}'s own output has the details."
    )


def coordinator_gone(detail: str, last: dict | None) -> str:
    tail = f" (its last fault record: {describe(last)})" if last else ""
    return COORDINATOR_GONE.format(detail=detail.strip() or "no detail", last=tail)


def blame(rank: int, culprit: int, why: str) -> None:
    """Tells the launcher (if any) that this process ends because of ``culprit``."""
    launch_dir = os.environ.get(ENV_LAUNCH_DIR)
    if not launch_dir or not os.path.isdir(launch_dir):
        return
    with contextlib.suppress(OSError):
        path = os.path.join(launch_dir, f"blame.{rank}")
        with open(f"{path}.tmp", "w") as f:
            f.write(json.dumps({"culprit": culprit, "why": why}))
        os.replace(f"{path}.tmp", path)


def blamed(launch_dir: str, rank: int) -> tuple[int, str] | None:
    """The launcher's side of :func:`blame`: (culprit, why) that ``rank`` named."""
    try:
        with open(os.path.join(launch_dir, f"blame.{rank}")) as f:
            rec = json.load(f)
        return int(rec["culprit"]), str(rec["why"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        sys.stdout.flush()

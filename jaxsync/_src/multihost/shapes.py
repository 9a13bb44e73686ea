"""A batch that changes shape on one process only names itself, at any step.

The first step compares every process's batch over all processes
(:mod:`.consistency`). After that, each process compares its batch's shapes and
dtypes with its last step's on the host, which costs nothing measurable. Shapes
may change on every process alike (the last, short batch of an epoch, sequence
length buckets); a process whose shapes changed cannot tell from here whether the
others' did, and it must not start a collective that the others do not join. So
it asks through the coordination service's key-value store: it writes its new
shapes under ``jaxsync/shape/<rank>/<step>`` and reads, for every other process,

- its shapes at this step, if it wrote any (its shapes changed too): equal is fine;
- else its position, published by :mod:`.watchdog`'s monitor: a process that is at
  this step or past it without having written kept the shapes every process
  agreed on before.

A mismatch raises here, naming both processes and the step, after publishing a
fault record (:mod:`.faults`) from which the others, waiting in the step's
collective, learn it and exit too.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from . import faults

KEY = "jaxsync/shape/"

BATCH_CHANGED = (
    "TrainStep: the batch changed shape at step {step} on process {me} and not alike on "
    "every process: {detail}. Every process passes its part of one global batch, with the "
    "same rows at every step (shapes as placed: its rows times {n} processes); a process "
    "whose rows differ from the others' trains on a global batch of another shape with "
    "another compiled step, and the processes no longer meet in the same collectives. "
    "Give every process the same batch size at each step (drop the last, short batch on "
    "all of them, or split the global batch evenly)."
)


def signature(batch: Any) -> tuple:
    """Each leaf's (shape, dtype): compared on the host, step to step."""
    return tuple(
        (getattr(x, "shape", None), getattr(x, "dtype", None)) for x in jax.tree.leaves(batch)
    )


def text(sig: tuple) -> str:
    return ", ".join(f"{tuple(s) if s is not None else '?'} {d}" for s, d in sig)


def check_changed(watch: Any, n: int, before: tuple, now: tuple) -> None:
    """Whether every process's batch changed alike at step ``n`` (see above).

    Raises:
      ValueError: another process kept its shapes or changed them otherwise, failed,
        or stopped answering.
    """
    me, mine = watch.rank, text(now)
    c = watch.client
    faults.call(c.key_value_set, f"{KEY}{me}/{n}", mine, True, timeout=30.0)
    pending, differ = set(range(watch.nproc)) - {me}, {}
    deadline = time.monotonic() + watch.first
    stale = max(3 * watch.interval, 4.0)
    while pending:
        entries = faults.call(c.key_value_dir_get, "jaxsync/", timeout=30.0)
        at = watch.positions(entries)
        theirs = {k[len(KEY) :]: v for k, v in entries if k.startswith(KEY)}
        failed = faults.parse(entries)
        for r in sorted(pending):
            step, phase = at.get(r, (-1, ""))
            if f"{r}/{n}" in theirs:
                pending.discard(r)
                if theirs[f"{r}/{n}"] != mine:
                    differ[r] = f"process {r} passes {theirs[f'{r}/{n}']}"
            elif step > n or (step == n and phase == "forward/backward"):
                pending.discard(r)  # it passed this step with the shapes agreed on before
                differ[r] = f"process {r} still passes {text(before)}"
            elif r in failed:
                pending.discard(r)
                differ[r] = f"{faults.describe(failed[r])}"
        now_t = time.monotonic()
        silent = [s for s in watch.seen(now_t) if s.rank in pending and s.beat_age > stale]
        for s in silent:
            pending.discard(s.rank)
            differ[s.rank] = f"process {s.rank} stopped answering ({s.beat_age:.1f}s)"
        if pending and now_t > deadline:
            differ.update({r: f"process {r} did not reach step {n}" for r in pending})
            break
        if pending:
            time.sleep(0.05)
    if not differ:
        return
    detail = f"process {me} now passes {mine} (before: {text(before)}), while " + "; ".join(
        differ[r] for r in sorted(differ)
    )
    message = BATCH_CHANGED.format(step=n, me=me, detail=detail, n=watch.nproc)
    what = f"its batch changed shape at step {n}, not alike on every process: {detail}"
    faults.publish(me, faults.record(me, n, "data", what))
    raise ValueError(message)

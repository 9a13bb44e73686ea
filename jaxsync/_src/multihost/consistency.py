"""What every process of a multi-process run must agree on, checked once.

Each process builds its own copy of the step: its config, its optimizer, its
params. Processes that disagree (another learning rate from a stale config,
another row count from a data loader, params from another seed) do not fail in
JAX: "replicated" params simply diverge between processes. So the step
fingerprints what must agree and compares the fingerprints over all processes
(one small all-gather) at ``init`` and on the first step, never again. A
single-process run skips all of it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..core.names import param_name
from . import watchdog

PyTree = Any

PROCESSES_DISAGREE = (
    "{fn}: the {n} processes of this run disagree on {what}:\n{detail}\nEvery process must "
    "build the step with the same mode, options, optimizer (and its hyperparameters) and "
    "model, and pass its own part of the same global batch; otherwise the replicated "
    "params and optimizer state drift apart between processes without any error. Check "
    "that every process reads the same config (and, for params, initialises from the "
    "same seed or broadcasts them)."
)

#: Largest array (elements) whose values enter a fingerprint; larger ones by shape.
_SMALL = 1 << 16


def describe_value(obj: Any, depth: int = 0, seen: frozenset[int] = frozenset()) -> str:
    """A stable text of ``obj`` for fingerprints: numbers, strings, containers,
    dataclasses and functions' closures (an optax optimizer's hyperparameters live
    in its closures), never memory addresses."""
    if depth > 12 or id(obj) in seen:
        return "..."
    seen = seen | {id(obj)}
    rec = functools.partial(describe_value, depth=depth + 1, seen=seen)
    if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
        return repr(obj)
    if isinstance(obj, np.generic):
        return f"{obj.dtype}:{obj!r}"
    if isinstance(obj, np.ndarray | jax.Array):
        return _describe_array(obj)
    if isinstance(obj, np.dtype) or (isinstance(obj, type) and issubclass(obj, np.generic)):
        return f"dtype:{np.dtype(obj).name}"
    if isinstance(getattr(obj, "dtype", None), np.dtype) and callable(obj):  # jnp.float32
        return f"dtype:{obj.dtype.name}"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple
        return f"{type(obj).__qualname__}({', '.join(rec(x) for x in obj)})"
    if isinstance(obj, list | tuple):
        return f"[{', '.join(rec(x) for x in obj)}]"
    if isinstance(obj, set | frozenset):
        return "{" + ", ".join(sorted(rec(x) for x in obj)) + "}"
    if isinstance(obj, Mapping):
        items = sorted((rec(k), rec(v)) for k, v in obj.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(obj, functools.partial):
        return f"partial({rec(obj.func)}, {rec(obj.args)}, {rec(obj.keywords)})"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f"{f.name}={rec(getattr(obj, f.name, None))}" for f in dataclasses.fields(obj)]
        return f"{type(obj).__qualname__}({', '.join(fields)})"
    code = getattr(obj, "__code__", None)
    if code is not None:  # a function: its name, defaults and closure
        cells = []
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                cells.append(rec(cell.cell_contents))
            except ValueError:  # an empty cell
                cells.append("<empty>")
        defaults = rec(getattr(obj, "__defaults__", None))
        kw = rec(getattr(obj, "__kwdefaults__", None))
        return f"{getattr(obj, '__qualname__', '?')}({defaults}, {kw})[{', '.join(cells)}]"
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"


def _describe_array(x: Any) -> str:
    shape, dtype = tuple(np.shape(x)), str(x.dtype)
    if np.size(x) > _SMALL or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return f"array{shape}:{dtype}"
    try:
        data = np.asarray(x)
    except Exception:  # a tracer, a deleted buffer: the shape is all there is
        return f"array{shape}:{dtype}"
    return f"array{shape}:{dtype}:{hashlib.sha256(data.tobytes()).hexdigest()[:16]}"


def structure(tree: PyTree) -> str:
    """The tree's paths, shapes and dtypes as text."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ";".join(
        f"{param_name(p)}:{tuple(np.shape(x))}:{getattr(x, 'dtype', type(x).__name__)}"
        for p, x in leaves
    )


def shardings(tree: PyTree) -> str:
    """Each leaf's PartitionSpec as text ("-" for an array with no NamedSharding).

    Compared before anything else of a step is built: processes that disagree on a
    param's spec take different code paths (a 2-D step on one, a 1-D step on another)
    and would meet in different collectives, garbling whatever they exchange next.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ";".join(
        f"param {param_name(p)}: {getattr(getattr(x, 'sharding', None), 'spec', '-')}"
        for p, x in leaves
    )


def _digest(text: str) -> np.ndarray:
    """Two int32 words of the text's sha256 (int32: all-gathered without x64)."""
    raw = hashlib.sha256(text.encode()).digest()[:8]
    return np.frombuffer(raw, dtype=np.int32).copy()


def _allgather(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def check_agree(items: Sequence[tuple[str, str]], fn: str, what: str = "") -> None:
    """Raises when processes hold different texts for any of the named ``items``.

    Every process must call this with the same number of items (the names come
    from the same code); a single process returns at once.
    """
    n = jax.process_count()
    if n == 1 or not items:
        return
    with watchdog.phase(watchdog.CHECK):  # a process that never joins it is named
        _check_agree(items, fn, what, n)


def _check_agree(items: Sequence[tuple[str, str]], fn: str, what: str, n: int) -> None:
    mine = np.stack([_digest(text) for _, text in items])
    # The count first: processes with different numbers of items would gather
    # arrays of different shapes, which deadlocks instead of failing.
    counts = _allgather(np.array([len(items)], np.int32)).reshape(-1)
    if len(set(counts.tolist())) > 1:
        raise ValueError(
            PROCESSES_DISAGREE.format(
                fn=fn,
                n=n,
                what=what or "the number of items checked",
                detail=f"  process i checks counts[i] items: {counts.tolist()}",
            )  # fmt: skip
        )
    every = _allgather(mine)  # [process, item, 2]
    # Every process sees the same gathered digests, so all take this branch together.
    differ = [i for i in range(len(items)) if len({every[p, i].tobytes() for p in range(n)}) > 1]
    if not differ:
        return
    lines = [_show(items[i][0], _gather_text(items[i][1]), n) for i in differ]
    names = ", ".join(items[i][0] for i in differ)
    raise ValueError(
        PROCESSES_DISAGREE.format(fn=fn, n=n, what=what or names, detail="\n".join(lines))
    )


def _gather_text(text: str) -> list[str]:
    """Every process's ``text`` (two all-gathers: the lengths, then the bytes)."""
    raw = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    longest = int(_allgather(np.array([raw.size], np.int32)).max())
    padded = np.full((longest,), -1, np.int32)
    padded[: raw.size] = raw
    every = _allgather(padded)
    return [bytes(row[row >= 0].astype(np.uint8).tolist()).decode() for row in every]


def _show(name: str, texts: list[str], n: int, context: int = 80) -> str:
    """The item as each group of processes holds it, from just before the first
    character where they differ."""
    first = min(
        next((k for k, (a, b) in enumerate(zip(t, texts[0], strict=False)) if a != b),
             min(len(t), len(texts[0])))
        for t in texts if t != texts[0]
    )  # fmt: skip
    start = max(0, first - context // 2)
    groups: dict[str, list[int]] = {}
    for p, t in enumerate(texts):
        groups.setdefault(t, []).append(p)
    shown = []
    for t, procs in groups.items():
        part = t[start : start + context]
        cut = ("..." if start else "") + part + ("..." if start + context < len(t) else "")
        shown.append(f"    process(es) {procs}: {cut}")
    return f"  {name}:\n" + "\n".join(shown)


def param_values(params: PyTree) -> list[tuple[str, str]]:
    """One item per param: its path and a hash of its local value (at ``init``,
    where each process holds its own copy)."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.sharding.is_fully_replicated:
                continue  # one global array already: nothing per process to compare
            data = np.asarray(x.addressable_shards[0].data)  # every process's own copy
        else:
            data = np.asarray(x)
        digest = hashlib.sha256(data.tobytes()).hexdigest()[:16]
        out.append((f"param {param_name(path)}", f"values with sha256 {digest}"))
    return out

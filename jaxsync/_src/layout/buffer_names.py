"""Buffer names of the portable optimizer state, and which saved entry a buffer reads.

The portable form of the distributed optimizer's state (``optim.portable``) keys
the inner optimizer state by :func:`buffer_name`: what decides the buffer, its
data axes' names among them (``float32.replica+data.all``). A run saved with
``axis_name=("replica", "data")`` and resumed with ``axis_name="data"`` (or the
reverse) holds the same params in buffers of other names. The names written stay
as they are (every checkpoint written so far restores); on read, a buffer takes
the entry of its own name, else the one entry whose name differs from its own only
in the data axes' part and which holds its params. Every other part of the name
(dtype, label, sum, mean, varying, stack, owned) must agree, so an expert-parallel
buffer, whose data axes differ from the dense params', never takes a dense
buffer's entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from ..core.names import param_name
from .layout import Layout

PyTree = Any

NO_ENTRY = (
    "the saved optimizer state has no entry for buffer {name!r} (params {params}): "
    "{found}. Saved entries: {saved}. Restore with the model, labels and rules the "
    "state was saved with (the data-parallel size and the data axes' names may differ)."
)


def buffer_name(layout: Layout, buffer: int) -> str:
    """Names a buffer by what decides it (dtype, axes, label, rules), never by its size."""
    key = layout.buffers[buffer].key
    parts = [key.dtype, "+".join(key.axes) or "none", key.label or "all"]
    if key.sum_axes:
        sums = [
            a if g is None else a + "_g" + "_".join("-".join(map(str, m)) for m in g)
            for a, g in key.sum_axes
        ]
        parts.append("sum-" + "+".join(sums))
    if key.mean_axes:
        parts.append("mean-" + "+".join(key.mean_axes))
    if key.varying:
        parts.append("varying-" + "+".join(key.varying))
    if key.stack:
        parts.append("stack-" + key.stack)
    if key.owned is not None:
        parts.append("owned")
    return ".".join(parts)


def same_but_axes(a: str, b: str) -> bool:
    """Two buffer names equal but for their data axes' part (the second)."""
    x, y = a.split(".", 2), b.split(".", 2)
    return len(x) == len(y) == 3 and x[0] == y[0] and x[2] == y[2]


def _keys(entry: PyTree) -> frozenset[str]:
    """Every dict key on the way to ``entry``'s leaves: the param names of its
    ``{param name: array}`` dicts (an owned buffer's ``{param name: state}``)."""
    return frozenset(
        k.key
        for path, _ in jax.tree_util.tree_flatten_with_path(entry)[0]
        for k in path
        if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)
    )


def saved_entry(
    inner: Mapping[str, Any], name: str, params: frozenset[str], every: frozenset[str]
) -> Any:
    """The saved entry of ``inner`` that buffer ``name`` (holding ``params``, of the
    model's ``every``) reads: its own name's, else the one entry of another data axes'
    name that holds all its params (or, for a state without per-param arrays, the one
    entry of such a name without any). Raises ValueError naming what was found."""
    if name in inner:
        return inner[name]

    def fits(k: str) -> bool:
        keys = _keys(inner[k])
        return not keys & every or params <= keys  # no per-param arrays: by name alone

    near = [k for k in inner if same_but_axes(k, name)]
    hits = [k for k in near if fits(k)]
    if len(hits) == 1:
        return inner[hits[0]]
    if hits:
        found = f"entries {hits} all hold them (ambiguous)"
    elif near:
        found = f"the entries {near} differ from it only in the data axes but lack its params"
    else:
        found = "no entry differs from its name only in the data axes"
    raise ValueError(
        NO_ENTRY.format(name=name, params=sorted(params), found=found, saved=sorted(inner))
    )


def _form(entry: PyTree) -> dict[str, tuple[int, ...]]:
    """Dotted leaf names and shapes (orbax's metadata and abstract trees alike)."""
    return {
        param_name(path): tuple(getattr(x, "shape", ()))
        for path, x in jax.tree_util.tree_flatten_with_path(entry)[0]
    }


def keyed_as_saved(like: dict[str, Any], saved: Any) -> dict[str, Any]:
    """``like`` (the abstract portable inner state of this layout) with each entry
    under the saved name it is read from: its own where saved, else the one saved
    entry of its form (leaf names, param names among them, and shapes) whose name
    differs only in the data axes' part. An entry without one keeps its name, so the
    comparison of the trees names it."""
    if not isinstance(saved, Mapping) or not isinstance(like, dict):
        return like
    taken = set(like) & set(saved)
    out = {}
    for name, entry in like.items():
        key = name
        if name not in saved:
            form = _form(entry)
            hits = [
                k
                for k in saved
                if k not in taken and same_but_axes(k, name) and _form(saved[k]) == form
            ]
            if len(hits) == 1:
                key = hits[0]
                taken.add(key)
        out[key] = entry
    return out

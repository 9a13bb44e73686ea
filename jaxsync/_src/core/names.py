"""Stable dotted names for parameters, and matching them against group prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

PyTree = Any


def param_name(path: tuple[Any, ...]) -> str:
    """``(DictKey('layer0'), DictKey('w'))`` -> ``"layer0.w"``: a stable, file-safe name."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts) or "root"


def in_group(name: str, prefix: str) -> bool:
    """Whether the dotted ``name`` is ``prefix`` or lies below it."""
    return name == prefix or name.startswith(prefix + ".")


def group_of(name: str, prefixes: Sequence[str]) -> str | None:
    """The longest of ``prefixes`` that ``name`` lies under, or None."""
    hits = [p for p in prefixes if in_group(name, p)]
    return max(hits, key=len) if hits else None


def group_trees(params: PyTree, stacked: Sequence[str]) -> dict[str, tuple[Any, list[str]]]:
    """Per stacked group: the treedef of its subtree and its leaves' full names."""
    out: dict[str, tuple[Any, list[str]]] = {}

    def grab(path: Any, sub: Any) -> Any:
        name = param_name(path)
        if name in stacked:
            rel = jax.tree_util.tree_flatten_with_path(sub)[0]
            names = [f"{name}.{param_name(p)}" if p else name for p, _ in rel]
            out[name] = (jax.tree.structure(sub), names)
        return sub

    jax.tree_util.tree_map_with_path(
        grab, params, is_leaf=lambda path, _: param_name(path) in stacked, is_leaf_takes_path=True
    )
    return out

"""Stable dotted names for parameters, and matching them against group prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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

"""A reader for protobuf text format, enough for XLA's dumps.

XLA writes its latency-hiding schedule (``*.schedule.txt``) as a text proto whose
schema (``xla.ScheduleProto``) is compiled into jaxlib but not exposed to Python.
Its grammar is small: ``name: scalar`` and ``name { ... }``, repeated fields
written once per element. We read it schema-less into :class:`Message`s.
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<open>\{)|(?P<close>\})|(?P<colon>:)'
    r"|(?P<comment>#[^\n]*)|(?P<word>[^\s{}:\"#]+))"
)
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "'": "'", "\\": "\\"}


class Message(dict):
    """One message: field name -> list of values (scalars or :class:`Message`s)."""

    def one(self, field: str, default: Any = None) -> Any:
        """The field's single (or last) value, or ``default``."""
        values = self.get(field)
        return values[-1] if values else default

    def all(self, field: str) -> list[Any]:
        """Every value of a repeated field (``[]`` if absent)."""
        return self.get(field, [])


def parse(text: str) -> Message:
    """Parses protobuf text format into nested :class:`Message`s.

    Scalars are ``int``, ``float`` or ``str`` (enum names stay strings).
    """
    root = Message()
    stack = [root]
    pending: str | None = None  # a field name waiting for its value
    pos, end = 0, len(text)
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise ValueError(f"unreadable text proto at offset {pos}: {text[pos : pos + 40]!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind in ("comment", "colon"):
            continue
        if kind == "open":
            if pending is None:
                raise ValueError(f"text proto: '{{' without a field name at offset {pos}")
            child = Message()
            stack[-1].setdefault(pending, []).append(child)
            stack.append(child)
            pending = None
        elif kind == "close":
            if len(stack) == 1:
                raise ValueError(f"text proto: unbalanced '}}' at offset {pos}")
            stack.pop()
        elif pending is None:
            pending = m.group(kind) if kind == "word" else _unquote(m.group(kind))
        else:
            value = _unquote(m.group(kind)) if kind == "str" else _scalar(m.group(kind))
            stack[-1].setdefault(pending, []).append(value)
            pending = None
    if len(stack) != 1:
        raise ValueError("text proto: unbalanced '{' at the end")
    return root


def _scalar(word: str) -> Any:
    try:
        return int(word)
    except ValueError:
        pass
    try:
        return float(word)
    except ValueError:
        return word


def _unquote(s: str) -> str:
    body = s[1:-1]
    if "\\" not in body:
        return body
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), body)

"""XLA compile options whose names changed between jaxlib releases.

jaxlib 0.11.1's XLA turned its three per-collective pipelining switches from
booleans (``xla_gpu_enable_pipelined_<collective>``) into one enum each
(``xla_gpu_pipeline_<collective>``: ``COLLECTIVE_PIPELINING_MODE_ON``, ``_OFF``,
...). A compile option XLA does not know fails every compile of the program that
carries it ("No such compile option"), on any platform, so jaxsync spells them
through here. ``XLA_FLAGS`` still takes the old boolean spelling.
"""

from __future__ import annotations

import os
import re
from functools import cache
from importlib.metadata import version
from typing import Any

#: The collectives XLA can pipeline across loop iterations.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@cache
def _enum_pipelining() -> bool:
    """Whether this jaxlib names pipelining by enum (0.11.1 on; 0.11.0 still by bool)."""
    parts = []
    for part in version("jaxlib").split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= (0, 11, 1)


def pipelined(collective: str, on: bool) -> dict[str, Any]:
    """The compile option that turns XLA's pipelining of ``collective`` on or off,
    spelled for the installed XLA: ``{name: value}``."""
    if collective not in COLLECTIVES:
        raise ValueError(f"pipelined: `collective` must be one of {COLLECTIVES}: {collective!r}")
    if _enum_pipelining():
        mode = "ON" if on else "OFF"
        return {f"xla_gpu_pipeline_{collective}": f"COLLECTIVE_PIPELINING_MODE_{mode}"}
    return {f"xla_gpu_enable_pipelined_{collective}": on}


def set_by_user(option: str) -> bool:
    """Whether ``XLA_FLAGS`` already decides ``option`` (a compile option's name; a
    pipelining option under either of its spellings): the user's choice wins."""
    spellings = [option]
    for collective in COLLECTIVES:
        pair = [f"xla_gpu_pipeline_{collective}", f"xla_gpu_enable_pipelined_{collective}"]
        if option in pair:
            spellings = pair
    user = os.environ.get("XLA_FLAGS", "")
    return any(re.search(rf"--{s}(=|\s|$)", user) for s in spellings)

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
from typing import Any

from jaxlib.version import __version_info__ as _JAXLIB

#: The collectives XLA can pipeline across loop iterations.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
#: jaxlib 0.11.1 on names pipelining by enum; 0.11.0 still by bool.
_ENUM_PIPELINING = tuple(_JAXLIB[:3]) >= (0, 11, 1)
_PIPELINING = re.compile(r"xla_gpu_(?:pipeline|enable_pipelined)_(\w+)")


def pipelined(collective: str, on: bool) -> dict[str, Any]:
    """The compile option that turns XLA's pipelining of ``collective`` on or off,
    spelled for the installed XLA: ``{name: value}``."""
    if collective not in COLLECTIVES:
        raise ValueError(f"pipelined: `collective` must be one of {COLLECTIVES}: {collective!r}")
    if _ENUM_PIPELINING:
        mode = "ON" if on else "OFF"
        return {f"xla_gpu_pipeline_{collective}": f"COLLECTIVE_PIPELINING_MODE_{mode}"}
    return {f"xla_gpu_enable_pipelined_{collective}": on}


def set_by_user(option: str) -> bool:
    """Whether ``XLA_FLAGS`` already decides ``option`` (a compile option's name; a
    pipelining option under either of its spellings): the user's choice wins."""
    spellings = [option]
    if (m := _PIPELINING.fullmatch(option)) and m.group(1) in COLLECTIVES:
        spellings = [f"xla_gpu_pipeline_{m.group(1)}", f"xla_gpu_enable_pipelined_{m.group(1)}"]
    user = os.environ.get("XLA_FLAGS", "")
    return any(re.search(rf"--{s}(=|\s|$)", user) for s in spellings)

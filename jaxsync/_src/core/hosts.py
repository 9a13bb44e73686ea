"""Which hosts a reduction spans: one host's NVLink domain, or the links between hosts.

Some choices pay only inside one host, where collectives are cheap beside the
compute: the all-to-all sum (``sync.collectives.wire_sum``), FSDP's halves
(``fsdp.gather.halves``) and FSDP's head gradient reduced before the backward loop
(``program.ready``). Across hosts the reductions set the pace of the layer loop
instead. Where a step traces its per-device program it names its concrete mesh
(:func:`traced_on`), whose devices say which process, so which host, each rank runs
in; a reduction traced without one (a user's own ``shard_map``) is judged by its size
alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import numpy as np

from .axes import axes_size
from .scoped import scoped

#: The most ranks a reduction may span and stay in one host's NVLink domain. XLA's
#: model of 64 x H100 over 8 hosts prices a 64-way all-to-all of 12 MiB at 2.6 ms
#: against 0.5 ms for the fp32 ring reduce-scatter (5.3x), and a host-then-hosts split
#: at 2.9 ms against 2.9 ms for 200 MiB (no gain).
ONE_HOST_RANKS = 8

_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxsync_traced_mesh", default=None)


def traced_on(mesh: Any) -> contextlib.AbstractContextManager[None]:
    """While a step traces its per-device program: the concrete ``mesh`` it runs on."""
    return scoped(_MESH, mesh)


def hosts_spanned(mesh: Any, axes: tuple[str, ...]) -> int:
    """The most processes (hosts) that one group of ``mesh``'s devices along ``axes``
    spans: 1 where each group runs in one process."""
    names = tuple(mesh.axis_names)
    inner = [names.index(a) for a in axes]
    outer = [i for i in range(len(names)) if i not in inner]
    devices = np.transpose(mesh.devices, outer + inner)
    groups = devices.reshape(-1, math.prod(mesh.devices.shape[i] for i in inner))
    return max(len({d.process_index for d in group}) for group in groups)


def across_hosts(mesh: Any, axes: tuple[str, ...]) -> bool:
    """Whether a reduction over ``axes`` of ``mesh`` leaves one host: more ranks than
    :data:`ONE_HOST_RANKS`, or ranks in more than one process."""
    size = math.prod(mesh.shape[a] for a in axes)
    return size > ONE_HOST_RANKS or hosts_spanned(mesh, axes) > 1


def in_one_host(axes: tuple[str, ...]) -> bool:
    """Whether a reduction over ``axes`` (more than one rank), traced now, stays in one
    host's NVLink domain: at most :data:`ONE_HOST_RANKS` ranks, all in one process of
    the mesh the step is traced on (:func:`traced_on`; by size alone without one)."""
    size, mesh = axes_size(axes), _MESH.get()
    if mesh is not None and all(a in mesh.axis_names for a in axes):
        return size > 1 and not across_hosts(mesh, axes)
    return 1 < size <= ONE_HOST_RANKS

"""Routing params to whole-matrix optimizers, and the ownership report as data.

:func:`muon_labels` is the default routing its authors prescribe for Muon:
hidden 2-D matrices to Muon; embeddings, the output head, norms and biases to
AdamW. :func:`ownership_report` says which rank owns which matrix and how
balanced the owners are, for a distributed optimizer, params and mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..core.names import group_of, param_name
from ..layout.placement import normalize_stacked, stack_layers
from .layerwise import owned_units

PyTree = Any

#: Name parts (lower-cased, substring match on each dotted component) that
#: mark embeddings and output heads, which Muon's authors leave to AdamW.
NOT_HIDDEN = ("embed", "wte", "wpe", "lm_head", "head", "unembed", "logits")


def muon_labels(
    params: PyTree,
    *,
    stacked: str | Sequence[str] | None = None,
    exclude: Sequence[str] = NOT_HIDDEN,
    matrix: str = "muon",
    other: str = "adamw",
) -> PyTree:
    """Labels for Muon: hidden matrices ``matrix``, everything else ``other``.

    A hidden matrix is a 2-D param (3-D ``[L, m, n]`` inside a ``stacked``
    group) whose dotted name has no component containing one of ``exclude``
    (embeddings and the output head). Norm scales, biases and other vectors go
    to ``other``.

    Example:
      >>> labels = jaxsync.muon_labels({"embed": e, "blocks": {"w": w3}, "head": h},
      ...                              stacked="blocks")
      {'embed': 'adamw', 'blocks': {'w': 'muon'}, 'head': 'adamw'}
    """
    groups = normalize_stacked(stacked)
    stack_layers(params, groups)  # a `stacked` name matching no group is a typo: say so
    lowered = tuple(e.lower() for e in exclude)

    def label(path: Any, x: Any) -> str:
        name = param_name(path)
        ndim = len(np.shape(x)) - (1 if group_of(name, groups) else 0)
        parts = name.lower().split(".")
        hidden = not any(e in part for part in parts for e in lowered)
        return matrix if ndim == 2 and hidden else other

    return jax.tree_util.tree_map_with_path(label, params)


@dataclasses.dataclass(frozen=True)
class OwnedMatrix:
    """One owned matrix: a param, or layer ``layer`` of a stacked one."""

    name: str
    layer: int | None
    shape: tuple[int, ...]
    cost: float
    owner: int


@dataclasses.dataclass(frozen=True)
class OwnershipReport:
    """Who owns what, and how balanced (one entry per owned buffer, merged).

    Attributes:
      matrices: every owned matrix with its estimated cost and owner.
      loads: per rank, the summed estimated cost of its matrices.
      elements: per rank, the parameter elements it owns (master and state scale
        with these).
      shard_elements: elements per rank's shard: the largest rank's, as every
        rank's shard is padded to it.
      imbalance: ``max(loads) / mean(loads)`` (1.0 is perfect; 0 if nothing is owned).
      memory_imbalance: ``shard_elements / mean(elements)``.
    """

    matrices: tuple[OwnedMatrix, ...]
    loads: tuple[float, ...]
    elements: tuple[int, ...]
    shard_elements: int
    imbalance: float
    memory_imbalance: float

    def summary(self) -> str:
        """A human-readable table (the library never prints it)."""
        lines = [
            f"{len(self.matrices)} owned matrices on {len(self.loads)} ranks; cost imbalance "
            f"{self.imbalance:.3f}, memory imbalance {self.memory_imbalance:.3f}"
        ]
        for r, (load, n) in enumerate(zip(self.loads, self.elements, strict=True)):
            mine = [m for m in self.matrices if m.owner == r]
            names = ", ".join(m.name + ("" if m.layer is None else f"[{m.layer}]") for m in mine)
            lines.append(f"  rank {r}: cost {load:.3g}, {n:,} elements: {names}")
        return "\n".join(lines)


def ownership_report(tx: Any, params: PyTree, mesh: Mesh) -> OwnershipReport:
    """The whole-matrix assignment of ``tx`` (a distributed optimizer) for ``params``.

    Example:
      >>> rep = jaxsync.ownership_report(tx, params, mesh)
      >>> rep.imbalance, rep.loads
    """
    layout = tx.layout(params, mesh)
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    plan = tx.__dict__["config"]
    matrices: list[OwnedMatrix] = []
    ranks = 0
    shard = 0
    for bi, buf in enumerate(layout.buffers):
        if buf.key.owned is None:
            continue
        whole = plan.transform_of(buf.key.label)
        ranks = max(ranks, buf.num_shards)
        shard += layout.shard_size(bi)
        for r, units in enumerate(owned_units(layout, bi)):
            for u in units:
                cost = whole.cost_of(u.shape)
                matrices.append(OwnedMatrix(names[u.slot], u.layer, u.shape, cost, r))
    loads = [0.0] * ranks
    elements = [0] * ranks
    for m in matrices:
        loads[m.owner] += m.cost
        elements[m.owner] += int(np.prod(m.shape))
    mean = sum(loads) / ranks if ranks else 0.0
    mean_el = sum(elements) / ranks if ranks else 0.0
    return OwnershipReport(
        matrices=tuple(matrices),
        loads=tuple(loads),
        elements=tuple(elements),
        shard_elements=shard,
        imbalance=max(loads) / mean if mean else 0.0,
        memory_imbalance=shard / mean_el if mean_el else 0.0,
    )

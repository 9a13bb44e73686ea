"""flax linen's boxed params inside the step: constrained only over axes the compiler places.

``TrainStep.init`` unboxes a linen model's ``nn.Partitioned`` params once
(:mod:`linen`), but some layers box again while the loss runs: flax checks each
existing param's shape by evaluating its initializer, and ``nn.DenseGeneral``'s
initializer unboxes the kernel it makes, applying ``with_sharding_constraint``
with its names (``("embed", "heads", "kv")``). Inside the step's ``shard_map`` the
data axes are manual and such names are not mesh axes at all, so a nanodo-style
model failed inside the step with ``Resource axis: embed ... is not found in mesh``.
While the loss is traced, :func:`box_constraints_on_free_axes` makes a box
constrain only over the mesh axes the compiler still places (a 2-D step's
``"model"``), and over none on a 1-D mesh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def _free_spec(spec: Any) -> P | None:
    """``spec`` with every name that is not a non-manual axis of the current mesh
    dropped; None when nothing is left to constrain."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    free = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if t != AxisType.Manual}  # fmt: skip

    def keep(entry: Any) -> Any:
        names = entry if isinstance(entry, tuple) else (entry,)
        return entry if entry is not None and all(n in free for n in names) else None

    kept = tuple(keep(e) for e in spec)
    return P(*kept) if any(e is not None for e in kept) else None


@contextlib.contextmanager
def box_constraints_on_free_axes() -> Iterator[None]:
    """While tracing a loss: linen's ``Partitioned`` boxes constrain only over the
    mesh's non-manual axes (a box given its own mesh is left as it is)."""
    try:
        from flax.core import meta
    except ImportError:  # no flax: nothing to scope
        yield
        return
    original = meta.Partitioned.unbox

    def unbox(self: Any, apply_constraint: bool = True) -> Any:
        if not apply_constraint or self.mesh is not None:
            return original(self, apply_constraint)
        spec = _free_spec(self.get_partition_spec())
        if spec is None:
            return self.value
        return jax.lax.with_sharding_constraint(self.value, spec)

    meta.Partitioned.unbox = unbox  # type: ignore[method-assign]
    try:
        yield
    finally:
        meta.Partitioned.unbox = original  # type: ignore[method-assign]

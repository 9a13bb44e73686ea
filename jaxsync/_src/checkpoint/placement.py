"""Where restored arrays land: the shardings a restore asks orbax for.

A restore "onto ``mesh``" must put every array there. A template made of the run's
own arrays carries their shardings, which may be a single device's (params built
on the host and never placed) or the old mesh's (the same process resuming on
fewer devices): read as they are, the params came back on one device or on the
old mesh, beside an optimizer state on the new one, and the next step refused the
mix of devices. Each template leaf's sharding is moved onto ``mesh`` instead: a
``NamedSharding`` keeps its ``PartitionSpec`` (a tensor-parallel split survives),
anything else is replicated, as a template without shardings always was.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.specs import spec_axes


def abstract_on(tree: Any, mesh: Mesh | None, what: str) -> Any:
    """``ShapeDtypeStruct``s of ``tree``'s leaves (arrays or ``ShapeDtypeStruct``s),
    sharded over ``mesh`` (None: as the leaves are); ``what`` names the tree in errors
    (``"params_like"``)."""

    def one(path: Any, x: Any) -> jax.ShapeDtypeStruct:
        s = getattr(x, "sharding", None)
        if mesh is not None:
            s = _onto(s, mesh, f"{what}{jax.tree_util.keystr(path)}")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree_util.tree_map_with_path(one, tree)


def _onto(s: Any, mesh: Mesh, name: str) -> NamedSharding:
    if not isinstance(s, NamedSharding):
        return NamedSharding(mesh, P())
    if s.mesh == mesh:
        return s
    missing = [a for a in spec_axes(s.spec) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"restore: {name} is sharded {s.spec} over mesh axes {missing} that the mesh "
            f"to restore onto does not have (it has {dict(mesh.shape)}). Pass "
            f"`{name.split('[')[0]}` as ShapeDtypeStructs sharded over that mesh."
        )
    return NamedSharding(mesh, s.spec)

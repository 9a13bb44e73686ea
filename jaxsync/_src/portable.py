"""A form of the sharded optimizer state that does not depend on the DP size.

On device the state is flat shards whose boundaries depend on the number of
ranks, the bucket size and the padding. On disk we want one array per parameter
(and per shard-shaped optimizer leaf), so a run saved on 8 ranks resumes on 4:
``to_portable`` maps shards -> per-parameter arrays and ``from_portable`` maps
them back onto whatever layout the new mesh gives. Both run as one jitted
program over the global arrays; XLA moves the data between devices (no host
gathers), and the per-parameter outputs stay sharded over the data axis where
their leading dimension allows, so orbax writes them from every host in parallel.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .layout import Layout

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


def buffer_name(layout: Layout, buffer: int) -> str:
    """Names a buffer by what decides it (dtype, axes, label), never by its size."""
    key = layout.buffers[buffer].key
    axes = "+".join(key.axes) or "none"
    return f"{key.dtype}.{axes}.{key.label or 'all'}"


def slot_names(layout: Layout, params: PyTree) -> list[str]:
    return [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _auto(mesh: Mesh) -> Mesh:
    # The conversion needs XLA to move data between devices freely (GSPMD), which
    # Explicit axes forbid; the same devices with Auto axes change nothing else.
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def param_sharding(mesh: Mesh, axes: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    spec = P(axes) if shape and shape[0] % n == 0 else P()
    return NamedSharding(mesh, spec)


def shards_to_params(
    layout: Layout, buffer: int, global_shards: jax.Array, names: list[str]
) -> dict[str, jax.Array]:
    """Global ``(N * shard,)`` array of one buffer -> ``{param name: array}``."""
    stacked = global_shards.reshape(layout.buffers[buffer].num_shards, -1)
    flat = layout.gather_shards(buffer, stacked)
    out = {}
    for si in layout.buffers[buffer].slots:
        slot = layout.slots[si]
        out[names[si]] = flat[slot.start : slot.end].reshape(slot.shape)
    return out


def params_to_shards(
    layout: Layout, buffer: int, arrays: dict[str, jax.Array], names: list[str]
) -> jax.Array:
    """Inverse of :func:`shards_to_params` for (possibly) another layout."""
    buf = layout.buffers[buffer]
    flat = jnp.zeros((buf.size,), next(iter(arrays.values())).dtype)
    for si in buf.slots:
        slot = layout.slots[si]
        flat = flat.at[slot.start : slot.end].set(jnp.ravel(arrays[names[si]]))
    parts = [flat[b.start : b.end].reshape(buf.num_shards, -1) for b in buf.buckets]
    return jnp.concatenate(parts, axis=1).reshape(-1)


def convert(fn: Any, args: Any, mesh: Mesh, out_shardings: Any) -> Any:
    """Runs ``fn(*args)`` jitted on an Auto-axes view of ``mesh``."""
    auto = _auto(mesh)
    args = jax.tree.map(
        lambda x: (
            jax.device_put(x, NamedSharding(auto, x.sharding.spec))
            if isinstance(getattr(x, "sharding", None), NamedSharding)
            else x
        ),
        args,
    )
    outs = jax.tree.map(
        lambda s: NamedSharding(auto, s.spec),
        out_shardings,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    result = jax.jit(fn, out_shardings=outs)(*args)
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s),
        result,
        out_shardings,
    )

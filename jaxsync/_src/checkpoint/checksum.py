"""Checksums of arrays, computed on their devices, the same for any sharding.

Orbax stores arrays as compressed chunks without a checksum of the values, and a
flipped byte in a chunk can decode to other numbers without any error (seen with
orbax-checkpoint 0.12). So :class:`~jaxsync.Checkpointer` stores a checksum of
every saved array and recomputes it after a restore.

The checksum is computed where the array lives, by a jitted program: each
element's bits are hashed together with its flat index (so swapped
elements count), and the hashes are summed in ``uint32``. Integer addition with
wrap-around is associative and commutative, so the result does not depend on
how the array is sharded or in which order XLA reduces: a state saved on 8
ranks checks out when restored on 2. On several hosts every process runs the
same program over the global arrays and gets the same two scalars, so no host
ever gathers a whole array; the cost is one read of each array on its devices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.cpu_order import settle
from ..optim.portable import param_name

PyTree = Any

# Two independent 32-bit sums make a 64-bit checksum.
_SEEDS = (0x9E3779B9, 0x7F4A7C15)


def _mix(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: every input bit changes about half the output bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as ``uint32`` words (a trailing axis for 64-bit types)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if size > 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    # Built from iotas instead of a reshape, so sharded arrays need no relayout.
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, d)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return index


def _checksum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    w = _words(x)
    index = _flat_index(w.shape)
    return tuple(
        jnp.sum(_mix(w ^ _mix(index + jnp.uint32(seed))), dtype=jnp.uint32) for seed in _SEEDS
    )


# One program per shape, dtype and sharding (jit's own cache): a model's arrays
# share few of those (a param, its master copy and Adam's moments are one), and
# XLA:CPU compiles many small programs faster than one that holds every array.
_checksum_jit = jax.jit(_checksum)


def tree_checksums(tree: PyTree) -> dict[str, str]:
    """``{dotted name: 16 hex digits}`` for every array leaf of ``tree``.

    Names are those of :func:`jaxsync.param_name` (``params.layer0.w``). Arrays
    on different sets of devices are checked by one program per set. Typed PRNG
    keys are checked through their key data.
    """
    pending = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        elif not isinstance(leaf, jax.Array):
            leaf = np.asarray(leaf)
        # All dispatched first (on CPU meshes one at a time: cpu_order).
        pending.append((param_name(path), settle(_checksum_jit(leaf))))
    out = {}
    for name, sums in pending:
        # Scalars are replicated on every device (and process): read one copy.
        a, b = (int(np.asarray(s.addressable_data(0))) for s in sums)
        out[name] = f"{a:08x}{b:08x}"
    return out

"""A 32-bit fingerprint of an array's bits, computed on its device.

What the integrity checks compare instead of whole arrays: the replica check
(copies that should be equal) and a deterministic step's per-unit gradient record
(a unit's gradient is the same bits wherever and whenever it is computed). Each
element's bits are weighted by an odd number that depends on its position and
summed modulo 2**32, so any single flipped bit changes the sum; one read of the
array, no host transfer but the 4 bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative hash constant (odd)


def as_bits(x: jax.Array) -> jax.Array:
    """``x``'s bits as uint32 words (a key's data; an 8-byte element as two words)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # two words per element
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def fingerprint(x: jax.Array) -> jax.Array:
    """A uint32 of ``x``'s bits: each element's bits times an odd weight of its
    position, summed modulo 2**32, so one flipped bit always changes it."""
    bits = as_bits(x)
    flat = bits.reshape(-1)
    weights = jax.lax.iota(jnp.uint32, flat.size) * _GOLDEN + jnp.uint32(1)
    return jnp.sum(flat * (weights | jnp.uint32(1)), dtype=jnp.uint32)

"""Exact, order-independent sums of floats across devices, with int32 limbs.

A float sum depends on its order, and the order of a data-parallel reduction
depends on the number of ranks. Integer sums do not. So every value is first
put in fixed point, on a grid shared by all devices: per element, the largest
binary exponent any device holds there (one ``pmax`` of int8 codes; exact).
Each value then becomes an integer ``q = round(x * 2**(P - E))`` with ``|q| <=
2**P``, split into int32 limbs with headroom, summed exactly and in any order by
``psum``/``psum_scatter``, and turned back into one float at the end.

Why these numbers: ``P = 40`` keeps 16 bits more than fp32's 24-bit significand
of the largest addend, so the quantisation error (at most ``2**(E-41)`` per
addend) is far below the fp32 rounding of the result; two 20-bit limbs leave 10
bits of headroom, enough for 1024 addends per element in int32. The value
code 127 marks NaN/Inf (and |x| >= 2**126, which the grid cannot hold): it wins
every ``pmax``, so a non-finite addend anywhere makes that element NaN
everywhere, as it would in a float sum.

Everything here is elementwise or an integer reduction, so the result is the
same bits whatever the number of devices, the shard boundaries or the order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

P_BITS = 40  # fixed-point precision of the largest addend of an element
LIMB = 20  # bits per limb (two limbs: P_BITS = 2 * LIMB)
MAX_ADDENDS = 2 ** (31 - LIMB - 1)  # sums of this many limbs stay below 2**30
NONFINITE = 127  # exponent code of NaN/Inf/overflow; wins every pmax
MIN_CODE = -126  # zeros and tiny values (below the smallest normal fp32)
TOTAL_BITS = 48  # precision of `exact_total`'s largest addend (16-bit limbs x 3)
_CHUNK = 2**14  # addends summed per int32 before carries are normalised


def pow2(k: jax.Array) -> jax.Array:
    """``2.0 ** k`` in fp32, exactly, for int32 ``k`` in ``[-126, 127]`` (from bits)."""
    bits = (k.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def scale_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2**k`` for ``k`` in ``[-252, 254]``: two exact power-of-two factors."""
    k1 = k >> 1
    return (x * pow2(k1)) * pow2(k - k1)


def exponent_codes(x: jax.Array) -> jax.Array:
    """Per element, an int8 ``e`` with ``|x| < 2**e`` (NaN/Inf/huge: ``NONFINITE``)."""
    x = x.astype(jnp.float32)
    _, e = jnp.frexp(x)
    e = jnp.where(x == 0, MIN_CODE, jnp.maximum(e, MIN_CODE))
    bad = jnp.logical_not(jnp.isfinite(x)) | (e >= NONFINITE)
    return jnp.where(bad, NONFINITE, e).astype(jnp.int8)


def to_limbs(x: jax.Array, code: jax.Array) -> jax.Array:
    """``x`` on the grid of ``code`` (shared exponents) as ``[2, ...]`` int32 limbs.

    ``hi`` is signed (``|hi| <= 2**20``), ``lo`` is in ``[0, 2**20)``; every step
    is exact in fp32 (power-of-two scaling, ``round``, ``floor``, aligned subtraction).
    """
    e = code.astype(jnp.int32)
    x = jnp.where(e == NONFINITE, 0.0, x.astype(jnp.float32))
    q = jnp.round(scale_pow2(x, P_BITS - e))
    hi = jnp.floor(q * (2.0**-LIMB))
    lo = q - hi * (2.0**LIMB)
    return jnp.stack([hi.astype(jnp.int32), lo.astype(jnp.int32)])


def from_limbs(limbs: jax.Array, code: jax.Array) -> jax.Array:
    """Inverse of :func:`to_limbs` applied to sums of limbs: one fp32 per element.

    The carry of ``lo`` moves into ``hi`` first; ``hi`` converts exactly for up to
    16 addends, then ``hi * 2**20 + lo`` rounds once (correctly, for 16 addends).
    """
    hi, lo = limbs[0], limbs[1]
    hi = hi + (lo >> LIMB)
    lo = lo & (2**LIMB - 1)
    val = hi.astype(jnp.float32) * (2.0**LIMB) + lo.astype(jnp.float32)
    e = code.astype(jnp.int32)
    val = scale_pow2(val, e - P_BITS)
    return jnp.where(e == NONFINITE, jnp.nan, val)


def shared_codes(units: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Per element, the largest exponent code over the ``[k, ...]`` units of every device."""
    return jax.lax.pmax(jnp.max(exponent_codes(units), axis=0), axes)


def unit_sum(
    units: jax.Array, axes: tuple[str, ...], *, scatter: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Exact sum over the leading (unit) axis of ``units`` on all devices of ``axes``.

    Args:
      units: ``[k, n]`` this device's units (any float dtype).
      axes: the mesh axes to sum over.
      scatter: reduce-scatter along the last axis (``n`` divisible by the axes'
        size) instead of all-reduce.

    Returns:
      ``(sum, codes)``: the fp32 sum (``[n]``, or this rank's ``[n / size]`` piece)
      and the int8 exponent codes of the whole ``[n]`` (for the caller's slicing).
    """
    codes = shared_codes(units, axes)
    limbs = jnp.sum(to_limbs(units, codes[None]), axis=1)  # [2, n], exact
    if scatter:
        limbs = jax.lax.psum_scatter(limbs, axes, scatter_dimension=1, tiled=True)
        k = limbs.shape[1]
        mine = jax.lax.dynamic_slice_in_dim(codes, jax.lax.axis_index(axes) * k, k)
        return from_limbs(limbs, mine), codes
    return from_limbs(jax.lax.psum(limbs, axes), codes), codes


# ------------------------------------------------------------ long exact sums
def _normalise(s: jax.Array) -> jax.Array:
    """Carries of ``[4, ...]`` limb sums: limbs 0-2 back in ``[0, 2**16)``."""
    out, carry = [], 0
    for i in range(3):
        t = s[i] + carry
        out.append(t & 0xFFFF)
        carry = t >> 16
    out.append(s[3] + carry)
    return jnp.stack(out)


def _sum_limbs(limbs: jax.Array) -> jax.Array:
    """``[4, n]`` normalised limbs -> ``[4]``: int32 chunk sums, carries between."""
    while limbs.shape[1] > 1:
        n = limbs.shape[1]
        c = min(_CHUNK, n)
        pad = -n % c
        if pad:
            limbs = jnp.pad(limbs, ((0, 0), (0, pad)))
        limbs = _normalise(jnp.sum(limbs.reshape(4, -1, c), axis=2))
    return limbs[:, 0]


def exact_total(values: list[jax.Array], axes: tuple[str, ...]) -> jax.Array:
    """The exact (then once-rounded) fp32 sum of all elements of ``values`` on every
    device of ``axes``, the same bits however the elements are split across devices.

    For the global norm's sum of squares, whose shard boundaries move with the
    number of ranks. One scalar ``pmax`` and one ``psum`` of four int32s. Addends
    are put on a 48-bit grid below the largest one (error at most ``2**-49`` of
    it per addend), summed in 16-bit limbs with the carries in a fourth limb.
    """
    flat = [v.reshape(-1).astype(jnp.float32) for v in values]
    local = jnp.max(jnp.stack([jnp.max(exponent_codes(v)) for v in flat]))
    code = jax.lax.pmax(local.astype(jnp.int32), axes)
    partial = []
    for v in flat:
        x = jnp.where(code == NONFINITE, 0.0, v)
        q = jnp.round(scale_pow2(x, TOTAL_BITS - code))  # |q| <= 2**48
        sign = jnp.where(q < 0, -1, 1).astype(jnp.int32)
        q = jnp.abs(q)
        l2 = jnp.floor(q * 2.0**-32)
        r = q - l2 * 2.0**32
        l1 = jnp.floor(r * 2.0**-16)
        l0 = r - l1 * 2.0**16
        limbs = jnp.stack([l0, l1, l2, jnp.zeros_like(l0)]).astype(jnp.int32) * sign
        # Signed limbs normalise fine: `&` and `>>` are floor-mod and floor-div.
        partial.append(_sum_limbs(limbs))
    limbs = _normalise(jax.lax.psum(_normalise(sum(partial)), axes))
    # Each limb times its weight is an exact fp32; adding them with error-free
    # TwoSum steps (Neumaier) rounds the exact integer to fp32 about once.
    f = limbs.astype(jnp.float32)
    val, err = f[3] * 2.0**48, jnp.float32(0)
    for t in (f[2] * 2.0**32, f[1] * 2.0**16, f[0]):
        s = val + t
        bp = s - val
        err = err + ((val - (s - bp)) + (t - bp))
        val = s
    val = scale_pow2(val + err, code - TOTAL_BITS)
    return jnp.where(code == NONFINITE, jnp.nan, val)

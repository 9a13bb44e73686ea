"""A layer rematerialised inside a scan needs no CSE barrier; the gradient drops it.

``jax.checkpoint`` (``prevent_cse=True``, its default) puts the inputs of the
forward it recomputes in the backward behind an ``optimization_barrier``, so that
XLA cannot merge the recomputation with the forward's own values. Inside a scan the
two run in different loops and there is nothing to merge: JAX's own documentation
of ``jax.checkpoint`` says the barrier can go there (``prevent_cse=False``), and
MaxText drops it for its scanned layers. Kept, it costs time on a mesh: it walls a
layer's params off from XLA's collective pipeliner, so the backward cannot start
gathering the next layer (FSDP; ZeRO with ``reshard_after_forward``) in the
iteration before, and each layer's gather runs exposed (bench_gpu, XLA's timeline:
FSDP on 64 x H100, Llama-style 7.2B, 490.6 -> 414.9 ms per step without it, for one
more gathered layer in flight: 7073 -> 7388 MiB per GPU). :func:`drop_loop_barriers`
turns the barrier off for every remat inside a scan's body; a remat outside any scan
keeps the user's choice. No value changes: the barrier only forbids an optimization.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from ..core.jaxpr_compat import REMAT, rewrite_programs

_SCAN = jcore.primitives.scan_p


def drop_loop_barriers(closed: Any) -> Any:
    """``closed`` with ``prevent_cse=False`` on every remat equation inside a scan
    body (at any depth); ``closed`` itself where there is none."""
    jaxpr, changed = _drop(closed.jaxpr, in_loop=False)
    return jcore.ClosedJaxpr(jaxpr, closed.consts) if changed else closed


def _drop(jaxpr: Any, in_loop: bool) -> tuple[Any, bool]:
    eqns, changed = [], False
    for e in jaxpr.eqns:
        inner = in_loop or e.primitive is _SCAN
        params, hit = rewrite_programs(e, lambda j, inner=inner: _drop(j, inner))
        if in_loop and e.primitive.name in REMAT and params.get("prevent_cse"):
            params["prevent_cse"], hit = False, True
        eqns.append(e.replace(params=params) if hit else e)
        changed |= hit
    return (jaxpr.replace(eqns=eqns) if changed else jaxpr), changed

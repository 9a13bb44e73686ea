"""Reductions ready before the backward loop run beside its first layer.

A gradient made before the backward loop, the LM head's, is reduced where XLA's
scheduler puts it: after the loop, beside the last layer's reduction, where nothing
is left to hide it behind. Across hosts (where :mod:`ready` ties only the head's
matmul to the loop, since its reduction before the loop ran exposed) that keeps the
bf16 gradient live across the whole loop and leaves its reduce-scatter exposed at
the end: 64 x H100, ``bench_gpu``'s Llama-style 7.2B under FSDP, 250 MiB held at the
loop's peak and 3.5 ms exposed.

Once :mod:`grad_rows` has peeled the backward's first layer out of the loop, that
layer is a place for them: no reduction of the loop's runs there yet. The chains
that :func:`ready_reductions` finds (each reduction over the loop's axes that does
not wait for the loop, and what packs its input after the loop) move before the
loop, and the rewritten loop starts only once they are reduced, so they run beside
its first layer. A pack larger than what the loop holds for it is reduced in column
pieces that are not (:func:`_in_pieces`). 64 x H100 (FSDP, args + temps per GPU): the
7.2B 6733 -> 6458 MiB; Llama-3-8B's shape, in 3 pieces, 7626 -> 6623 (89.1% -> 89.7% of
the communication bound); 16 x H100, the 1.1B 4538 -> 4397.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from .reach import back_through, collective_axes, downstream, nbytes, run_eqns, upstream
from .ready import RESHAPES

#: Collectives that reduce a gradient.
REDUCTIONS = {"reduce_scatter", "psum", "all_to_all"}
#: The most pieces a pack larger than the loop's room is reduced in (:func:`_in_pieces`).
MAX_PIECES = 8
#: Ops XLA fuses into their reader, so their operand is what waits: casts, layout
#: changes (:data:`ready.RESHAPES`), pads and broadcasts.
_FUSED = RESHAPES | {"pad", "broadcast_in_dim"}


def ready_reductions(jaxpr: Any, at: int, axes: set, room: int) -> tuple[list, list, list]:
    """What follows ``jaxpr``'s backward loop (its equation ``at``), in two: the
    equations to run before it and those that stay after it, each in order; and the
    reduced values the loop's first layer is to wait for.

    A reduction is taken with the chain that packs its input (the equations after the
    loop it is computed from) when it runs over ``axes`` alone, does not wait for the
    loop, and no equation of its chain has an effect to keep in order; and when its
    chain makes no value larger than what the loop holds for it: ``room`` bytes (what
    each layer of the loop holds for its own reduction) and the chain's inputs, which
    the loop no longer holds once the chain has run. A chain whose pack alone outweighs
    that is reduced in pieces that fit (:func:`_in_pieces`), at most :data:`MAX_PIECES`.
    """
    eqns = jaxpr.eqns[at + 1 :]
    late = downstream(eqns, jaxpr.eqns[at].outvars)
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    after = {v: e for e in eqns for v in e.outvars}  # what a chain is made of
    args = {*jaxpr.invars, *jaxpr.constvars}
    order = {id(e): k for k, e in enumerate(eqns)}
    early: dict = {}
    taken: set = set()
    tied: list = []
    for e in eqns:
        if e.primitive.name not in REDUCTIONS or not set(collective_axes(e)) <= axes:
            continue
        if any(v in late for v in e.outvars):
            continue
        feeds = upstream(after, e.invars)
        chain = [f for f in eqns if f is e or any(v in feeds for v in f.outvars)]
        if any(f.effects and any(type(x).__name__ != "NamedAxisEffect" for x in f.effects)
               for f in chain):  # fmt: skip
            continue
        if any(id(f) in taken for f in chain):
            continue  # shares its pack with a reduction already taken
        outs = {v for f in chain for v in f.outvars}
        inputs = {v for f in chain for v in f.invars if isinstance(v, jcore.Var)} - outs
        held = sum(_held(v, made, args) for v in inputs)
        largest = max(nbytes(v.aval) for v in outs)
        if largest > room + held:
            pieces = -(-largest // max(room, 1))
            if pieces > MAX_PIECES or not _splits(e):
                continue
            taken.update(id(f) for f in chain)
            call = _in_pieces(chain, e, inputs, pieces)
            order[id(call)] = order[id(e)]
            chain = [call]
        taken.update(id(f) for f in chain)
        early.update((id(f), f) for f in chain)
        tied.extend(e.outvars)
    ahead = sorted(early.values(), key=lambda f: order[id(f)])
    return ahead, [e for e in eqns if id(e) not in taken], tied


def _splits(e: Any) -> bool:
    """Whether reduce-scatter ``e`` can run in column pieces: tiled, over one flat array."""
    flat = e.invars[0].aval.ndim == 1 and e.params.get("axis_index_groups") is None
    return e.primitive.name == "reduce_scatter" and bool(e.params.get("tiled")) and flat


def _in_pieces(chain: list, e: Any, inputs: set, pieces: int) -> Any:
    """One equation for ``chain`` (ending in the reduce-scatter ``e``) that reduces its
    pack in ``pieces`` column pieces.

    A tiled reduce-scatter hands rank ``r`` the ``r``-th of ``n`` equal rows of the pack;
    the same columns of every row, reduced on their own, are the same columns of each
    rank's shard, so the pieces' shards side by side are the shard, exactly. XLA makes
    each piece's columns in the fusion that feeds its reduce-scatter, and its scheduler,
    one collective in flight, makes each piece as its turn comes: the fp32 pack is never
    whole (Llama-3-8B's shape, 64 x H100: 3 pieces, 1003 MiB less at the step's peak).
    A barrier between the pieces, to order them, made XLA copy the inputs at each one
    (+4.2 GB of kernel bytes there) and held no less.
    """
    ins = sorted(inputs, key=str)
    size = e.invars[0].aval.shape[0]
    n = size // e.outvars[0].aval.shape[0]
    cuts = [size // n * j // pieces for j in range(pieces + 1)]

    def run(*vals: Any) -> Any:
        pack = run_eqns(chain[:-1], dict(zip(ins, vals, strict=True)), e.invars)[0]
        rows = pack.reshape(n, -1)
        return jnp.concatenate([run_eqns([e], {e.invars[0]: rows[:, a:b].reshape(-1)}, e.outvars)[0]
                                for a, b in itertools.pairwise(cuts)])  # fmt: skip

    closed = jax.make_jaxpr(run)(*[v.aval for v in ins])
    return jcore.new_jaxpr_eqn(ins, list(e.outvars), jcore.primitives.closed_call_p,
                               {"call_jaxpr": closed}, closed.effects, e.source_info)  # fmt: skip


def _held(v: Any, made: dict, args: set) -> int:
    """The bytes value ``v`` holds while it waits: none for an argument (held anyway),
    else the narrowest value on its way from a layout change, a cast or a pad (XLA fuses
    them into their reader: a small gradient padded into a unit's pack is held small)."""
    way = back_through(v, made, _FUSED)
    return 0 if way[-1] in args else min(nbytes(x.aval) for x in way)

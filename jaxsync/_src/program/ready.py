"""The backward layer loop's start: gradients ready before it are computed first.

The LM head's weight gradient needs only the logits' cotangent and the last hidden
state, both ready before the backward loop runs; so does a final norm's. XLA's
scheduler is free to compute them anywhere, and it places them late, next to what
reads them (the reduction after the loop), which keeps their inputs live across the
whole loop: the logits' cotangent ``bf16[4,2048,32000]`` (500 MiB on the Llama-style
1.1B model of ``bench_gpu``, 4 x 2048 tokens per GPU) where the gradient itself is a
quarter of that. :func:`ready_first` ties each such gradient to the loop's input
with an ``optimization_barrier``, so the loop cannot start before it is computed;
its inputs then die before the loop. Only a gradient made by a matmul whose inputs
(those not already held as the program's arguments) are larger than it is tied: one
that would hold more than it frees is left where XLA puts it. An FSDP unit's gradient
leaves the program reduce-scattered from a pack of its params' gradients. In one host
(``core.hosts.in_one_host``) the reduced shard is tied: the matmul, its pack and the
reduce-scatter run before the loop, and only the fp32 shard, a quarter of the bf16
gradient at 8 ranks, is held across it (8 x H100, ``bench_gpu``: Llama-style 1.1B
5433 -> 5339 MiB per GPU, GPT 1.2B 5219 -> 5060, Llama-3.2-1B's shape 8264 -> 7904;
XLA's timeline +0.5%, +0.8%, +0.7%). Across hosts, where the reductions set the
backward loop's pace, the matmul's own result is tied and the pack and reduction follow
it (Llama-style 1.1B, 8 x H100: 6400 -> 6099 MiB per GPU, timeline 144.4 -> 145.3 ms):
the reduction before the loop runs exposed there (64 x H100, 7.2B: 7104 -> 6797 MiB,
410.2 -> 413.4 ms, below 93% of the bound); where :mod:`grad_rows` rewrites the loop,
:mod:`beside` then runs it beside the loop's first layer.
A gradient the program hands out wider than its matmul made it (fp32 params with a
bf16 model: the cast's transpose) is held in the matmul's dtype and widened after
the loop (8 x H100, DDP: Llama-style 1.1B 17203 -> 17076 MiB; Llama-3.2-1B's shape,
a 128256-token head, 24806 -> 24375 MiB under XLA's default GPU options).
No value changes.

The converse holds at the loop's other side: what the backward loop recomputes from
the saved activations is not needed before the cotangent it starts from, and computed
earlier it sits on the loss's own peak (:func:`recompute_late`).
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from ..core.axes import aval_varying_axes
from ..core.hosts import in_one_host
from ..core.jaxpr_compat import barrier_eqn, scan_num_carry, scan_num_consts
from .reach import SHAPE_ONLY, back_through, collective_axes, downstream, nbytes, upstream
from .sink import RETYPES

_SCAN = jcore.primitives.scan_p
#: Ops a gradient may pass through between its matmul and the program's output: the
#: conversions a broadcast may pass through (:data:`sink.RETYPES`) and layout changes.
RESHAPES = RETYPES | {"transpose"} | SHAPE_ONLY
#: ... and the ops that pack gradients into a unit's flat array and reduce it there
#: (a reduce-scatter, or an all-to-all and the sum of what it brought:
#: ``sync.collectives.scatter_wire_sum``).
_REDUCTIONS = {"reduce_scatter", "all_to_all"}
_PACKS = RESHAPES | {"pad", "add_any", "concatenate", "slice", "mul"} | _REDUCTIONS


def ready_first(closed: Any) -> Any:
    """``closed`` (a differentiated program's ``ClosedJaxpr``) with the gradients that
    are ready before its first backward loop (a reverse scan in its own jaxpr) tied to
    that loop's input; ``closed`` itself where there is nothing to tie, or where an
    equation has an effect other than naming a mesh axis (their order is kept)."""
    jaxpr = closed.jaxpr
    at = _backward_loop(jaxpr)
    if at is None:
        return closed
    loop = jaxpr.eqns[at]
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    after = downstream(jaxpr.eqns, loop.outvars)  # what waits for the loop
    candidates = _ready_gradients(jaxpr, made, after, upstream(made, loop.invars))
    derived = downstream(jaxpr.eqns, candidates, strict=True)
    ready = [v for v in candidates if v not in derived]
    invars, barriers, swap = list(loop.invars), [], {}
    for k, group in _ties(loop, ready):
        barrier, tied = _tie([*group, invars[k]], loop)
        barriers.append(barrier)
        invars[k] = tied[-1]
        swap.update(zip(group, tied[:-1], strict=True))
    if not barriers:
        return closed
    # after the barriers: the loop, what reads its results, and what reads a tied value
    waits = downstream(jaxpr.eqns, [*after, *swap])
    late = [e is loop or any(isinstance(v, jcore.Var) and v in waits for v in e.invars)
            for e in jaxpr.eqns]  # fmt: skip
    before = [e for e, x in zip(jaxpr.eqns, late, strict=True) if not x]
    rest = [e.replace(invars=invars) if e is loop else _swapped(e, swap)
            for e, x in zip(jaxpr.eqns, late, strict=True) if x]  # fmt: skip
    outvars = [swap.get(v, v) if isinstance(v, jcore.Var) else v for v in jaxpr.outvars]
    return jcore.ClosedJaxpr(
        jaxpr.replace(eqns=[*before, *barriers, *rest], outvars=outvars), closed.consts
    )


def recompute_late(closed: Any) -> Any:
    """``closed`` with the activations its first backward loop reads (those computed
    from a forward loop's results) tied to the cotangent that loop starts from; ``closed``
    itself where there is nothing to tie.

    XLA's collective pipeliner peels the backward loop's first iteration out of the
    loop, and the scheduler then runs that layer's recomputed forward (its attention
    scores) beside the loss's own backward: the two largest temporaries of the step live
    at once. Tied, the recompute waits for the cotangent, which the loss's backward
    makes (8 x H100, FSDP: Llama-style 1.1B 6062 -> 5955 MiB per GPU, GPT 1.2B 5664 ->
    5572, Llama-3.2-3B's shape 11991 -> 10958; XLA's timeline within 0.3%, kernel bytes
    the same; measured before FSDP reduced its head's gradient before the loop in one
    host, which leaves the loss's backward off the peak: now the same MiB either way
    there). Params the loop reads straight from the program's arguments (a shard to
    gather, a cast) stay free to be fetched early. No value changes."""
    jaxpr = closed.jaxpr
    at = _backward_loop(jaxpr)
    if at is None:
        return closed
    loop = jaxpr.eqns[at]
    forward = [v for e in jaxpr.eqns[:at]
               if e.primitive is _SCAN and not e.params["reverse"] for v in e.outvars]  # fmt: skip
    computed = downstream(jaxpr.eqns, forward)
    first = scan_num_consts(loop)
    carried = range(first, first + scan_num_carry(loop))
    invars = list(loop.invars)
    saved = [k for k, v in enumerate(invars) if isinstance(v, jcore.Var) and v in computed]
    barriers = []
    for vma in {_vma(invars[k]) for k in saved if k in carried}:
        group = [k for k in saved if _vma(invars[k]) == vma]
        if all(k in carried for k in group):  # no activation of this type to hold
            continue
        barrier, tied = _tie([invars[k] for k in group], loop)
        barriers.append(barrier)
        invars = [tied[group.index(k)] if k in group else v for k, v in enumerate(invars)]
    if not barriers:
        return closed
    eqns = [*jaxpr.eqns[:at], *barriers, loop.replace(invars=invars), *jaxpr.eqns[at + 1 :]]
    return jcore.ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def _backward_loop(jaxpr: Any) -> int | None:
    """Where ``jaxpr``'s first backward loop (a reverse scan) is; None where it has
    none, or where an equation has an effect other than naming a mesh axis (their
    order is kept)."""
    if any(type(f).__name__ != "NamedAxisEffect" for e in jaxpr.eqns for f in e.effects):
        return None
    return next((i for i, e in enumerate(jaxpr.eqns)
                 if e.primitive is _SCAN and e.params["reverse"]), None)  # fmt: skip


def _tie(held: list, loop: Any) -> tuple[Any, list]:
    """An ``optimization_barrier`` over ``held``, and the values it gives back."""
    return barrier_eqn(held, loop.source_info)


def _swapped(e: Any, swap: dict) -> Any:
    if not any(isinstance(v, jcore.Var) and v in swap for v in e.invars):
        return e
    return e.replace(invars=[swap.get(v, v) if isinstance(v, jcore.Var) else v for v in e.invars])


def _ties(loop: Any, ready: list) -> list[tuple[int, list]]:
    """Each group of ``ready`` with the loop operand it is tied to: a carried or scanned
    value (not a literal) of the same device-varying axes (``shard_map``'s types: an
    optimization barrier's operands must agree on them)."""
    operands = {}
    for k in range(scan_num_consts(loop), len(loop.invars)):
        v = loop.invars[k]
        if isinstance(v, jcore.Var):
            operands.setdefault(_vma(v), k)
    groups: dict[Any, list] = {}
    for v in ready:
        if _vma(v) in operands:
            groups.setdefault(_vma(v), []).append(v)
    return [(operands[g], vs) for g, vs in groups.items()]


def _vma(v: Any) -> frozenset:
    return aval_varying_axes(v.aval)


def _ready_gradients(jaxpr: Any, made: dict, after: set, feeding: set) -> list:
    """Values to compute before the loop: each program result that does not wait for
    it and is made by a matmul (through layout changes) whose inputs, other than the
    program's arguments, outweigh it; else each such matmul's own result, found
    through the packing and reduction that follow it (an FSDP unit's gradient,
    reduce-scattered from a pack of its params' gradients)."""
    args = set(jaxpr.invars) | set(jaxpr.constvars)

    def outweighs(dot: Any, v: Any) -> bool:
        inputs = [x for x in dot.invars if isinstance(x, jcore.Var) and x not in args]
        return sum(nbytes(x.aval) for x in inputs) > nbytes(v.aval)

    ready: list = []
    for out in jaxpr.outvars:
        if not isinstance(out, jcore.Var) or out in after or out in args or out in ready:
            continue
        if out in feeding:  # computed before the loop anyway
            continue
        chain = back_through(out, made, RESHAPES)
        v = chain[-1]
        dot = made.get(v)
        if dot is not None and dot.primitive.name == "dot_general":
            # the narrowest value on the way (a bf16 gradient the program hands out in
            # fp32 is held across the loop in bf16, and widened after it)
            held = min(chain, key=lambda x: nbytes(x.aval))
            if outweighs(dot, held) and held not in feeding:
                ready.append(held)
            continue
        dots, reductions = _packed_behind(out, made, args)
        dots = [r for r in dots if r not in feeding and r not in ready and outweighs(made[r], r)]
        if dots and reductions and all(in_one_host(a) for a in reductions):
            ready.append(out)  # reduced before the loop too: its pack dies there
        else:
            ready.extend(dots)
    return ready


def _packed_behind(out: Any, made: dict, args: set) -> tuple[list, list]:
    """The results of the matmuls ``out`` is packed and reduced from (through
    :data:`_PACKS`), and the mesh axes of each reduction on the way."""
    found, axes, seen, todo = [], [], set(), [out]
    while todo:
        v = todo.pop()
        if v in seen or v in args or v not in made:
            continue
        seen.add(v)
        e = made[v]
        if e.primitive.name == "dot_general":
            found.append(v)
        elif e.primitive.name in _PACKS or _sums_all_to_all(e, made):
            if e.primitive.name in _REDUCTIONS:
                axes.append(collective_axes(e))
            todo.extend(x for x in e.invars if isinstance(x, jcore.Var))
    return found, axes


def _sums_all_to_all(e: Any, made: dict) -> bool:
    """Whether ``e`` sums what an all-to-all brought (through type and layout changes)."""
    if e.primitive.name != "reduce_sum":
        return False
    if not isinstance(e.invars[0], jcore.Var):
        return False
    v = back_through(e.invars[0], made, RESHAPES)[-1]
    return v in made and made[v].primitive.name == "all_to_all"

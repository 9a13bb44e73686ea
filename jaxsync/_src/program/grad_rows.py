"""The backward loop writes each layer's gradient into its dead activation row.

A scanned model's backward loop reads the layer inputs the forward saved, one row of
a ``[L, ...]`` stack per layer, and writes each layer's reduced gradient into a stack
of its own, ``[L, ...]`` too. Row ``l`` of the inputs is dead once layer ``l``'s
backward has read it, and row ``l`` of the gradients is written then; yet XLA holds
both stacks whole through the loop, at the step's peak: on the Llama-style 1.1B of
``bench_gpu`` under FSDP (8 x H100), 704 MiB of bf16 inputs beside 473 MiB of fp32
reduced shards.

:func:`grads_in_activation_rows` rewrites the backward loop to carry the input stack
and to write each layer's gradient, bit for bit, into a row already read. XLA's
collective pipeliner would then no longer move the layer's reduce-scatter into the
next iteration (it does so only for a result written into a buffer the loop does not
read: 8 x H100, FSDP 142.6 -> 151.7 ms on XLA's timeline), so the rewrite pipelines
it itself: the loop body is split at its last reductions, and each iteration reduces
the layer before's gradient (the "tail", carried as its inputs) while it computes its
own layer. The result is written one iteration later, into the row read two
iterations before: XLA runs two iterations to a trip, and a write of the first's own
reduction would hold the second's read of the stack, and so its whole layer, until
that reduction is done (64 x H100, GPT 6.7B ZeRO: 92.5% -> 90.0% of the
communication bound; written late, 92.3%). The backward's first layer runs before the
loop, the last two writes after it, where the gradients are read out of the stack
before anything else may run, so the stack dies there; the last reduction waits for
the loop's, which XLA would otherwise merge into one, exposed, after the loop.

Applied where the result is exact and the loop is the data-parallel one:

- a stack is reused only where the loop is its sole reader; a gradient fills what is
  left of a row and spills the rest into a stack of its own (:mod:`rows`; the bits are
  copied, never converted);
- a loop of fewer than :data:`MIN_LAYERS` layers is left alone;
- a loop whose other collectives run over axes its gradient's reductions do not,
  or that runs on a mesh axis the compiler partitions (tensor-parallel layers), is left
  alone. There the flattened input stack loses the layout the partitioner gave the
  activations, and it gathers the whole stack (704 MiB) in every iteration: on a data
  4 x model 2 mesh the rewritten steps held far less (ZeRO 5167 -> 4441 MiB, FSDP 4587
  -> 3806) but took 40% longer on XLA's timeline (106.3 -> 148.4 ms, 112.0 -> 152.9).

``bench_gpu``'s Llama-style models (args + temps per GPU; share of the communication
bound on XLA's timeline): 8 x H100, 1.1B, FSDP 5314 -> 4883 MiB (100% -> 98.9%), ZeRO
5715 -> 5284 (100% -> 99.4%), DDP 17056 -> 16814; 64 x H100, 7.2B, FSDP 7104 -> 6733
(93.4% -> 94.7%), ZeRO 7452 -> 6833 (96.1% -> 96.0%). See ``docs/gpu.md`` for the GPT,
two hosts and the held-out shapes.

Across hosts, where one layer's reduction takes about as long as the next layer's
backward, XLA let it run to the iteration's end, and started gathering the next
layer's params (one collective in flight) before the attention scores' gradients,
the iteration's peak. Each iteration now waits for the reduction before its last
matmul (:func:`_tie`), a barrier on that matmul's operands that are held anyway
(:func:`_materialized`); the gather then starts past the peak (64 x H100, FSDP:
the 7.2B 6458 -> 6038 MiB, the gathered layer no longer at the peak, 94.7% -> 96.0% of
the communication bound; GPT 6.7B 6254 -> 5826, 91.6% -> 93.5%; no kernel bytes added).
In one host the reduction is short, and waiting for it there only held more.

The backward's first layer, run before the loop, has no reduction of the loop's beside
it: the reductions ready before the loop that XLA would run after it (the LM head's,
across hosts) run there instead (:func:`beside.ready_reductions`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ..core.axes import aval_varying_axes, partitioned_axes, to_varying
from ..core.hosts import in_one_host
from ..core.jaxpr_compat import scan_num_carry, scan_num_consts
from .beside import ready_reductions
from .reach import (
    SHAPE_ONLY,
    back_through,
    collective_axes,
    downstream,
    nbytes,
    run_eqns,
    upstream,
)
from .rows import Place, from_bits, places_of, to_bits

_SCAN = jcore.primitives.scan_p
#: Collectives, each with the mesh axes it runs over (``axes`` or ``axis_name``).
_COLLECTIVES = {"reduce_scatter", "all_to_all", "psum", "psum_invariant", "all_gather",
                "ppermute", "pmax", "pmin"}  # fmt: skip
#: Ops that only rename a value or change its shape (:data:`reach.SHAPE_ONLY`); no
#: transpose or conversion, which XLA would make a copy of.
_RENAMES = SHAPE_ONLY | {"name", "pvary"}
#: The fewest layers rewritten. XLA unrolls a loop of 3 trips whole (it runs loops two
#: iterations to a trip, and peels an odd one), so 4 layers would run their backwards
#: side by side, with both layers' temporaries live (2 x H100, ZeRO, a 4-layer
#: Llama-style step with 16 MiB attention scores: 161 -> 170 MiB), for a gradient stack
#: of 4 shards saved.
MIN_LAYERS = 5


def grads_in_activation_rows(closed: Any) -> Any:
    """``closed`` with its first backward loop's stacked results written into the rows
    of the input stacks that loop alone reads (see the module); ``closed`` itself where
    none fits, or where the loop runs collectives over other axes."""
    jaxpr = closed.jaxpr
    at = next((i for i, e in enumerate(jaxpr.eqns)
               if e.primitive is _SCAN and e.params["reverse"]), None)  # fmt: skip
    if at is None or partitioned_axes():
        return closed
    loop = jaxpr.eqns[at]
    if loop.params["length"] < MIN_LAYERS:
        return closed
    if not isinstance(loop.params["jaxpr"], jcore.ClosedJaxpr) or any(
        type(f).__name__ != "NamedAxisEffect" for f in loop.effects
    ):
        return closed
    places = places_of(jaxpr, loop)
    if not places:
        return closed
    body = _inlined(loop.params["jaxpr"])
    head, tail, front = _split(body.jaxpr, scan_num_consts(loop), scan_num_carry(loop), places)
    axes = {a for e in tail if e.primitive.name in _COLLECTIVES for a in collective_axes(e)}
    if not _one_kind(head, axes):
        return closed
    room = sum(nbytes(v.aval) for v in front)
    early, after, tied = ready_reductions(jaxpr, at, axes, room)
    avals = [v.aval for v in [*loop.invars, *tied]]
    across = bool(axes) and not in_one_host(tuple(axes))
    parts = (body, head, tail, front, _tie(head, front) if across else None)
    new = jax.make_jaxpr(lambda *ops: _loop(loop, places, parts, ops))(*avals)
    call = jcore.new_jaxpr_eqn(
        [*loop.invars, *tied], list(loop.outvars), jcore.primitives.closed_call_p,
        {"call_jaxpr": new}, new.effects, loop.source_info,
    )  # fmt: skip
    eqns = [*jaxpr.eqns[:at], *early, call, *after]
    return jcore.ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def _inlined(inner: Any) -> Any:
    """``inner`` (a closed jaxpr) retraced with its calls inlined, recursively: a
    layer's reductions, inside its remat, become equations of the body itself."""
    jaxpr = inner.jaxpr

    def run(*args: Any) -> list:
        env = dict(zip(jaxpr.constvars, inner.consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        return run_eqns(jaxpr.eqns, env, jaxpr.outvars)

    return jax.make_jaxpr(run)(*[v.aval for v in jaxpr.invars])


def _split(body: Any, nc: int, ncar: int, places: dict) -> tuple[list, list, list]:
    """The body's equations in two, and what passes between them: the tail makes the
    placed results from their last reductions on (a reduction that another one waits
    for, a first half, stays in the head); the front is what the tail reads from the
    head or the body's operands (the loop constants excepted), carried to the next
    iteration."""
    ys = body.outvars[ncar:]
    target = [ys[j] for j in places]
    made = {v: e for e in body.eqns for v in e.outvars}

    others = upstream(made, [v for k, v in enumerate(body.outvars)
                             if k < ncar or k - ncar not in places])  # fmt: skip
    mine = upstream(made, target) - others
    ours = [e for e in body.eqns
            if e.primitive.name in _COLLECTIVES and any(v in mine for v in e.outvars)]  # fmt: skip
    waited = set()
    for at, e in enumerate(body.eqns):
        if e in ours:
            later = downstream(body.eqns[at + 1 :], e.outvars, strict=True)
            if any(v in later for f in ours for v in f.outvars):
                waited.add(id(e))
    tail, made_by_tail = [], set()
    for e in body.eqns:
        if any(v in mine for v in e.outvars) and (
            (e in ours and id(e) not in waited)
            or any(isinstance(v, jcore.Var) and v in made_by_tail for v in e.invars)
        ):
            tail.append(e)
            made_by_tail.update(e.outvars)
    head = [e for e in body.eqns if e not in tail]
    fixed = set(body.constvars) | set(body.invars[:nc])
    front: list = []
    for v in [*(v for e in tail for v in e.invars), *target]:
        if isinstance(v, jcore.Var) and v not in made_by_tail and v not in fixed and v not in front:
            front.append(v)
    return head, tail, front


def _one_kind(head: list, axes: set) -> bool:
    """Whether every collective the loop runs is over ``axes``, those of its last
    reductions."""
    return all(set(collective_axes(e)) <= axes for e in head if e.primitive.name in _COLLECTIVES)


def _tie(head: list, front: list) -> tuple[int, list, list] | None:
    """Where in ``head`` the reduction of the layer before is to have ended: the index
    of the last matmul the layer's gradient (what ``front`` carries to the reduction)
    is computed from that has an operand held anyway (:func:`_materialized`); the roots
    those operands are renamed from, to tie; and the renames, to run again from the
    tied roots. None where there is none."""
    made = {v: e for e in head for v in e.outvars}
    grads = upstream(made, front)
    for k in reversed(range(len(head))):
        e = head[k]
        if e.primitive.name != "dot_general" or not any(v in grads for v in e.outvars):
            continue
        ops = dict.fromkeys(v for v in e.invars if isinstance(v, jcore.Var))
        ways = [back_through(v, made, _RENAMES) for v in ops]
        ways = [w for w in ways if _materialized(w[-1], made)]
        if ways:
            roots = list(dict.fromkeys(w[-1] for w in ways))
            return k, roots, [made[v] for w in ways for v in reversed(w[:-1])]
    return None


def _materialized(v: Any, made: dict, inside: bool = False) -> bool:
    """Whether ``v`` is held in memory anyway, whatever XLA fuses: an operand of the
    iteration or the result of a matmul or a collective (looked for inside a call: an
    FSDP unit's gather). A barrier on anything else would make XLA write it out (GPT
    6.7B, 64 x H100: a concatenation fused into its matmul, +12.5 GB of kernel bytes)."""
    e = made.get(v)
    if e is None:
        return not inside  # the iteration's operand, or a call's (which may be fused)
    if e.primitive.name == "dot_general" or e.primitive.name in _COLLECTIVES:
        return True
    inner = getattr(e.params.get("call_jaxpr", e.params.get("jaxpr")), "jaxpr", None)
    if inner is None:
        return False
    made_in = {x: f for f in inner.eqns for x in f.outvars}
    root = back_through(inner.outvars[e.outvars.index(v)], made_in, _RENAMES)[-1]
    return _materialized(root, made_in, inside=True)


def _loop(loop: Any, places: dict, parts: tuple, ops: tuple) -> list:
    """The rewritten loop, on the loop's operands ``ops``: its results, in its order."""
    body, head, tail, front, tie = parts
    nc, ncar = scan_num_consts(loop), scan_num_carry(loop)
    length = loop.params["length"]
    jaxpr, consts_in = body.jaxpr, body.consts
    n = len(loop.invars)
    consts, carry, xs = ops[:nc], list(ops[nc : nc + ncar]), list(ops[nc + ncar : n])
    tied = ops[n:]  # reductions ready before the loop: reduced beside its first layer
    stacks = sorted({p.stack for p in places.values()})
    # each placed result's row, as elements of the stack it is written into
    widths = [p.take + p.spill for p in places.values()]
    spilled = [j for j, p in places.items() if p.spill]
    ys = jaxpr.outvars[ncar:]
    nk = len(ys) - len(places)
    kept_ys = [v for j, v in enumerate(ys) if j not in places]
    fixed = dict(zip(jaxpr.constvars, consts_in, strict=True))
    fixed.update(zip(jaxpr.invars[:nc], consts, strict=True))

    def head_of(state: list, rows: list, wait: Any = None) -> tuple:
        env = {**fixed, **dict(zip(jaxpr.invars[nc:], [*state, *rows], strict=True))}
        rest = head
        if wait is not None and tie is not None:
            # the layer before's reduction ends before this layer's last matmul
            cut, roots, renames = tie
            run_eqns(head[:cut], env, [])
            vals, wait = jax.lax.optimization_barrier(([env[v] for v in roots], wait))
            env.update(zip(roots, vals, strict=True))
            run_eqns(renames, env, [])  # the matmul's operands, again from the tied roots
            rest = head[cut:]
        out = run_eqns(rest, env, [*jaxpr.outvars[:ncar], *kept_ys, *front])
        return out[:ncar], out[ncar : ncar + nk], tuple(out[ncar + nk :]), wait

    def tail_of(vals: tuple) -> list:
        env = {**fixed, **dict(zip(front, vals, strict=True))}
        return run_eqns(tail, env, [ys[j] for j in places])

    def zeros(n: Any, k: int) -> jax.Array:  # varying as the stack ``k`` is
        return to_varying(jnp.zeros(n, xs[k].dtype), tuple(aval_varying_axes(xs[k].aval)))

    def rows_at(held: tuple, i: Any) -> tuple[list, dict]:
        # the reused stacks' rows behind a barrier: the write that follows them then
        # needs no copy of the stack
        read = {k: jax.lax.dynamic_index_in_dim(held[stacks.index(k)], i, keepdims=False)
                for k in stacks}  # fmt: skip
        read = jax.lax.optimization_barrier(read)
        rows = [read[k].reshape(xs[k].shape[1:]) if k in read
                else jax.lax.dynamic_index_in_dim(xs[k], i, keepdims=False)
                for k in range(len(xs))]  # fmt: skip
        return rows, read

    def step(c: tuple, i: Any) -> tuple:
        state, held, spills, vals, pending = c
        rows, read = rows_at(held, i)
        # the row two layers on is written with the gradient the iteration before
        # reduced: a write of this iteration's own reduction would keep the next
        # iteration's read of the stack (XLA runs two to a trip) waiting on it. The
        # first iteration writes zeros into the peeled layer's row, overwritten next.
        pending, _ = jax.lax.optimization_barrier((pending, read))
        held, spills, row = list(held), list(spills), jnp.minimum(i + 2, length - 1)
        for b, (j, p) in zip(pending, places.items(), strict=True):
            at = stacks.index(p.stack)
            held[at] = jax.lax.dynamic_update_slice(held[at], b[None, : p.take], (row, p.at))
            if p.spill:
                s = spilled.index(j)
                spills[s] = jax.lax.dynamic_update_slice(spills[s], b[None, p.take :], (row, 0))
        # the layer after's gradient (its inputs carried from the iteration before),
        # reduced while this layer computes
        pending = bits_of(tail_of(vals))
        state, kept, vals, pending = head_of(state, rows, pending)
        return (state, tuple(held), tuple(spills), vals, pending), kept

    def bits_of(grads: list) -> list:
        return [to_bits(y, xs[p.stack].dtype) for y, p in zip(grads, places.values(), strict=True)]

    held = tuple(xs[k].reshape(length, -1) for k in stacks)
    rows, _ = rows_at(held, length - 1)  # the backward's first layer, before the loop
    carry, last, vals, _ = head_of(carry, rows)
    if tied:
        (carry, vals), _ = jax.lax.optimization_barrier(((carry, vals), tied))
    pending = [zeros((n,), p.stack) for n, p in zip(widths, places.values(), strict=True)]
    spills = tuple(zeros((length, places[j].spill), places[j].stack) for j in spilled)
    (carry, held, spills, vals, pending), kept = jax.lax.scan(
        step,
        (carry, held, spills, vals, pending),
        jnp.arange(length - 1, dtype=jnp.int32),
        reverse=True,
    )

    # the gradients read out of the stack before anything after the loop may run (so
    # the stack dies there); row 1's is the one the last iteration reduced, row 0's,
    # the backward's last layer, is reduced after the loop
    def read_out(j: int, p: Place) -> jax.Array:
        bits = held[stacks.index(p.stack)][:, p.at : p.at + p.take]
        if p.spill:
            bits = jnp.concatenate([bits, spills[spilled.index(j)]], axis=1)
        return from_bits(bits, loop.outvars[ncar + j].aval)

    out = [read_out(j, p) for j, p in places.items()]
    carry, out, vals, pending = jax.lax.optimization_barrier((carry, out, vals, pending))
    ones = [from_bits(b[None], jax.ShapeDtypeStruct((1, *o.shape[1:]), o.dtype))[0]
            for b, o in zip(pending, out, strict=True)]  # fmt: skip
    out = [o.at[1].set(p).at[0].set(y)
           for o, p, y in zip(out, ones, tail_of(vals), strict=True)]  # fmt: skip
    kept = [jnp.concatenate([k, x[None]]) for k, x in zip(kept, last, strict=True)]
    results = [out[list(places).index(j)] if j in places else kept.pop(0) for j in range(len(ys))]
    return [*carry, *results]

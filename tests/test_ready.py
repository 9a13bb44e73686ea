"""The backward loop's start (``program/ready.py``): gradients ready before it are computed
before it, and what it recomputes waits for the cotangent it starts from.

The LM head's weight gradient needs only the logits' cotangent and the last hidden
state; left to XLA it can be computed after the backward loop, holding its inputs
across it. These tests hold the rewrite to its structure (an optimization barrier
ties the gradient to the loop's input), to the exact values of ``jax.value_and_grad``,
to the cases it leaves alone, and measure its effect on a compiled Llama-style ZeRO
step for H100s.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from helpers import lowered_llama_step

import jaxsync
from jaxsync._src.program import grad_program, ready

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import llama  # noqa: E402

D, L = 16, 3


def _loss(params, x, y):
    def body(h, w):
        return jnp.tanh(h @ w) + h, None

    h, _ = jax.lax.scan(jax.checkpoint(body), x @ params["inp"], params["blocks"])
    logits = h @ params["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _args(tokens, vocab, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    params = {"inp": 0.3 * jax.random.normal(k[0], (D, D)),
              "blocks": 0.3 * jax.random.normal(k[1], (L, D, D)),
              "head": 0.3 * jax.random.normal(k[2], (D, vocab))}  # fmt: skip
    x = jax.random.normal(k[3], (tokens, D))
    return params, x, jax.random.randint(k[4], (tokens,), 0, vocab)


def _program(tokens, vocab):
    return jax.make_jaxpr(jax.value_and_grad(_loss))(*_args(tokens, vocab))


def test_the_heads_gradient_is_tied_to_the_backward_loops_input():
    closed = _program(tokens=64, vocab=256)  # dlogits 64 x 256 outweighs dW 16 x 256
    tied = ready.ready_first(closed)
    eqns = tied.jaxpr.eqns
    (b,) = [i for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"]
    loop = next(i for i, e in enumerate(eqns) if e.primitive.name == "scan" and e.params["reverse"])
    assert b < loop
    barrier = eqns[b]
    assert [tuple(v.aval.shape) for v in barrier.outvars[:-1]] == [(D, 256)]
    assert barrier.outvars[-1] in eqns[loop].invars  # the loop waits for it
    assert barrier.outvars[0] in tied.jaxpr.outvars  # the head's gradient, returned
    # the untied program has no barrier, and nothing else changed in number
    assert not any(e.primitive.name == "optimization_barrier" for e in closed.jaxpr.eqns)
    assert len(eqns) == len(closed.jaxpr.eqns) + 1


def _cast_loss(params, x, y):
    """fp32 params, bf16 compute (a DDP step's model): the head's gradient leaves the
    program in fp32, the transpose of the cast of its bf16 matmul."""
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    return _loss(bf16, x.astype(jnp.bfloat16), y).astype(jnp.float32)


def test_a_gradient_handed_out_widened_is_held_narrow_across_the_loop():
    """The barrier holds the bf16 matmul result; the fp32 cast waits for the loop.
    Tied in fp32 it held twice the bytes across the loop (Llama-3.2-1B's shape on
    8 x H100, DDP: the head's gradient, 1002 MiB against 501)."""
    args = _args(tokens=64, vocab=256)
    closed = jax.make_jaxpr(jax.value_and_grad(_cast_loss))(*args)
    tied = ready.ready_first(closed)
    eqns = tied.jaxpr.eqns
    (b,) = [i for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"]
    loop = next(i for i, e in enumerate(eqns) if e.primitive.name == "scan" and e.params["reverse"])
    assert b < loop
    (held,) = eqns[b].outvars[:-1]
    assert (held.aval.shape, held.aval.dtype) == ((D, 256), jnp.bfloat16)
    widen = next(i for i, e in enumerate(eqns) if held in e.invars)
    assert eqns[widen].primitive.name == "convert_element_type" and widen > loop
    assert eqns[widen].outvars[0].aval.dtype == jnp.float32
    want = jax.jit(jax.value_and_grad(_cast_loss))(*args)
    got = jax.jit(grad_program.value_and_grad(_cast_loss))(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_values_are_jax_value_and_grads_exactly():
    args = _args(tokens=64, vocab=256, seed=1)
    want = jax.jit(jax.value_and_grad(_loss))(*args)
    got = jax.jit(grad_program.value_and_grad(_loss))(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_gradient_that_would_hold_more_than_it_frees_is_left_alone():
    closed = _program(tokens=4, vocab=256)  # dW 16 x 256 outweighs dlogits 4 x 256 + h
    assert ready.ready_first(closed) is closed


def test_a_program_with_ordered_effects_is_left_alone():
    def loss(params, x, y):
        jax.debug.print("{}", x[0, 0], ordered=True)
        return _loss(params, x, y)

    closed = jax.make_jaxpr(jax.value_and_grad(loss))(*_args(tokens=64, vocab=256))
    assert ready.ready_first(closed) is closed


def test_a_program_without_a_backward_loop_is_left_alone():
    closed = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum((x @ w) ** 2)))(
        jnp.ones((4, 256)), jnp.ones((64, 4))
    )
    assert ready.ready_first(closed) is closed


def _held_mib() -> float:
    """Arguments + temporaries per GPU of a Llama-style ZeRO step on two H100s."""
    mesh = jaxsync.gpu_topology("h100", hosts=1, gpus_per_host=2)
    lowered = lowered_llama_step(mesh, "zero", param_dtype=jnp.bfloat16)
    stats = lowered.compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.temp_size_in_bytes) / 2**20


def test_a_llama_zero_step_for_h100s_no_longer_holds_the_logits_cotangent(monkeypatch):
    cfg = llama.SIZES["quick"]
    tied = _held_mib()
    monkeypatch.setattr(grad_program, "ready_first", lambda closed: closed)
    untied = _held_mib()
    # left to XLA, the head's gradient is computed after the backward loop, holding the
    # logits' cotangent (bf16 [rows, seq, vocab]) across it instead of the gradient
    dlogits = cfg.batch_per_device * cfg.seq * cfg.vocab * 2 / 2**20
    dw = cfg.d_model * cfg.vocab * 2 / 2**20
    assert untied - tied >= (dlogits - dw) / 2, (untied, tied)


def _fsdp_step(mesh):
    return lowered_llama_step(mesh, jaxsync.FSDP(policy=jaxsync.MixedPrecision(jnp.bfloat16)))


def _fsdp_ties(monkeypatch, mesh):
    """The FSDP step's program before and after ``ready_first``, and what its added
    barrier holds."""
    seen, tie = [], grad_program.ready_first

    def spy(closed):
        seen.append((closed, tie(closed)))
        return seen[-1][1]

    with monkeypatch.context() as m:
        m.setattr(grad_program, "ready_first", spy)
        _fsdp_step(mesh)
    closed, tied = seen[-1]
    before = {id(e) for e in closed.jaxpr.eqns}  # the mask's fence (sink.py) is there already
    added = [e for e in tied.jaxpr.eqns if id(e) not in before]
    (barrier,) = [e for e in added if e.primitive.name == "optimization_barrier"]
    return closed, barrier.invars[:-1]


def test_an_fsdp_heads_gradient_is_reduced_before_the_loop_in_one_host(mesh8, monkeypatch):
    """FSDP's head gradient leaves the program reduce-scattered from its unit's pack.
    In one host (8 ranks) the reduced gradient itself is tied, so its matmul, pack and
    reduce-scatter all run before the backward loop and only the fp32 shard is held
    across it; beyond one host (the reductions set the loop's pace there) the matmul's
    result is tied and the reduction is left where XLA puts it."""
    from jaxsync._src.core import hosts

    cfg = llama.SIZES["quick"]
    closed, held = _fsdp_ties(monkeypatch, mesh8)
    made = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    (shard,) = held
    assert shard in closed.jaxpr.outvars  # a result of the program: the reduced shard
    assert shard.aval.size == cfg.d_model * (cfg.vocab + 1) // 8  # the head and final norm
    dots, reductions = ready._packed_behind(shard, made, set(closed.jaxpr.invars))
    assert {tuple(sorted(v.aval.shape)) for v in dots} == {tuple(sorted((cfg.d_model, cfg.vocab)))}
    assert reductions == [("data",)]

    monkeypatch.setattr(hosts, "ONE_HOST_RANKS", 4)  # 8 ranks: beyond "one host"
    closed, held = _fsdp_ties(monkeypatch, mesh8)
    made = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    assert {made[v].primitive.name for v in held} == {"dot_general"}
    assert {tuple(sorted(v.aval.shape)) for v in held} == {tuple(sorted((cfg.d_model, cfg.vocab)))}
    assert not set(held) & set(closed.jaxpr.outvars)  # the results are reduce-scattered
    # the rule that ties only a program's results finds nothing to tie here
    monkeypatch.setattr(ready, "_packed_behind", lambda *a: ([], []))
    assert grad_program.ready_first(closed) is closed


def _head_gradient_before_the_backward_loop(cfg) -> bool:
    """Whether the compiled FSDP step for two H100s runs the head's weight-gradient
    matmul before its backward layer loop (the last loop of its entry computation)."""
    hlo = _fsdp_step(jaxsync.gpu_topology("h100", hosts=1, gpus_per_host=2)).compile()
    entry = hlo.as_text().split("\nENTRY ", 1)[1].split("\n}\n", 1)[0].splitlines()
    loop = max(i for i, line in enumerate(entry) if " while(" in line)
    head = {f"bf16[{cfg.d_model},{cfg.vocab}]", f"bf16[{cfg.vocab},{cfg.d_model}]"}
    (dw,) = [i for i, line in enumerate(entry)
             if line.split(" = ", 1)[-1].split("{", 1)[0] in head
             and (re.match(r"\s*%\S*gemm\S* = ", line) or "__cublas" in line)]  # fmt: skip
    return dw < loop


def test_an_fsdp_step_for_h100s_computes_the_heads_gradient_before_the_loop(monkeypatch):
    """Tied, the head's gradient is computed before the backward loop and the logits'
    cotangent dies there (8 x H100, Llama-style 1.1B: 6400 -> 6099 MiB on jax 0.10.2,
    6418 -> 6241 on 0.12); left to XLA (every version tried), it runs after the loop."""
    cfg = llama.SIZES["quick"]
    assert _head_gradient_before_the_backward_loop(cfg)
    monkeypatch.setattr(ready, "_packed_behind", lambda *a: ([], []))
    assert not _head_gradient_before_the_backward_loop(cfg)


def test_a_returned_activation_the_loop_waits_on_is_not_tied():
    """The logits returned as an aux are made by a matmul whose inputs outweigh them,
    and the backward loop's input is computed from them: computed before the loop
    anyway, they are not tied; the head's gradient, computed from them, is. The
    rewritten program runs and gives ``jax.value_and_grad``'s values exactly."""

    def loss(params, x, y):
        def body(h, w):
            return jnp.tanh(h @ w) + h, None

        h, _ = jax.lax.scan(jax.checkpoint(body), x @ params["inp"], params["blocks"])
        logits = h @ params["head"]
        ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))
        return ce, logits

    args = _args(tokens=64, vocab=8, seed=2)  # h [64, 16] outweighs the logits [64, 8]
    closed = jax.make_jaxpr(jax.value_and_grad(loss, has_aux=True))(*args)
    tied = ready.ready_first(closed)
    before = {id(e) for e in closed.jaxpr.eqns}  # the mask's fence (sink.py) is there already
    added = [e for e in tied.jaxpr.eqns if id(e) not in before]
    (barrier,) = [e for e in added if e.primitive.name == "optimization_barrier"]
    assert [tuple(v.aval.shape) for v in barrier.invars[:-1]] == [(D, 8)]  # the head's dW
    want = jax.jit(jax.value_and_grad(loss, has_aux=True))(*args)
    got = jax.jit(grad_program.value_and_grad(loss, has_aux=True))(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_loops_saved_activations_wait_for_its_cotangent():
    closed = _program(tokens=64, vocab=256)
    tied = ready.recompute_late(closed)
    eqns = tied.jaxpr.eqns
    (b,) = [i for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier"]
    loop = next(i for i, e in enumerate(eqns) if e.primitive.name == "scan" and e.params["reverse"])
    assert b == loop - 1
    barrier, old = eqns[b], next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan"
                                 and e.params["reverse"])  # fmt: skip
    # the cotangent carried in and the saved layer inputs [L, tokens, D], in the loop's place
    assert [tuple(v.aval.shape) for v in barrier.invars] == [(64, D), (L, 64, D)]
    assert barrier.invars == [v for v in old.invars if v in barrier.invars]
    assert all(v in eqns[loop].invars for v in barrier.outvars)
    # the stacked params, read straight from the arguments, stay free
    (blocks,) = [v for v in closed.jaxpr.invars if v.aval.shape == (L, D, D)]
    assert blocks in eqns[loop].invars
    assert len(eqns) == len(closed.jaxpr.eqns) + 1
    # after ready_first's tie too: the carry it tied is the one held here
    both = ready.recompute_late(ready.ready_first(closed))
    barriers = [e for e in both.jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 2 and barriers[0].outvars[-1] is barriers[1].invars[0]


def test_recompute_late_leaves_programs_without_a_forward_loop_or_with_effects_alone():
    grad = jax.grad(lambda w, x: jnp.sum((x @ w) ** 2))
    closed = jax.make_jaxpr(grad)(jnp.ones((4, 256)), jnp.ones((64, 4)))
    assert ready.recompute_late(closed) is closed

    def loss(params, x, y):
        jax.debug.print("{}", x[0, 0], ordered=True)
        return _loss(params, x, y)

    closed = jax.make_jaxpr(jax.value_and_grad(loss))(*_args(tokens=64, vocab=256))
    assert ready.recompute_late(closed) is closed


#: attention scores bf16 [2, 4, 1024, 1024] (16 MiB) per layer, logits [2, 1024, 8192]
_SCORES = llama.Config(vocab=8192, seq=1024, d_model=256, heads=4, kv_heads=2, ffn=512,
                       layers=4, batch_per_device=2)  # fmt: skip


def test_a_step_for_h100s_no_longer_recomputes_a_layer_on_the_losss_peak(monkeypatch):
    """XLA peels the backward loop's first layer out of it and, untied, runs its
    recompute (the attention scores) beside the loss's backward (the logits' fp32
    cotangent): both peaks at once. Tied, the step holds at least one scores tensor
    less (measured on jax 0.10.2: ZeRO 246 -> 226 MiB). FSDP in one host gains
    nothing since its head's gradient is reduced before the loop (151 MiB either
    way): the loss's backward is no longer the peak there."""
    mesh = jaxsync.gpu_topology("h100", hosts=1, gpus_per_host=2)

    def held() -> float:
        stats = lowered_llama_step(mesh, "zero", size=_SCORES).compile().memory_analysis()
        return stats.argument_size_in_bytes + stats.temp_size_in_bytes

    tied = held()
    monkeypatch.setattr(grad_program, "recompute_late", lambda closed: closed)
    untied = held()
    c = _SCORES
    scores = c.batch_per_device * c.heads * c.seq * c.seq * 2
    assert untied - tied >= scores, (untied / 2**20, tied / 2**20)

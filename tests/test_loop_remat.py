"""A layer rematerialised inside a scan loses its CSE barrier (``program/loop_remat.py``).

``jax.checkpoint``'s default ``prevent_cse=True`` puts an optimization barrier in
front of the forward it recomputes in the backward; inside a scan it serves nothing
and keeps XLA from gathering the next layer during the previous backward iteration.
These tests hold the rewrite to what it changes (every remat inside a scan, none
outside), to the exact values of ``jax.value_and_grad``, to the barrier gone from
the compiled CPU program, and to its purpose on an FSDP step compiled for H100s:
the backward loop, like the forward one, carries the next layer's gather.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from helpers import lowered_llama_step

import jaxsync
from jaxsync._src.core.jaxpr_compat import REMAT, rewrite_programs
from jaxsync._src.program import grad_program, loop_remat

D, L = 8, 3


def _loss(params, x):
    def body(h, w):
        return jnp.tanh(h @ w) + h, None

    h, _ = jax.lax.scan(jax.checkpoint(body), x, params["blocks"])
    head = jax.checkpoint(lambda h, w: jnp.sin(h @ w))  # outside any scan: left alone
    return jnp.mean(head(h, params["head"]) ** 2)


def _args(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    params = {"blocks": 0.4 * jax.random.normal(k[0], (L, D, D)),
              "head": 0.4 * jax.random.normal(k[1], (D, D))}  # fmt: skip
    return params, jax.random.normal(k[2], (4, D))


def _remats(jaxpr, in_loop=False) -> list[tuple[bool, bool]]:
    """``(inside a scan, prevent_cse)`` of every remat equation, at any depth."""
    found = []
    for e in jaxpr.eqns:
        inner = in_loop or e.primitive.name == "scan"
        if e.primitive.name in REMAT:
            found.append((in_loop, e.params["prevent_cse"]))
        rewrite_programs(e, lambda j, inner=inner: (found.extend(_remats(j, inner)), (j, False))[1])
    return found


def test_every_remat_inside_a_scan_loses_its_barrier_and_no_other():
    closed = jax.make_jaxpr(jax.value_and_grad(_loss))(*_args())
    before = _remats(closed.jaxpr)
    assert (True, True) in before and (False, True) in before  # the default, both places
    after = _remats(loop_remat.drop_loop_barriers(closed).jaxpr)
    assert len(after) == len(before)
    assert all(not cse for inside, cse in after if inside)
    assert (False, True) in after  # the head's remat, outside the loop, keeps it


def test_a_program_without_a_barrier_in_a_loop_is_left_alone():
    def loss(params, x):
        body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None), prevent_cse=False)
        return jnp.sum(jax.lax.scan(body, x, params["blocks"])[0])

    closed = jax.make_jaxpr(jax.grad(loss))(*_args())
    assert loop_remat.drop_loop_barriers(closed) is closed


def test_values_are_jax_value_and_grads_exactly():
    args = _args(seed=1)
    want = jax.jit(jax.value_and_grad(_loss))(*args)
    got = jax.jit(grad_program.value_and_grad(_loss))(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_compiled_loop_has_no_barrier_left():
    def barriers(fn):
        return jax.jit(fn).lower(*_args()).as_text().count("optimization_barrier")

    def scanned(params, x):  # no remat outside the scan
        h, _ = jax.lax.scan(jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None)), x,
                            params["blocks"])  # fmt: skip
        return jnp.sum(h)

    assert barriers(jax.value_and_grad(scanned)) > 0
    assert barriers(grad_program.value_and_grad(scanned)) == 0


def _loops_carrying_a_gather(hlo: str) -> int:
    """While bodies that hand an all-gather's result to the next iteration: XLA's
    pipelined all-gather, issued one layer ahead."""
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
    count = 0
    for comp in re.split(r"\n(?=%|ENTRY )", hlo):
        name = re.match(r"%([\w.\-]+) ", comp)
        if not name or name.group(1) not in bodies or "all-gather-done" not in comp:
            continue
        gathered = set(re.findall(r"%([\w.\-]+) = [^=]*get-tuple-element\(%all-gather-done", comp))
        gathered |= set(re.findall(r"%(all-gather-done[\w.\-]*) = ", comp))
        root = next(line for line in comp.splitlines() if "ROOT" in line)
        operands = set(re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[-1]))
        count += bool(gathered & operands)
    return count


def _fsdp_step_hlo() -> str:
    mesh = jaxsync.gpu_topology("h100", hosts=1, gpus_per_host=2)
    return lowered_llama_step(mesh, "fsdp").compile().as_text()


def test_an_fsdp_step_for_h100s_gathers_the_next_layer_in_the_backward_too(monkeypatch):
    # the forward loop carries the next layer's gather either way; the backward's
    # re-gather can be issued an iteration early only without the barrier
    assert _loops_carrying_a_gather(_fsdp_step_hlo()) == 2
    monkeypatch.setattr(grad_program, "drop_loop_barriers", lambda closed: closed)
    assert _loops_carrying_a_gather(_fsdp_step_hlo()) == 1

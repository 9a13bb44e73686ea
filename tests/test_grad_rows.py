"""Gradients written into the backward loop's dead input rows (``program/grad_rows.py``).

The rewrite frees the stack of reduced gradients a scanned model's backward loop
fills, by writing each layer's gradient into the row of saved layer inputs it has
just read, and reduces each layer's gradient during the next layer. These tests hold
it to the exact values of the program it rewrites (bit for bit, and a step's params
against the step without it), to its structure (no stacked gradient leaves the loop),
to the cases it leaves alone, and to the memory it frees on a compiled H100 step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import backward_rows_seen, lowered_llama_step, place_by_specs
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.core.jaxpr_compat import scan_num_carry
from jaxsync._src.program import grad_program
from jaxsync._src.program.grad_rows import MIN_LAYERS, grads_in_activation_rows

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import llama  # noqa: E402

D, L = 16, 6


def _loss(params, x):
    def body(h, w):
        return jnp.tanh(h @ w) + h, None

    h, _ = jax.lax.scan(jax.checkpoint(body, prevent_cse=False), x, params)
    return jnp.mean(h**2)


def _program(tokens, layers=L):
    k = jax.random.split(jax.random.key(0), 2)
    params = 0.3 * jax.random.normal(k[0], (layers, D, D))
    x = jax.random.normal(k[1], (tokens, D))
    return jax.make_jaxpr(jax.value_and_grad(_loss))(params, x), (params, x)


def _stacked_outputs(closed, carried=False):
    """The shapes of the stacked results every backward loop of ``closed`` hands out;
    ``carried``: of the values it carries instead."""
    found = []
    for e in closed.jaxpr.eqns:
        if e.primitive.name == "closed_call":
            found += _stacked_outputs(e.params["call_jaxpr"], carried)
        if e.primitive.name == "scan" and e.params["reverse"]:
            n = scan_num_carry(e)
            found += [tuple(v.aval.shape) for v in (e.outvars[:n] if carried else e.outvars[n:])]
    return found


def test_the_gradient_stack_no_longer_leaves_the_backward_loop_and_values_are_exact():
    closed, args = _program(tokens=64)  # a row of inputs: 64 x 16 floats; of grads: 16 x 16
    assert (L, D, D) in _stacked_outputs(closed)
    rows = grads_in_activation_rows(closed)
    assert rows is not closed
    assert not any(s[1:] == (D, D) for s in _stacked_outputs(rows))
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    got = jax.core.eval_jaxpr(rows.jaxpr, rows.consts, *args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_gradient_larger_than_a_row_of_inputs_fills_the_row_and_spills_the_rest():
    """A row of inputs (8 x 16 floats) holds half a layer's 16 x 16 gradient: that half
    goes there, the other half into a stack of its own, and the values are the
    program's, bit for bit. A row that holds less than a third of it (4 x 16) leaves
    the loop alone."""
    closed, args = _program(tokens=8)
    rows = grads_in_activation_rows(closed)
    assert rows is not closed
    assert not any(s[1:] == (D, D) for s in _stacked_outputs(rows))
    carried = _stacked_outputs(rows, carried=True)
    assert (L, 8 * D) in carried and (L, D * D - 8 * D) in carried, carried
    want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    got = jax.core.eval_jaxpr(rows.jaxpr, rows.consts, *args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    closed, _ = _program(tokens=4)
    assert grads_in_activation_rows(closed) is closed


def test_a_loop_of_fewer_layers_than_xla_keeps_as_a_loop_is_left_alone():
    closed, _ = _program(tokens=64, layers=MIN_LAYERS)
    assert grads_in_activation_rows(closed) is not closed
    closed, _ = _program(tokens=64, layers=MIN_LAYERS - 1)
    assert grads_in_activation_rows(closed) is closed


def test_a_program_without_a_backward_loop_is_left_alone():
    closed = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))))(
        jnp.ones((D, D)), jnp.ones((4, D))
    )
    assert grads_in_activation_rows(closed) is closed


def _cfg(vocab=512):
    return llama.Config(vocab=vocab, seq=128, d_model=64, heads=4, kv_heads=2, ffn=128, layers=6,
                        batch_per_device=2)  # fmt: skip


def _scanned_step(mesh, mode, tx, rewrite: bool, monkeypatch, vocab=512, steps=2, seq=128, **kw):
    """Two steps of the benchmark's scanned Llama (6 layers of width 64, fp32) on
    ``mesh``, ``2 * seq`` tokens per device (at 128, a row of inputs holds a layer's
    gradient shard): the params, one-device optax's, the step, its last state and batch,
    and whether the rewrite changed the program (``kw``: ``train_step``'s)."""
    cfg = dataclasses.replace(_cfg(vocab), seq=seq)
    loss = partial(llama.scanned_loss, heads=cfg.heads, kv_heads=cfg.kv_heads, dtype=jnp.float32)
    toks = jax.random.randint(jax.random.key(1), (steps, 2 * mesh.size, cfg.seq + 1), 0, cfg.vocab)
    with contextlib.ExitStack() as stack:
        applied = stack.enter_context(backward_rows_seen())
        if not rewrite:
            m = stack.enter_context(monkeypatch.context())
            m.setattr(grad_program, "grads_in_activation_rows", lambda closed: closed)
        step = jaxsync.train_step(loss, tx, mesh, mode, stacked="blocks", **kw)
        state = step.init(llama.device_params(cfg))
        for b in toks:
            state, _ = step(state, b)
    ref, opt = llama.device_params(cfg), tx.init(llama.device_params(cfg))
    for b in toks:
        u, opt = tx.update(jax.grad(loss)(ref, b), opt, ref)
        ref = optax.apply_updates(ref, u)
    return step.params(state), ref, (step, state, toks[-1]), any(applied)


@pytest.mark.parametrize("mode, kw", [("fsdp", {}), ("zero", {"microbatches": 2}), ("ddp", {})])
def test_steps_are_the_steps_without_the_rewrite_and_match_optax(mesh8, monkeypatch, mode, kw):
    """Each layer's gradient is reduced in the next layer's iteration now, and written
    into a dead row: the same operations on the same values (XLA may fuse a norm's sum
    otherwise: one ulp), and the params match plain optax on one device (SGD, which
    sees a gradient's scale). A gradient read from the wrong row would be off by its
    whole size. In the compiled program the loop runs ``L - 1`` times with each layer's
    reduction inside it: the rewrite's pipelining survives XLA."""
    tx = optax.sgd(0.5)
    got, ref, run, applied = _scanned_step(mesh8, mode, tx, True, monkeypatch, **kw)
    base, _, _, _ = _scanned_step(mesh8, mode, tx, False, monkeypatch, **kw)
    assert applied
    for g, b in zip(jax.tree.leaves(got), jax.tree.leaves(base), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(b), rtol=1e-6, atol=1e-7)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-6)
    step, state, batch = run
    report = jaxsync.overlap_report(step.lower(state, batch).compile())
    in_loop = report.in_loop(kind="reduce-scatter", role="backward")
    assert in_loop and {c.trip_count for c in in_loop} == {5}, report


def test_an_fsdp_step_whose_shards_outgrow_the_input_rows_spills_and_matches_optax(
    mesh8, monkeypatch
):
    """At 32 tokens per device a row of inputs (32 x 64 floats) holds less than half a
    layer's gradient shard (4624 floats at 8 ranks); the rest spills into a stack of its
    own. The same params as the step without the rewrite, and as one-device optax (SGD:
    a spilled piece read back out of place would move those params by a whole update,
    about 1e-2). The token embedding's scatter-add rounds the loop's cotangent in
    another order in each compiled program: 3e-7 apart, as each is from optax."""
    tx = optax.sgd(0.5)
    got, ref, _, applied = _scanned_step(mesh8, "fsdp", tx, True, monkeypatch, seq=16)
    base, _, _, _ = _scanned_step(mesh8, "fsdp", tx, False, monkeypatch, seq=16)
    assert applied
    for g, b in zip(jax.tree.leaves(got), jax.tree.leaves(base), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(b), rtol=1e-6, atol=1e-6)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-6)


def test_a_two_d_step_is_left_alone(monkeypatch):
    """On a mesh whose "model" axis the compiler partitions, the loop waits on
    collectives no jaxpr shows; the rewrite is not applied there."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = {"blocks": jnp.ones((L, D, D)) * 0.1}
    spec = {"blocks": P(None, None, "model")}

    def loss(p, x):
        def body(h, w):
            return jnp.tanh(h @ jaxsync.tap(w)) + h, None

        h, _ = jax.lax.scan(jax.checkpoint(body, prevent_cse=False), x, p["blocks"])
        return jnp.mean(h**2)

    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh, "zero", stacked="blocks")
    with backward_rows_seen() as rows:
        step(step.init(place_by_specs(mesh, params, spec)), jnp.ones((8 * 8, D)))
    assert rows and not any(rows)


@pytest.mark.parametrize("rows", [4, 1])
def test_an_fsdp_step_for_h100s_no_longer_holds_the_gradient_stack(monkeypatch, rows):
    """Compiled for 8 x H100 (no GPU needed). With rows of layer inputs (4 x 512 tokens
    of 512 bf16) larger than a layer's gradient shard (fp32), the step holds at least
    half the stack of reduced gradients less (the rest is what each layer's reduction
    carries into the next iteration); with rows a third of a shard (1 x 512 tokens), at
    least half of what the input rows take of it."""
    mesh = jaxsync.gpu_topology("h100", hosts=1, gpus_per_host=8)
    policy = jaxsync.FSDP(policy=jaxsync.MixedPrecision(jnp.bfloat16))
    cfg = dataclasses.replace(llama.SIZES["quick"], batch_per_device=rows, layers=6)

    def held() -> float:
        stats = lowered_llama_step(mesh, policy, size=cfg).compile().memory_analysis()
        return stats.argument_size_in_bytes + stats.temp_size_in_bytes

    held_rows = held()
    monkeypatch.setattr(grad_program, "grads_in_activation_rows", lambda closed: closed)
    stack = held()
    shapes = jax.eval_shape(lambda: llama.device_params(cfg))
    block = sum(x.size for x in jax.tree.leaves(shapes["blocks"]))  # all layers' params
    grads = block / mesh.size * 4  # the fp32 shards of every layer's gradient
    inputs = cfg.layers * rows * cfg.seq * cfg.d_model * 2  # every layer's bf16 input rows
    freed = min(grads, inputs)
    assert stack - held_rows >= freed / 2, (stack / 2**20, held_rows / 2**20, freed / 2**20)


@contextlib.contextmanager
def _reductions_tied(monkeypatch, across_hosts: bool, enabled: bool = True):
    """Within it, a list of how many reductions ``program/beside.py`` had the rewritten
    loop's first layer wait for, per gradient taken, and how many reduce-scatters the
    ones it split into pieces run; and ``("tie", True)`` where the loop ties each layer's
    reduction to end before the next layer's last matmul (across hosts).
    ``across_hosts``: trace as if the data axis left one host, where ``ready`` leaves the
    head's reduction after the loop; ``enabled=False``: nothing moves before the loop."""
    from jaxsync._src.fsdp import gather
    from jaxsync._src.program import grad_rows, ready
    from jaxsync._src.sync import collectives

    real, seen = grad_rows.ready_reductions, []
    real_tie = grad_rows._tie

    def tie(head, front):
        found = real_tie(head, front)
        seen.append(("tie", found is not None and head[found[0]].primitive.name == "dot_general"))
        return found

    def spy(jaxpr, at, *rest):
        early, after, tied = real(jaxpr, at, *rest) if enabled else ([], jaxpr.eqns[at + 1 :], [])
        calls = [e.params["call_jaxpr"].jaxpr for e in early if e.primitive.name == "closed_call"]
        pieces = sum(f.primitive.name == "reduce_scatter" for c in calls for f in c.eqns)
        seen.append((len(tied), pieces))
        return early, after, tied

    with monkeypatch.context() as m:
        m.setattr(grad_rows, "ready_reductions", spy)
        m.setattr(grad_rows, "_tie", tie)
        if across_hosts:  # every choice the library makes by hosts
            for module in (ready, collectives, gather, grad_rows):
                m.setattr(module, "in_one_host", lambda axes: False)
        yield seen


@pytest.mark.parametrize("compute, vocab, pieces", [("fp32", 512, 0), ("bf16", 2048, 4)])
def test_across_hosts_the_heads_reduction_runs_beside_the_first_layer_and_values_hold(
    mesh8, monkeypatch, compute, vocab, pieces
):
    """Across hosts the head's gradient is reduced before the loop now, beside the
    backward's first layer, rather than after it (the bf16 gradient held across the
    whole loop): whole, or in column pieces where its pack outweighs what the loop holds
    for it (bf16 compute, a 2048-token head: a 524 kB fp32 pack against 148 kB the loop
    carries for a layer and the 262 kB bf16 gradient). The same values as the step
    without the move (a piece's columns out of place would move a slice of the head by
    its whole update), and in fp32 as one-device optax with SGD. In one host ``ready``
    already reduces it before the loop: nothing moves."""
    tx = optax.sgd(0.5)
    bf16 = jaxsync.FSDP(policy=jaxsync.MixedPrecision(jnp.bfloat16))
    mode, steps = ("fsdp", 2) if compute == "fp32" else (bf16, 1)
    with _reductions_tied(monkeypatch, across_hosts=True) as tied:
        got, ref, _, _ = _scanned_step(mesh8, mode, tx, True, monkeypatch, vocab=vocab, steps=steps)
    assert set(tied) == {(1, pieces), ("tie", True)}, tied
    with _reductions_tied(monkeypatch, across_hosts=True, enabled=False):
        base, _, _, _ = _scanned_step(mesh8, mode, tx, True, monkeypatch, vocab=vocab, steps=steps)
    # One step's update. The head's is what the pieces reduce: to fp32 rounding. In bf16
    # the rest may round otherwise where XLA fuses the two programs differently.
    start = llama.device_params(_cfg(vocab))
    ups = [jax.tree.map(lambda a, p: np.asarray(a - p), x, start) for x in (got, base)]
    np.testing.assert_allclose(ups[0]["head"]["w"], ups[1]["head"]["w"], rtol=1e-4, atol=2.5e-7)
    rtol = 1e-5 if compute == "fp32" else 2e-2
    for g, b in zip(jax.tree.leaves(ups[0]), jax.tree.leaves(ups[1]), strict=True):
        np.testing.assert_allclose(g, b, rtol=rtol, atol=rtol / 100)
    if compute == "bf16":
        return
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-6)
    with _reductions_tied(monkeypatch, across_hosts=False) as tied:
        _scanned_step(mesh8, mode, tx, True, monkeypatch)
    assert tied and set(tied) == {(0, 0)}, tied  # and no tie to the last matmul


@pytest.mark.parametrize("vocab, want", [(8192, (1, 0)), (16384, (1, 3)), (65536, (0, 0))])
def test_a_pack_outweighing_what_the_loop_holds_for_it_is_reduced_in_pieces(
    monkeypatch, vocab, want
):
    """The head's fp32 pack runs beside the first layer whole where it is no larger than
    what the loop holds for it: a layer's own pack (``quick``: 11.8 MB) and the bf16
    head gradient it no longer holds (2 x vocab x 512 bytes). A 16k-token head (a 33.6
    MB pack against 28.6 MB) is reduced in 3 pieces of at most a layer's pack, one after
    the other; a pack that would take more than ``MAX_PIECES`` stays after the loop."""
    from jaxsync._src.program.beside import MAX_PIECES

    assert 4 * vocab * 512 / 11.8e6 > MAX_PIECES or want != (0, 0)
    mesh = jaxsync.gpu_topology("h100", hosts=2, gpus_per_host=4)
    cfg = dataclasses.replace(llama.SIZES["quick"], batch_per_device=4, layers=6, vocab=vocab)
    policy = jaxsync.FSDP(policy=jaxsync.MixedPrecision(jnp.bfloat16))
    with _reductions_tied(monkeypatch, across_hosts=False) as tied:
        lowered_llama_step(mesh, policy, size=cfg)
    assert [t for t in tied if t[0] != "tie"] == [want]


def test_compiled_across_hosts_the_heads_reduce_scatter_starts_before_the_backward_loop(
    monkeypatch,
):
    """2 hosts x 4 H100 (no GPU needed): in the scheduled program the head's
    reduce-scatter (vocab x d + d fp32) starts before the backward loop (the entry's
    last ``while``); without the move XLA starts it after the loop."""
    mesh = jaxsync.gpu_topology("h100", hosts=2, gpus_per_host=4)
    cfg = dataclasses.replace(llama.SIZES["quick"], batch_per_device=4, layers=6)
    policy = jaxsync.FSDP(policy=jaxsync.MixedPrecision(jnp.bfloat16))
    text = lowered_llama_step(mesh, policy, size=cfg).compile().as_text()
    entry = text[text.index("\nENTRY") :].splitlines()
    head = f"(f32[{cfg.vocab * cfg.d_model + cfg.d_model}]{{0}})"
    starts = [i for i, s in enumerate(entry) if "reduce-scatter-start(" in s and head in s]
    loops = [i for i, s in enumerate(entry) if " while(" in s]
    assert len(starts) == 1 and len(loops) == 2, (starts, loops)
    assert starts[0] < loops[-1]


def test_the_tie_to_the_last_matmul_takes_only_values_held_anyway():
    """A barrier makes XLA write its operands out; the tie takes those of the last
    matmul only where they are held anyway (the loop's operands, a matmul's or a
    collective's result, through renames and calls), never a concatenation XLA would
    fuse into the matmul (GPT 6.7B, 64 x H100: +12.5 GB of kernel bytes when it did)."""
    from jaxsync._src.program.grad_rows import _RENAMES, _materialized
    from jaxsync._src.program.reach import back_through

    def f(x, w):
        cat = jnp.concatenate([x, x], axis=-1)
        prod = x @ w
        called = jax.jit(lambda a, b: (a @ b).reshape(-1))(x, w)
        fused = jax.jit(lambda a: jnp.concatenate([a, a]))(x)
        return cat, prod.reshape(-1), called, fused, jnp.tanh(prod)

    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((4, 4))).jaxpr
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    roots = [back_through(v, made, _RENAMES)[-1] for v in jaxpr.outvars]
    got = [_materialized(r, made) for r in [*jaxpr.invars, *roots]]
    assert got == [True, True, False, True, True, False, False], got


_TWO_PROCESS_JOB = """
import sys
from functools import partial

import jax, jax.numpy as jnp, numpy as np, optax
import jaxsync

jaxsync.initialize()
sys.path.insert(0, sys.argv[1])
import llama
from jaxsync._src.program import grad_rows

real, tied = grad_rows.ready_reductions, []
def spy(*args):
    out = real(*args)
    tied.append(len(out[2]))
    return out
grad_rows.ready_reductions = spy
real_tie, ties = grad_rows._tie, []
def tie_spy(head, front):
    found = real_tie(head, front)
    ties.append(found is not None)
    return found
grad_rows._tie = tie_spy

cfg = llama.Config(vocab=512, seq=128, d_model=64, heads=4, kv_heads=2, ffn=128, layers=6,
                   batch_per_device=2)
mesh = jax.make_mesh((jax.device_count(),), ("data",))
loss = partial(llama.scanned_loss, heads=cfg.heads, kv_heads=cfg.kv_heads, dtype=jnp.float32)
tx = optax.sgd(0.5)
step = jaxsync.train_step(loss, tx, mesh, "fsdp", stacked="blocks")
state = step.init(llama.device_params(cfg))
toks = np.asarray(jax.random.randint(jax.random.key(1), (2, 16, cfg.seq + 1), 0, cfg.vocab))
half = 16 // jax.process_count()
for b in toks:
    state, _ = step(state, jaxsync.shard_batch(b[jax.process_index() * half :][:half], mesh))
got = jax.experimental.multihost_utils.process_allgather(step.params(state), tiled=True)
ref, opt = llama.device_params(cfg), tx.init(llama.device_params(cfg))
for b in toks:
    u, opt = tx.update(jax.grad(loss)(ref, b), opt, ref)
    ref = optax.apply_updates(ref, u)
err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(r)) / (2e-6 + 2e-5 * np.abs(r))))
          for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True))
print(f"process {jax.process_index()}: tied {tied}, matmul tie {ties}, error {err:.3f} of tol")
"""


@pytest.mark.multiprocess
def test_in_a_real_two_process_job_the_heads_reduction_runs_beside_the_first_layer(tmp_path):
    """Two processes of 4 CPU devices (``jaxsync.launch``, gloo): the data axis leaves a
    process, so the head's reduction moves beside the first layer on both, and each
    layer's reduction ends before the next layer's last matmul, with nothing patched;
    the FSDP step still matches one-device optax (SGD)."""
    import subprocess

    job = tmp_path / "job.py"
    job.write_text(_TWO_PROCESS_JOB)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # fmt: skip
    bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks")
    out = subprocess.run(
        [sys.executable, "-m", "jaxsync.launch", "--nproc", "2", "--devices-per-proc", "4",
         str(job), bench],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ": tied [" in ln]
    assert len(lines) == 2, out.stdout[-3000:]
    for line in lines:
        assert ": tied [1], matmul tie [True]" in line, line
        assert float(line.split("error ")[1].split()[0]) <= 1.0, line

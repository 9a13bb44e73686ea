"""Repricing XLA's schedule: asynchronous copies at their bytes, kernels at measured times.

XLA's latency estimator has no rule for an asynchronous op that is not a collective
and charges each a flat 5000 cycles (5 ms on the H100 target). A dynamic slice run
on another stream (``compute_on("gpu_stream:1")`` with XLA's stream annotations on)
is such an op on this jaxlib, compiled for 2 compile-only H100s. Each test works its
expected figures out by hand from the HLO shapes and the target's bandwidth.
"""

import glob
import os
import tempfile

import jax
import jax.numpy as jnp
import pytest
from helpers import lower_on_h100s
from jax._src.compute_on import compute_on

import jaxsync
from jaxsync._src.gpu.read import _Program, read_schedule
from jaxsync._src.gpu.repricing import async_bytes, kernel_table, profile_text, unwalked
from jaxsync._src.gpu.textproto import parse

pytestmark = pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin (`make test` installs it)",
)
L, M, D = 8, 4096, 4096  # a bf16 [L, M, D] stack; one [M, D] layer is 32 MiB
STREAMS = {"xla_gpu_experimental_stream_annotation": True}
H100 = jaxsync.GPUS["h100"]
# One layer read out of the stack and written out (2 x 32 MiB), and the s32 index.
SLICE_BYTES = 2 * M * D * 2 + 4


def _layer(stack, i):
    with compute_on("gpu_stream:1"):  # an asynchronous dynamic slice
        return jax.lax.dynamic_index_in_dim(stack, i, 0, keepdims=False)


def _lower(fn, *shapes):
    return lower_on_h100s(fn, *shapes, gpus=2)


STACK, INDEX = ((L, M, D), jnp.bfloat16), ((), jnp.int32)
G, W = ((1 << 22,), jnp.float32), ((D, D), jnp.bfloat16)


def _exposed(stack, i, g):
    """The slice, then what needs it, then an all-reduce of what that gave: nothing
    can run beside the slice, so its whole time is exposed."""
    s = _layer(stack, i).astype(jnp.float32).sum()
    return jax.lax.psum(g * s, "data").sum()


@pytest.fixture(scope="module")
def exposed():
    return jaxsync.schedule_report(_lower(_exposed, STACK, INDEX, G), options=STREAMS)


def test_an_async_slice_is_repriced_at_its_bytes_over_the_bandwidth(exposed):
    (op,) = exposed.async_ops
    assert op.runs == 1
    assert op.bytes == SLICE_BYTES
    assert exposed.bandwidth == H100.memory_bandwidth
    assert op.repriced_us == pytest.approx(SLICE_BYTES / 3.35e12 * 1e6)  # 20.03 us
    assert op.xla_us == pytest.approx(5000.0, abs=1.0)  # XLA's flat charge


def test_the_step_loses_what_xla_charged_beyond_the_bytes(exposed):
    (op,) = exposed.async_ops
    # Nothing beside the slice: the walk waited XLA's 5 ms, the repriced walk its
    # 20 us; every other instruction (the all-reduce's latency too) is as it was.
    assert exposed.walk_us - exposed.repriced_us == pytest.approx(
        op.xla_us - op.repriced_us, abs=1.0
    )
    # XLA's own readings are kept: its timeline still carries the 5 ms.
    assert exposed.makespan_us > 5000.0 > 10 * exposed.repriced_us
    (coll,) = exposed.collectives
    assert coll.kind == "all-reduce"
    assert exposed.measured_us == 0.0
    assert "1 asynchronous non-collective ops" in exposed.summary()


def test_a_slice_hidden_behind_compute_costs_nothing():
    """Two matmuls (about 0.35 ms) scheduled beside the slice: repriced at 20 us it
    waits for nothing, so the repriced step is the sum of its instructions' times."""

    def hidden(stack, i, w, g):
        part = _layer(stack, i).astype(jnp.float32).sum()
        a = jnp.tanh(jnp.tanh(w @ w) @ w)
        return part + a.astype(jnp.float32).sum() + jax.lax.psum(g, "data").sum()

    r = jaxsync.schedule_report(_lower(hidden, STACK, INDEX, W, G), options=STREAMS)
    (op,) = r.async_ops
    (body,) = r.computations
    busy = sum(h.us for h in r.hotspots)  # every kernel's modeled time, once each
    assert r.makespan_us > 5000.0  # XLA: the slice's 5 ms, the matmuls inside it
    assert r.repriced_us < busy + 0.1 * (r.makespan_us - busy)
    assert r.repriced_us >= busy
    assert body.repriced_us == r.repriced_us


def test_a_collective_inside_the_slices_span_keeps_its_latency():
    """An all-reduce independent of the slice: XLA puts it inside the slice's 5 ms.
    Repriced, the slice (20 us) and the reduce of it (10 us) fit inside the
    all-reduce's 0.1 ms, so the step is what the all-reduce's half of the program
    costs alone: the all-reduce keeps its latency."""

    def both(stack, i, g):
        return _layer(stack, i).astype(jnp.float32).sum() + jax.lax.psum(g, "data").sum()

    r = jaxsync.schedule_report(_lower(both, STACK, INDEX, G), options=STREAMS)
    alone = jaxsync.schedule_report(_lower(lambda g: jax.lax.psum(g, "data").sum(), G))
    (op,) = r.async_ops
    (coll,) = r.collectives
    assert op.xla_us > coll.modeled_us > 3 * op.repriced_us
    assert alone.async_ops == () and alone.exposed_us["all-reduce"] > 90.0
    assert r.makespan_us > 5000.0
    assert r.repriced_us == pytest.approx(alone.walk_us, abs=2.0)


def test_in_a_loop_each_iteration_is_repriced():
    def loop(stack, g):
        def body(acc, i):
            return acc + _layer(stack, i).astype(jnp.float32).sum(), None

        acc, _ = jax.lax.scan(body, jnp.zeros(()), jnp.arange(L))
        return jax.lax.psum(g * acc, "data").sum()

    r = jaxsync.schedule_report(_lower(loop, STACK, G), options=STREAMS)
    (op,) = r.async_ops
    assert op.runs == L
    assert op.bytes == SLICE_BYTES
    # XLA schedules this loop body only in the pricing twin (its probe in it): its
    # timeline charges 5 ms per iteration. The body's kernels all wait on the slice,
    # so the repriced body is their sum (its walk_us, the probe left out) plus the
    # slice's 20 us, every iteration.
    (body,) = [c for c in r.computations if c.name == op.computation]
    assert body.runs == L
    assert body.repriced_us == pytest.approx(body.walk_us + op.repriced_us, abs=1.0)
    assert body.span_us > 5000.0 > 100 * body.repriced_us
    assert r.makespan_us - r.repriced_us > L * (op.xla_us - op.repriced_us) - L * 20.0


def test_collectives_alone_are_not_repriced():
    def rs(g, w):
        return jnp.tanh(w @ w).sum() + jax.lax.psum_scatter(g, "data", tiled=True).sum()

    r = jaxsync.schedule_report(_lower(rs, G, W))
    assert r.async_ops == ()
    assert r.repriced_us == pytest.approx(r.walk_us)


# ------------------------------------------------------------- kernel times
def _times(report):
    return {h.name: h.us for h in report.hotspots}


def test_measured_kernel_times_replace_the_modeled_ones(exposed):
    """A synthetic table read on the same dump (no recompile): the reduce after the
    slice is on the critical path, so the step moves by exactly the difference."""
    text, memory = _dump(_exposed, STACK, INDEX, G)
    base = read_schedule(text, memory, H100)
    (name, modeled), *_ = sorted(_times(base).items(), key=lambda kv: -kv[1])
    table = {name: modeled + 250.0, "not.in.this.program": 1.0}
    r = read_schedule(text, memory, H100, kernel_times=table)
    assert r.repriced_us - base.repriced_us == pytest.approx(250.0, abs=1e-6)
    assert r.measured_us == pytest.approx(modeled + 250.0)
    assert r.measured_share == pytest.approx((modeled + 250.0) / r.repriced_us)
    assert r.step_us == base.step_us and r.makespan_us == base.makespan_us  # XLA's


def _called(text, name):
    """The names of the instructions inside the computations ``name`` calls."""
    prog = _Program(text)
    (inst,) = [i for i in prog.insts.values() if i.one("name") == name]
    return [i.one("name") for c in inst.all("called_computation_ids")
            for i in prog.comps[c].all("instructions")]  # fmt: skip


def test_a_time_named_inside_a_fusion_is_charged_to_the_fusion():
    """A profile names a kernel by the instruction that launched it, which may sit
    inside the fusion the schedule runs (a cuBLAS call in a dynamic-slice fusion on
    JAX 0.11): the walk charges it to that fusion, as if the table named the fusion."""
    text, memory = _dump(_exposed, STACK, INDEX, G)
    base = read_schedule(text, memory, H100)
    fusions = [(n, us) for n, us in _times(base).items() if _called(text, n)]
    name, modeled = max(fusions, key=lambda kv: kv[1])
    inner = _called(text, name)
    direct = read_schedule(text, memory, H100, kernel_times={name: modeled + 250.0})
    split = {inner[0]: modeled + 200.0, inner[-1]: 50.0}  # two of its kernels, summed
    lifted = read_schedule(text, memory, H100, kernel_times=split)
    assert lifted.repriced_us == pytest.approx(direct.repriced_us)
    assert lifted.repriced_us - base.repriced_us == pytest.approx(250.0, abs=1e-6)
    assert lifted.measured_us == pytest.approx(modeled + 250.0)


def test_unwalked_is_what_a_profile_holds_beyond_the_walk():
    """``unwalked``: per profiled op, its time per step less what the walk charges it
    (lifted to the instruction the step runs, times its runs): nothing for an op the
    walk charges in full, all of an op no computation holds, the rest of one whose
    per-run time undercounts."""
    text, memory = _dump(_exposed, STACK, INDEX, G)
    prog = _Program(text)
    base = read_schedule(text, memory, H100)
    name = next(n for n in _times(base) if _called(text, n))  # a fusion, run once
    inner = _called(text, name)[-1]
    per_step = {inner: 30.0, "not.in.this.program": 5.0}
    gaps = unwalked(per_step, per_step, prog.comps, prog.runs)
    assert gaps == {inner: pytest.approx(0.0), "not.in.this.program": 5.0}
    assert unwalked(per_step, {inner: 10.0}, prog.comps, prog.runs)[inner] == pytest.approx(20.0)


def test_an_async_ops_measured_time_replaces_its_bytes_price(exposed):
    """The kernel an asynchronous slice runs (named inside its async computation, as a
    profile names it) prices the op at its measured time; the slice is exposed, so the
    step moves by the difference from its bytes price."""
    text, memory = _dump(_exposed, STACK, INDEX, G)
    base = read_schedule(text, memory, H100)
    (op,) = base.async_ops
    inner = [n for n in _called(text, op.name) if not n.startswith("param")]
    r = read_schedule(text, memory, H100, kernel_times={inner[-1]: 60.0})
    assert r.async_ops[0].repriced_us == pytest.approx(60.0)
    assert r.repriced_us - base.repriced_us == pytest.approx(60.0 - op.repriced_us, abs=1e-6)


def test_xla_reads_the_same_table_as_a_profile(exposed):
    """schedule_report hands the table to XLA's profile-guided latency estimator: its
    own timeline then prices the kernel at the measured time."""
    name, modeled = max(_times(exposed).items(), key=lambda kv: kv[1])
    r = jaxsync.schedule_report(_lower(_exposed, STACK, INDEX, G), options=STREAMS,
                                kernel_times={f"fp::{name}": 777.0})  # fmt: skip
    assert _times(r)[name] == pytest.approx(777.0, abs=0.01)
    assert r.measured_us == pytest.approx(777.0)
    assert r.kernel_table == 1


def test_kernel_table_formats_and_errors(tmp_path):
    table = {"fusion.3": 41.5, "custom-call.2": 7}
    path = tmp_path / "profile.pbtxt"
    path.write_text(profile_text(table))
    assert kernel_table(path) == kernel_table(str(path)) == {"fusion.3": 41.5, "custom-call.2": 7.0}
    assert kernel_table(profile_text(table)) == kernel_table(table)
    for bad in ({"fusion.3": -1.0}, {"fusion.3": float("nan")}, {3: 1.0}, "no profile here"):
        with pytest.raises(ValueError, match="kernel_times"):
            kernel_table(bad)
    with pytest.raises(TypeError, match="kernel_times"):
        kernel_table([("fusion.3", 1.0)])


def _dump(fn, *shapes):
    """The schedule dump's text and memory analysis of ``fn``'s program."""
    with tempfile.TemporaryDirectory() as d:
        compiled = _lower(fn, *shapes).compile(
            compiler_options={**jaxsync.SCHEDULE_OPTIONS, **STREAMS, "xla_dump_to": d}
        )
        (path,) = glob.glob(os.path.join(d, "*.schedule.txt"))
        with open(path) as f:
            return f.read(), compiled.memory_analysis()


def _inst(id_, op, dtype, dims, operands=(), called=(), number=None):
    shape = f"shape {{ element_type: {dtype} " + "".join(f"dimensions: {d} " for d in dims) + "}"
    fields = [f"id: {id_}", f'opcode: "{op}"', f'name: "{op}.{id_}"', shape]
    fields += [f"operand_ids: {o}" for o in operands]
    fields += [f"called_computation_ids: {c}" for c in called]
    fields += [f"parameter_number: {number}"] if number is not None else []
    return "instructions { " + " ".join(fields) + " }"


def test_an_in_place_update_counts_its_update_only():
    """An async op whose fusion writes one row into a [8, 1024] bf16 buffer in place:
    it reads the row (2 KiB) and the index (4 B) and writes the row, and reads none
    of the buffer; a slice fusion reads and writes its slice (checked on the HLO
    protos by hand, no compile)."""
    fused = " ".join([
        _inst(1, "parameter", "BF16", (8, 1024), number=0),
        _inst(2, "parameter", "BF16", (1, 1024), number=1),
        _inst(3, "parameter", "S32", (), number=2),
        _inst(4, "constant", "S32", ()),
        _inst(5, "dynamic-update-slice", "BF16", (8, 1024), operands=(1, 2, 3, 4)),
    ])  # fmt: skip
    wrapper = " ".join([
        _inst(11, "parameter", "BF16", (8, 1024), number=0),
        _inst(12, "parameter", "BF16", (1, 1024), number=1),
        _inst(13, "parameter", "S32", (), number=2),
        _inst(14, "fusion", "BF16", (8, 1024), operands=(11, 12, 13), called=(1,)),
    ])  # fmt: skip
    text = (f"c {{ id: 1 {fused} }} c {{ id: 2 {wrapper} }} "
            + _inst(21, "async-start", "BF16", (8, 1024), called=(2,))
            + " " + _inst(22, "async-done", "BF16", (8, 1024), operands=(21,)))  # fmt: skip
    proto = parse(text)
    comps = {c.one("id"): c for c in proto.all("c")}
    insts = {i.one("id"): i for c in comps.values() for i in c.all("instructions")}
    insts.update({i.one("id"): i for i in proto.all("instructions")})
    assert async_bytes(insts[21], insts[22], comps, insts) == 2 * 1024 * 2 + 4

"""memory_report: the buffers live at a program's peak, read from XLA's own dumps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_loss, mlp_params, state_bytes_on_device

import jaxsync


def test_names_the_largest_temporary_by_shape_size_and_operation():
    # x @ x.T is [512, 512] f32 (1 MiB), and so is its sine, which the second matmul
    # reads: the one large temporary of this program (XLA may write one over the other).
    x = jnp.ones((512, 256), jnp.float32)
    lowered = jax.jit(lambda x: jnp.sum(jnp.sin(x @ x.T) @ x)).lower(x)
    report = jaxsync.memory_report(lowered)
    stats = lowered.compile().memory_analysis()
    assert report.arguments == stats.argument_size_in_bytes == x.nbytes
    assert report.temps == stats.temp_size_in_bytes
    top = report.buffers[0]
    assert (top.bytes, top.shape, top.argument) == (512 * 512 * 4, "f32[512,512]", False)
    assert top.made_by.split("/")[-1] in ("sin", "dot_general")
    (arg,) = [b for b in report.buffers if b.argument]
    assert (arg.bytes, arg.shape, arg.made_by) == (x.nbytes, "f32[512,256]", "x")
    assert report.peak == sum(b.bytes for b in report.buffers)
    # The temporaries live at the peak are what XLA allocated for them (one buffer).
    assert report.peak - report.arguments <= report.temps
    assert report.peak >= top.bytes + arg.bytes
    assert "f32[512,512]" in report.table(1)
    assert f"in {len(report.buffers) - 1} more" in report.table(1)
    assert sum(report.by_origin().values()) == report.peak
    # Its live range runs from the op that made it to the op that reads it last
    # (the first matmul's product is read by sin; sin's by the second matmul).
    made = top.made_by.split("/")[-1]
    assert top.live_from.split("/")[-1] == made
    assert top.live_to.split("/")[-1] == {"dot_general": "sin", "sin": "dot_general"}[made]
    assert (arg.live_from, arg.live_to) == ("", "")
    assert f"to {top.live_to}" in report.table(1, ranges=True)
    assert "live from" not in report.table(1)


def test_a_buffer_held_from_the_forward_into_the_backward_says_so():
    # The forward's tanh is a residual of the backward: made under jvp(), last read
    # under transpose(jvp()), and live at the peak between them.
    w = jnp.ones((256, 256), jnp.float32)

    def loss(w, x):
        h = jnp.tanh(x @ w)
        return jnp.sum(jnp.sin(h @ w.T) @ w)

    x = jnp.ones((1024, 256), jnp.float32)
    report = jaxsync.memory_report(jax.jit(jax.grad(loss)).lower(w, x))
    held = [b for b in report.buffers if not b.argument and "transpose(jvp" in b.live_to
            and "transpose" not in b.live_from]  # fmt: skip
    assert held, report.table(20, ranges=True)
    assert all(b.bytes > 0 and b.live_from for b in held)


def test_a_zero_step_s_master_shards_are_named_by_their_state_path(mesh8):
    params = mlp_params(jax.random.PRNGKey(0), sizes=(64, 96, 5))
    step = jaxsync.train_step(mlp_loss, optax.adam(1e-3), mesh8, jaxsync.ZeRO())
    state = step.init(params)
    batch = (jnp.ones((16, 64)), jnp.ones((16, 5)))
    report = jaxsync.memory_report(step.lower(state, batch))
    masters = [b for b in report.buffers if b.made_by.startswith("state.opt_state.master")]
    assert masters and all(b.argument for b in masters)
    # Each is one device's shard of the master buffer: the ZeRO figure, read from
    # the arrays themselves.
    dev = mesh8.devices.flat[0]
    assert sum(b.bytes for b in masters) == state_bytes_on_device(state.opt_state.master, dev)
    stats = step.lower(state, batch).compile().memory_analysis()
    assert report.arguments == stats.argument_size_in_bytes


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="jax.stages.Lowered"):
        jaxsync.memory_report(lambda x: x)
    lowered = jax.jit(lambda x: x + 1).lower(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="`options` must be a mapping"):
        jaxsync.memory_report(lowered, options=["xla_foo"])


ASSIGNMENT = """BufferAssignment:
allocation 0: size 262144,{page} parameter 0, shape |f32[256,256]| at ShapeIndex {{}}:
 value: <20 param.2 @0> (size=262144,offset=0): f32[256,256]{{1,0}}
allocation 1: size 1048576,{page} preallocated-temp:
 value: <7 fusion.3 @0> (size=1048576,offset=0): f32[512,512]{{1,0}}
 value: <9 fusion.5 @0> (size=4096,offset=1048064): f32[1024]{{0}}
allocation 2: size 4,{page} output shape is |f32[]|, maybe-live-out:
 value: <23 input_reduce_fusion @0> (size=4,offset=0): f32[]
"""


@pytest.mark.parametrize("page", ["", " page 0,"])
def test_the_buffer_assignment_is_read_with_or_without_pages(page):
    """XLA of jax 0.12 writes each allocation's page (`size N, page 0, ...`); the
    temporaries and arguments read the same either way."""
    from jaxsync._src.gpu.peak import _values

    temps, args, shapes, phis = _values(ASSIGNMENT.format(page=page))
    assert temps == [("fusion.3{}", 1048576, 0), ("fusion.5{}", 4096, 1048064)]
    assert args == [(0, 262144, "f32[256,256]")]
    assert shapes["fusion.3{}"] == "f32[512,512]{1,0}"
    assert phis == set()
    # a loop's carried value (XLA writes it with "(phi)") is a temporary too
    temps, _, _, phis = _values(ASSIGNMENT.format(page=page) + LOOP)
    assert ("while.3{2}", 1048576, 0) in temps and phis == {"while.3{2}"}


LOOP = """allocation 3: size 1048576, preallocated-temp:
 value: <31 while.3{2} (phi) @0> (size=1048576,offset=0): f32[512,512]{1,0}
"""


def test_a_stack_a_backward_loop_carries_is_live_at_its_peak():
    """A forward scan writes the layer inputs [L, rows, d] (remat saves them) and the
    backward scan carries them to its end: the peak inside the backward holds the stack
    (XLA passes it on through the loops' carried values, its phis)."""
    L, rows, d = 8, 1024, 256
    ws = jnp.ones((L, d, d), jnp.float32) * 0.01

    def loss(ws, x):
        body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    x = jnp.ones((rows, d), jnp.float32)
    report = jaxsync.memory_report(jax.jit(jax.grad(loss)).lower(ws, x))
    stack = [b for b in report.buffers if b.shape == f"f32[{L},{rows},{d}]" and not b.argument]
    assert stack, report.table(10, ranges=True)
    assert "transpose(jvp" in stack[0].live_to and "transpose" not in stack[0].live_from
    assert "jvp()" in stack[0].made_by and "transpose" not in stack[0].made_by


@pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin (`make test` installs it)",
)
def test_on_a_gpu_target_it_reports_the_program_schedule_report_prices():
    """Without a GPU, XLA's Triton gemm fusions get placeholder tiles; the schedule
    (and ``bench_gpu``'s memory column) sends matmuls to cuBLAS, and so does the report
    by default: the same temporaries, 9 in 10 of their bytes live at its peak. Asked for, the
    Triton program is another one (more temporaries on this step)."""
    from helpers import lowered_llama_step

    lowered = lowered_llama_step(jaxsync.gpu_topology("h100", gpus_per_host=2), "zero")
    report = jaxsync.memory_report(lowered)
    schedule = jaxsync.schedule_report(lowered, twin=False)  # its memory: no second compile
    assert report.temps == schedule.memory["temps"]
    assert 0.9 * report.temps <= report.peak - report.arguments <= report.temps
    triton = jaxsync.memory_report(lowered, options={"xla_gpu_enable_triton_gemm": True})
    assert triton.temps > report.temps

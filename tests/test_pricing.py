"""The pricing twin: every kernel of a GPU step priced by XLA's own cost model.

XLA's scheduler prices only computations that hold something asynchronous; the
twin (`jaxsync._src.gpu.twin`) adds a probe collective to every loop body so the
rest is priced too. These tests check by hand, on small programs compiled for a
compile-only 8 x H100 mesh, that the same kernel gets the same price wherever it
sits, that a loop costs its body times its trip count, and that the probe itself
is never charged.
"""

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.gpu.twin import PROBE, pricing_twin

pytestmark = pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin (`make test` installs it)",
)
D = 4096


def _gspmd_loop(mesh, trips: int):
    """A GSPMD program (no shard_map): a matmul in a loop with no collective, and the
    same matmul once more outside it."""

    def f(x, w):
        y = jax.lax.fori_loop(0, trips, lambda _, h: jnp.tanh(h @ w), x)
        return jnp.tanh(y @ w)

    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    args = (
        jax.ShapeDtypeStruct((8 * 1024, D), jnp.bfloat16, sharding=sh(P("data"))),
        jax.ShapeDtypeStruct((D, D), jnp.bfloat16, sharding=sh(P())),
    )
    return jax.jit(f).lower(*args)


def _matmuls(report):
    return [h for h in report.hotspots if "dot_general" in h.op_name]


def test_the_same_kernel_gets_the_same_price_in_and_out_of_a_loop():
    mesh = jaxsync.gpu_topology("h100")
    r = jaxsync.schedule_report(_gspmd_loop(mesh, trips=5))
    # The loop body has nothing asynchronous: without the twin it would be roofline.
    assert r.roofline_us == 0.0 and r.xla_share == 1.0
    loop = [c for c in r.computations if c.runs >= 4 and c.own_us > 1]
    assert loop and all(c.source == "xla" for c in r.computations)
    inside = [h for h in _matmuls(r) if h.runs >= 4]
    outside = [h for h in _matmuls(r) if h.runs == 1]
    assert inside and outside
    assert inside[0].us == pytest.approx(outside[0].us, rel=1e-9)
    # 1024 x 4096 x 4096 per GPU: XLA prices it near 2*M*K*N at the bf16 peak (35 us)
    peak_us = 2 * 1024 * D * D / (jaxsync.GPUS["h100"].bf16_dense_tflops * 1e12) * 1e6
    assert 0.8 * peak_us < outside[0].us < 2.5 * peak_us
    assert not any(PROBE in h.op_name for h in r.hotspots)
    assert r.step_us == pytest.approx(sum(c.own_us * c.runs for c in r.computations))


def test_a_loop_is_priced_its_body_times_its_trip_count():
    mesh = jaxsync.gpu_topology("h100")
    short, long = (jaxsync.schedule_report(_gspmd_loop(mesh, t)) for t in (3, 9))
    body = lambda r: max(r.computations, key=lambda c: c.own_us * c.runs)  # noqa: E731
    assert body(short).own_us == pytest.approx(body(long).own_us, rel=1e-9)
    # six more iterations cost six more bodies, to the last microsecond
    loop_delta = body(long).own_us * body(long).runs - body(short).own_us * body(short).runs
    assert loop_delta == pytest.approx(6 * body(short).own_us, rel=1e-9)
    assert long.step_us - short.step_us == pytest.approx(loop_delta, rel=0.02)


def test_a_one_gpu_program_with_no_collective_is_priced_whole_by_xla():
    """Replicated everywhere, nothing asynchronous: XLA schedules nothing, not even the
    entry. The twin prices it; a second matmul in sequence doubles the matmul time."""
    mesh = jaxsync.gpu_topology("h100", gpus_per_host=2)
    sh = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((2048, D), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((D, D), jnp.bfloat16, sharding=sh)
    one = jaxsync.schedule_report(jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(x, w))
    two = jaxsync.schedule_report(jax.jit(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w)).lower(x, w))
    for r in (one, two):
        assert r.xla_share == 1.0 and r.exposed_total_us == 0.0
        assert not r.collectives  # the probe's all-reduce is not the program's
    (mm,) = _matmuls(one)
    assert [h.us for h in _matmuls(two)] == pytest.approx([mm.us, mm.us], rel=1e-9)
    # the second layer adds its matmul and a tanh over [2048, 4096] (bf16 in and out)
    tanh_floor_us = 2 * 2048 * D * 2 / jaxsync.GPUS["h100"].memory_bandwidth * 1e6
    assert mm.us + tanh_floor_us <= two.step_us - one.step_us < 1.5 * (mm.us + tanh_floor_us)


def test_the_twin_is_a_copy_with_a_probe_in_every_loop():
    mesh = jaxsync.gpu_topology("h100")

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    def f(x, w):  # inside shard_map: the probe is the manual kind
        inner = lambda _, h: jax.lax.fori_loop(0, 2, lambda _, g: g @ w, h)  # noqa: E731
        return jax.lax.fori_loop(0, 3, inner, x)

    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    lowered = jax.jit(f).lower(
        jax.ShapeDtypeStruct((8 * 256, 256), jnp.bfloat16, sharding=sh(P("data"))),
        jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=sh(P())),
    )
    before = lowered.as_text()
    twin, probed, skipped = pricing_twin(lowered)
    assert (probed, skipped) == (2, 0)
    assert lowered.as_text() == before  # the user's lowering is untouched
    assert twin.as_text().count(f"call @{PROBE}_manual") == 4  # two bodies, two conditions
    r = jaxsync.schedule_report(lowered)
    assert r.xla_share == 1.0
    inner_body = [c for c in r.computations if c.runs == 6]
    assert inner_body and inner_body[0].source == "xla"


def test_no_twin_for_a_program_on_one_device():
    mesh = jaxsync.gpu_topology("h100", gpus_per_host=1)
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    assert pricing_twin(jax.jit(jnp.sin).lower(x)) is None

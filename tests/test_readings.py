"""The two readings of a schedule report, pinned on small programs (8 x H100, compile-only).

XLA's scheduler statistics (``step_us``) walk a computation's instruction order,
adding each instruction's cost and, at an async done, what is left of its latency;
but XLA walks the order from before its latency-hiding scheduler installed its own,
in which these programs' reduce-scatter start and done sit side by side. The
timeline (``makespan_us``) is the schedule itself. So a reduce-scatter that the
scheduler overlaps with independent matmuls is credited on the timeline and charged
whole in the statistics. ``walk_us`` replays the statistics' rule on the scheduled
order and reads with the timeline.

Every tolerance comes from the same kernels priced alone in this session: the
reduce-scatter alone (its latency L all exposed, nothing beside it) and the matmuls
alone. These tests fail if XLA changes either reading: statistics computed on the
scheduled order would read near the timeline, a whole L under what
``test_..._charge_it_whole`` asserts; a timeline that stopped crediting the overlap
would read a whole L over what it asserts of the timeline. (Checked by reading
``step_us`` as the walk: the first test then fails, 494 us against 700 +- 10 us.)
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import lower_on_h100s

import jaxsync

pytestmark = pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin (`make test` installs it)",
)
S = 16_000_000 // 64 * 64  # fp32 elements reduce-scattered (64 MB): L ~ 0.2 ms
M, D = 4096, 4096  # a [M, D] @ [D, D] bf16 matmul: ~0.2 ms, so two hide L
TRIPS = 4


def _rs(g):
    return jax.lax.psum_scatter(g * 1.0001, "data", scatter_dimension=0, tiled=True)


def _matmuls(a, w):
    return jnp.tanh(jnp.tanh(a @ w) @ w)


def _report(fn, *shapes):
    """``fn`` inside shard_map over 8 compile-only H100s, every input replicated."""
    return jaxsync.schedule_report(lower_on_h100s(fn, *shapes, gpus=8))


A, W, G = ((M, D), jnp.bfloat16), ((D, D), jnp.bfloat16), ((S,), jnp.float32)


@pytest.fixture(scope="module")
def rs_alone():
    """The reduce-scatter priced alone: (its step, its latency L, a tolerance of L/20).

    Alone, nothing can overlap it: both readings charge L whole. The tolerance
    covers the scheduler's one-cycle edges (one per few instructions) and the
    estimator's sub-microsecond drift of L between programs."""
    r = _report(lambda g: _rs(g)[:8].sum(), G)
    latency = r.exposed_us["reduce-scatter"]
    assert latency > 0.5 * r.step_us  # the program is mostly the collective's latency
    assert r.makespan_us == pytest.approx(r.step_us, abs=latency / 20)
    return r.step_us, latency, latency / 20


def test_the_timeline_credits_an_overlapped_reduce_scatter_the_statistics_charge_it_whole(
    rs_alone,
):
    rs_us, latency, tol = rs_alone
    compute_us = _report(_matmuls, A, W).step_us
    assert compute_us > latency  # enough independent compute to hide it whole

    def both(a, w, g):
        return _matmuls(a, w), _rs(g)[:8].sum()

    r = _report(both, A, W, G)
    (rs,) = r.collectives
    assert rs.overlap_us >= latency  # the scheduler put both matmuls beside it
    # The timeline, and XLA's rule walked on the scheduled order: the compute, plus
    # what the reduce-scatter costs beyond its latency (its operand, start and done).
    assert r.makespan_us == pytest.approx(compute_us + rs_us - latency, abs=tol)
    assert r.walk_us == pytest.approx(compute_us + rs_us - latency, abs=tol)
    # The statistics: the two programs added, the latency charged whole as exposed.
    assert r.step_us == pytest.approx(compute_us + rs_us, abs=tol)
    assert r.exposed_us["reduce-scatter"] == pytest.approx(latency, abs=tol)
    assert r.readings_gap < -0.8 * latency / r.step_us
    assert "the statistics price the order from before" in r.summary()


def test_in_a_loop_the_statistics_charge_the_latency_every_iteration(rs_alone):
    """A scan body reduce-scatters the carried value while a matmul runs beside it."""
    _, latency, tol = rs_alone

    def loop(a, w, g):
        def body(carry, _):
            a, g, acc = carry
            acc = acc + _rs(g)[:8].sum()
            return (jnp.tanh(a @ w), g * 0.999, acc), None

        (a, _, acc), _ = jax.lax.scan(body, (a, g, jnp.zeros(())), None, length=TRIPS)
        return a.sum() + acc

    r = _report(loop, A, W, G)
    (rs,) = r.collectives
    (body,) = [c for c in r.computations if c.name == rs.computation]
    assert body.runs == rs.runs == TRIPS
    hidden = min(rs.overlap_us, latency)  # what the schedule can hide per iteration
    assert hidden > 0.5 * latency
    # statistics: the whole latency exposed in every iteration
    assert body.exposed_us["reduce-scatter"] == pytest.approx(TRIPS * latency, abs=TRIPS * tol)
    # the walk of the scheduled order credits what sits beside it, as the timeline does
    assert body.own_us - body.walk_us == pytest.approx(hidden, abs=tol)
    assert body.span_us == pytest.approx(body.walk_us, abs=tol)
    assert r.step_us - r.walk_us == pytest.approx(TRIPS * hidden, abs=TRIPS * tol)
    # the whole timeline too, less the scheduler's one-cycle edges of every computation
    assert r.step_us - r.makespan_us > 0.8 * TRIPS * hidden

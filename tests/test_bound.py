"""The communication bound: one GPU's share of the compute, alone, against the bytes
the method must move, both priced by XLA's model for a compile-only 8 x H100 mesh."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxsync
from jaxsync import communication_bound

pytestmark = pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin (`make test` installs it)",
)
L, D = 4, 1024
BF16 = jnp.bfloat16


def loss_fn(params, tokens):
    x = params["embed"][tokens[:, :-1]]

    def body(h, w):
        w = jaxsync.tap(w)
        return h + jnp.tanh(h @ w["a"]) @ w["b"], None

    h, _ = jax.lax.scan(jax.checkpoint(body), x, params["blocks"])
    return jnp.mean(jnp.square(h.astype(jnp.float32)))


def params(dtype=BF16):
    return {
        "embed": jax.ShapeDtypeStruct((512, D), dtype),
        "blocks": {
            "a": jax.ShapeDtypeStruct((L, D, 2 * D), dtype),
            "b": jax.ShapeDtypeStruct((L, 2 * D, D), dtype),
        },
    }


def rows(n=8, seq=512):
    return jax.ShapeDtypeStruct((n, seq + 1), jnp.int32)


SIZE = 512 * D + 2 * L * 2 * D * D  # 17.3M params


@pytest.fixture(scope="module")
def mesh():
    return jaxsync.gpu_topology("h100")


@pytest.fixture(scope="module")
def bound(mesh):
    return communication_bound(loss_fn, params(), rows(), optax.adamw(1e-3), mesh)


def test_the_bound_moves_exactly_a_bf16_reduce_scatter_and_all_gather(bound):
    shard = -(-SIZE // 8)
    assert bound.moved_bytes == shard * 2 + shard * 8 * 2  # results: 1/N, then all
    assert bound.devices == 8
    assert bound.bound_us == max(bound.compute_us, bound.comm_us)
    assert bound.serial_us == bound.compute_us + bound.comm_us
    assert "bound" in str(bound) and "MiB per GPU" in str(bound)


def test_one_gpu_moves_nothing_and_computes_as_one_of_eight(bound):
    """On one GPU the bound is its compute alone (no collective to price), the same
    rows as one GPU of eight with all of the optimizer: at least as long."""
    one = communication_bound(
        loss_fn, params(), rows(), optax.adamw(1e-3), jaxsync.gpu_topology("h100", gpus_per_host=1)
    )  # fmt: skip
    assert (one.devices, one.comm_us, one.moved_bytes) == (1, 0.0, 0)
    assert one.bound_us == one.compute_us >= bound.compute_us


def test_more_rows_cost_compute_not_communication(mesh, bound):
    more = communication_bound(loss_fn, params(), rows(n=16), optax.adamw(1e-3), mesh)
    assert more.comm_us == pytest.approx(bound.comm_us, rel=1e-9)
    assert 1.5 * bound.compute_us < more.compute_us < 2.1 * bound.compute_us


def test_fp32_on_the_wire_moves_twice_the_bytes(mesh, bound):
    fp32 = communication_bound(
        loss_fn, params(), rows(), optax.adamw(1e-3), mesh,
        moves=(("reduce-scatter", jnp.float32), ("all-gather", jnp.float32)),
    )  # fmt: skip
    assert fp32.moved_bytes == 2 * bound.moved_bytes
    assert fp32.comm_us > 1.3 * bound.comm_us
    assert fp32.compute_us == pytest.approx(bound.compute_us, rel=1e-9)


def test_no_step_beats_its_bound(mesh, bound):
    """jaxsync's ZeRO step and GSPMD's jit step both take at least the bound: the
    bound is priced by the same model, so a step under it would mean a mispricing."""
    step = jaxsync.train_step(loss_fn, optax.adamw(1e-3), mesh, mode="zero", stacked="blocks")
    report = jaxsync.schedule_report(
        step.lower(step.abstract_state(params()), rows(n=64))
    )  # fmt: skip
    for reading in ("statistics", "timeline"):
        assert 0.2 < bound.efficiency(report, reading) <= 1.0
    with pytest.raises(ValueError, match="reading"):
        bound.efficiency(report, "wall")


def test_bad_input_is_named(mesh):
    with pytest.raises(ValueError, match="moves"):
        communication_bound(
            loss_fn, params(), rows(), optax.sgd(0.1), mesh, moves=(("broadcast", BF16),)
        )
    cpu = jax.make_mesh((1,), ("data",))
    with pytest.raises(ValueError, match="gpu_topology"):
        communication_bound(loss_fn, params(), rows(), optax.sgd(0.1), cpu)

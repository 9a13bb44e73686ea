"""The guard's reductions (core.tree_reduce) against numpy, and the step metrics built on them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import make_batches, mlp_loss, mlp_params
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.core.tree_reduce import nonfinite_leaves, sq_sum_and_zeros

SHAPES = [(5, 7), (3000,), (2,), (0,), (1025,), (1024,), (3, 1, 4), ()]


def _leaves(seed: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for s in SHAPES:
        x = rng.normal(size=s).astype(dtype)
        x.ravel()[rng.random(x.size) < 0.2] = 0  # exact zeros to count
        out.append(x)
    return out


def test_flags_name_exactly_the_bad_leaves():
    leaves = _leaves(0)
    # NaN, +Inf and -Inf at a leaf's first, middle and last elements, among finite
    # neighbours and exact zeros (whose `* 0` must stay a zero, not a NaN).
    leaves[1][1023] = np.nan
    leaves[4][1024] = np.inf
    leaves[5][0] = -np.inf
    leaves[7] = np.float32(np.nan)
    want = [not np.all(np.isfinite(x)) for x in leaves]
    assert want == [False, True, False, False, True, True, False, True]
    got = jax.jit(lambda *g: nonfinite_leaves(g))(*leaves)
    assert got.dtype == jnp.bool_ and got.tolist() == want
    for i in range(len(leaves)):  # one bad leaf at a time, the rest finite
        only = _leaves(1)
        if only[i].size:
            only[i].ravel()[-1] = np.nan
        got = jax.jit(lambda *g: nonfinite_leaves(g))(*only).tolist()
        assert got == [j == i and only[i].size > 0 for j in range(len(only))]


def test_flags_of_bf16_and_of_nothing():
    leaves = [jnp.asarray(x, jnp.bfloat16) for x in _leaves(2)]
    leaves[2] = leaves[2].at[1].set(jnp.inf)
    assert nonfinite_leaves(leaves).tolist() == [i == 2 for i in range(len(leaves))]
    assert nonfinite_leaves([jnp.zeros((0, 3))]).tolist() == [False]


def test_sq_sum_and_zeros_match_numpy():
    leaves = _leaves(3)
    sq, zeros = jax.jit(lambda *g: sq_sum_and_zeros(g))(*leaves)
    want_sq = sum(float(np.sum(np.square(x.astype(np.float64)))) for x in leaves)
    want_zeros = sum(int(np.sum(x == 0)) for x in leaves)
    np.testing.assert_allclose(float(sq), want_sq, rtol=1e-6)
    assert int(zeros) == want_zeros and want_zeros > 0
    assert [float(v) for v in sq_sum_and_zeros([])] == [0.0, 0.0]


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
@pytest.mark.parametrize("loss_scale", [None, 8.0])
def test_step_metrics_match_the_single_device_gradient(mesh8, mode, loss_scale):
    """The guard's norm and zero count in every mode, with and without a loss scale
    (DDP reads them from its reduced buckets, scaled, and divides the scale out),
    and the per-param NaN flags of a skipped step."""
    params = mlp_params(jax.random.PRNGKey(0))
    params["unused"] = jnp.ones((37,))  # not in the loss: exactly zero gradients
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, 16)
    batch = (np.asarray(xs[0]), np.asarray(ys[0]))
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, mode, loss_scale=loss_scale)
    state, _ = step(step.init(params), batch)
    g = jax.grad(mlp_loss)(params, batch)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    norm = np.sqrt(sum(float(np.sum(x * x)) for x in leaves))
    np.testing.assert_allclose(float(state.metrics.grad_norm), norm, rtol=1e-5)
    assert int(state.metrics.num_zeros) == sum(int(np.sum(x == 0)) for x in leaves) >= 37
    assert not bool(state.metrics.skipped)

    # A NaN in one device's rows: the step is skipped and the params it reaches are named.
    bad = (batch[0].copy(), batch[1])
    bad[0][3, 0] = np.nan  # row 3: device 1's (2 rows per device)
    before = jax.device_get(step.params(state))
    state, _ = step(state, bad)
    assert bool(state.metrics.skipped)
    after = jax.device_get(step.params(state))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    # FSDP flags its units (state.params' keys) after their reduction, where the NaN
    # has spread to every device; the others flag each param's local gradient.
    named = state.params if mode == "fsdp" else params
    report = jaxsync.nonfinite_report(state, named, mesh8)
    assert "layer0" in report and "unused" not in report, report
    if mode != "fsdp":
        assert "layer0.w on 1 device(s), first on device 1 (data=1)" in report, report
    else:
        with pytest.raises(ValueError, match="pass `state.params`"):
            jaxsync.nonfinite_report(state, params, mesh8)


@pytest.mark.parametrize("fn", [lambda g: sq_sum_and_zeros([g]), lambda g: nonfinite_leaves([g])])
def test_the_guard_makes_no_float_zeros_of_a_gradient_s_shape(fn):
    # XLA merges equal broadcasts: an fp32 zeros of the gradient's shape in the
    # guard became one buffer with the gradient accumulator's zero init, kept whole
    # beside it (one H100, 0.94B GPT, ZeRO: 3 GiB more memory, 6.4 GB more traffic).
    g = jax.ShapeDtypeStruct((65536,), jnp.float32)
    text = jax.jit(fn).lower(g).as_text()
    assert "tensor<65536xf32>" in text
    for line in text.splitlines():
        if "broadcast_in_dim" in line or "stablehlo.constant" in line:
            assert "65536xf32" not in line, line


def test_leaves_split_by_the_compiler_are_reduced_where_they_lie():
    """Inside a step's ``shard_map`` manual over "data", a leaf split over "model" by
    the compiler: concatenated, XLA gathered each leaf whole over "model" (64 x H100,
    GPT 6.7B, 2-D DDP: 8 GiB all-gathers, temporaries 29867 -> 4615 MiB without).
    The statistics still match numpy."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(4)
    leaves = [rng.normal(size=s).astype(np.float32) for s in [(6, 10), (8, 3), (4, 5, 6)]]
    for x in leaves:
        x.ravel()[rng.random(x.size) < 0.2] = 0
    specs = [P(None, "model"), P("model"), P(None, None, "model")]
    put = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)]

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"data"})
    def stats(*g):
        return sq_sum_and_zeros(g)

    hlo = stats.lower(*put).compile().as_text()
    assert "all-gather" not in hlo and "concatenate" not in hlo, hlo
    sq, zeros = stats(*put)
    want_sq = sum(float(np.sum(np.square(x.astype(np.float64)))) for x in leaves)
    np.testing.assert_allclose(float(sq), want_sq, rtol=1e-6)
    assert int(zeros) == sum(int(np.sum(x == 0)) for x in leaves) > 0

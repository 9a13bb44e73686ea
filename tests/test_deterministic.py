"""Deterministic mode: the same bits at every data-parallel size (issue #10).

Compiles are the cost here, so every training run is cached per (kind, DP size)
and shared between tests: the sweep over N, the resume and the multi-process
comparison all read the same runs.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_loss, mlp_params, run_reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

DET = jaxsync.Deterministic(units=8)
STEPS = 10
BATCH = 32
MICRO = 2
CLIP = 0.3  # below the grad norm of every step: clipping is always active
NAN_STEP = 3  # a NaN in one example: every DP size must skip this step
SIZES = (1, 2, 4, 8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mesh_of(n, devices=None):
    devices = jax.devices()[:n] if devices is None else devices
    return jax.make_mesh((n,), ("data",), devices=devices)


@functools.cache  # eager jax.random compiles an XLA program per op: build once
def model(kind="zero"):
    """The MLP; for the distributed optimizer one layer is bf16 (with an fp32 master)."""
    params = mlp_params(jax.random.PRNGKey(0))
    if kind == "zero":
        params["layer1"] = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params["layer1"])
    return params


@functools.cache
def data(kind):
    """``(xs, ys)``: ``[steps, batch, ...]`` (ddp) or ``[steps, micro, batch, ...]`` (zero)."""
    if kind == "ddp":
        return make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    xs, ys = make_batches(jax.random.PRNGKey(1), STEPS * MICRO, BATCH)
    xs = np.array(xs).reshape(STEPS, MICRO, BATCH, -1)
    xs[NAN_STEP, 1, 5, 0] = np.nan
    return xs, np.asarray(ys).reshape(STEPS, MICRO, BATCH, -1)


def make_tx(kind, det=DET):
    if kind == "zero":
        return jaxsync.distributed_optimizer(
            optax.adamw(5e-3, weight_decay=0.1),
            axis_name="data",
            clip_grad_norm=CLIP,
            # grows every 3 good steps, backs off on the NaN step
            loss_scale=jaxsync.DynamicLossScale(2.0**8, growth_interval=3, hysteresis=1),
            check_elementwise=False,  # adamw is; the probe costs seconds per mesh
            deterministic=det,
        )
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(5e-3, weight_decay=0.1))


@functools.cache
def make_step(kind, mesh, det=DET):
    """One jitted step: ``(params, state, batch) -> (params, state, loss, norm, flag)``."""
    params, tx = model(kind), make_tx(kind)
    if kind == "zero":
        specs = tx.state_specs(params, mesh)
        batch_spec = P(None, "data")
    else:
        specs = jax.tree.map(lambda _: P(), jax.eval_shape(tx.init, params))
        batch_spec = P("data")

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, batch_spec),
        out_specs=(P(), specs, P(), P(), P()),
    )
    def step(params, state, batch):
        if kind == "zero":
            scale = state.loss_scale.scale

            def scaled(p, b):
                return mlp_loss(p, b) * scale

            loss, grads = jaxsync.accumulate_grads(
                scaled, params, batch, axis_name="data", deterministic=det
            )
            updates, new_state = tx.update(grads, state, params)
            m = new_state.metrics
            loss = loss / scale
            return optax.apply_updates(params, updates), new_state, loss, m.grad_norm, m.skipped
        vg = jaxsync.value_and_grad(mlp_loss, axis_name="data", deterministic=det)
        loss, units = vg(params, batch)
        grads = jaxsync.all_reduce_grads(units, axis_name="data", deterministic=det)
        if det is None:
            loss, same = jax.lax.pmean(loss, "data"), jnp.bool_(True)
        else:  # sync_grads must give the same bits as all_reduce_grads
            synced, _ = jaxsync.sync_grads(axis_name="data", deterministic=det).update(units, None)
            pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(synced), strict=True)
            same = jnp.all(jnp.stack([jnp.all(a == b) for a, b in pairs]))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, optax.tree.norm(grads), same

    return step


def init_state(kind, mesh):
    params, tx = model(kind), make_tx(kind)
    if kind == "zero":
        return tx.sharded_init(params, mesh)
    return jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))(params)


def train(kind, mesh, params, state, lo, hi, det=DET):
    step = make_step(kind, mesh, det)
    xs, ys = data(kind)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    logs = []
    axis = 1 if kind == "zero" else 0
    # With several processes, each passes its own rows (process order = row order).
    rows = xs.shape[1 + axis] // jax.process_count()
    mine = np.arange(rows) + jax.process_index() * rows
    for i in range(lo, hi):
        batch = tuple(np.take(np.asarray(a[i]), mine, axis=axis) for a in (xs, ys))
        batch = jaxsync.shard_batch(batch, mesh, batch_axis=axis)
        params, state, *log = step(params, state, batch)
        logs.append(log)
    cols = zip(*logs, strict=True)
    return params, state, [np.stack([np.asarray(x) for x in col]) for col in cols]


def host_state(kind, state, mesh):
    """Every optimizer value per parameter, as host arrays (independent of the DP size).

    The distributed optimizer's flat shards are cut up here with numpy, not by
    ``tx.to_portable``: one bucket per buffer, so the global array is the buffer.
    """
    state = jax.tree.map(np.asarray, state)
    if kind != "zero":
        return state
    layout = make_tx(kind).layout(model(kind), mesh)

    def per_param(bi):
        buf = layout.buffers[bi]
        assert len(buf.buckets) == 1

        def split(x):
            if x.shape != (buf.size,):
                return x
            leaves = layout.unpack_leaves([[x]], [bi], np.float32)
            return {layout.slots[i].path: v for i, v in leaves.items()}

        return split

    return {
        "master": [per_param(bi)(m) for bi, m in enumerate(state.master)],
        "inner": [jax.tree.map(per_param(bi), s) for bi, s in enumerate(state.inner_state)],
        "rest": (state.loss_scale, state.metrics),
    }


@functools.cache
def run(kind, n, det=DET):
    mesh = mesh_of(n)
    params, state, logs = train(kind, mesh, model(kind), init_state(kind, mesh), 0, STEPS, det)
    return jax.tree.map(np.asarray, params), host_state(kind, state, mesh), logs


def assert_bitwise(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        assert np.array_equal(x, y, equal_nan=True), np.max(np.abs(x - y))


@pytest.mark.default_xla
@pytest.mark.parametrize("kind", ["zero", "ddp"])
def test_bitwise_identical_at_every_dp_size(kind):
    ref = run(kind, 1)
    params, state, (losses, norms, flag) = ref
    assert all(np.isfinite(losses)) == (kind == "ddp")
    finite = np.isfinite(norms)
    assert np.all(norms[finite] > CLIP)  # clipping active on every applied step
    if kind == "zero":
        assert list(np.flatnonzero(flag)) == [NAN_STEP]  # the NaN step, and only it, skipped
        scale = state["rest"][0].scale
        assert scale == 2.0**8 * 2**3 * 0.5  # 3 growths and one backoff
        assert {m.dtype for m in jax.tree.leaves(state["master"])} == {np.dtype("float32")}
    else:
        assert flag.all()  # sync_grads == all_reduce_grads, bitwise
    if kind == "zero":
        assert params["layer1"]["w"].dtype == jnp.bfloat16
    moved = np.max(np.abs(params["layer0"]["w"] - np.asarray(model()["layer0"]["w"])))
    assert moved > 1e-2
    for n in SIZES[1:]:
        assert_bitwise(run(kind, n), ref)


def test_mode_matters_and_is_correct():
    """Default mode differs across N; deterministic mode matches single-device optax
    as closely as the default mode does (fp32 DDP, 10 steps, clipping, weight decay)."""
    default8, default2 = run("ddp", 8, None), run("ddp", 2, None)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(default8[0]), jax.tree.leaves(default2[0]), strict=True)
    )
    det = run("ddp", 8)[0]
    batches = make_batches(jax.random.PRNGKey(1), STEPS, BATCH)
    ref, _ = run_reference(make_tx("ddp"), model("ddp"), batches)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-6), ref, det)

    def err(got):
        pairs = zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
        return max(float(np.max(np.abs(a - b))) for a, b in pairs)

    assert err(det) <= 2 * max(err(default8[0]), err(default2[0]))


@pytest.mark.default_xla
def test_resume_at_another_dp_size(tmp_path):
    """Saved at N=8 after 5 steps, resumed at N=2: the same bits as never stopping."""
    kind, half = "zero", STEPS // 2
    m8, m2 = mesh_of(8), mesh_of(2)
    tx = make_tx(kind)
    params, state, logs_a = train(kind, m8, model(), init_state(kind, m8), 0, half)
    with jaxsync.Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(half, params=params, opt_state=state, tx=tx, mesh=m8)
    with jaxsync.Checkpointer(tmp_path / "ckpt") as ckpt:
        r = ckpt.restore(params_like=model(kind), tx=tx, mesh=m2)
    params, state, logs_b = train(kind, m2, r.params, r.opt_state, half, STEPS)
    got = (
        jax.tree.map(np.asarray, params),
        host_state(kind, state, m2),
        [np.concatenate([a, b]) for a, b in zip(logs_a, logs_b, strict=True)],
    )
    assert_bitwise(got, run(kind, 8))


def test_exact_sum_at_least_as_accurate_as_fp32():
    """Against a float64 sum of the same unit gradients: the fixed-point sum's error
    is no larger than the default fp32 psum's (elementwise and in the norm)."""
    from jaxsync._src.deterministic.fixed_point import exact_total, unit_sum

    mesh = mesh_of(8)
    rng = np.random.default_rng(0)
    n = 4096
    # gradients spanning many orders of magnitude, with cancellation between units
    scale = 10.0 ** rng.uniform(-8, 2, size=n)
    units = (rng.standard_normal((8, n)) * scale).astype(np.float32)
    ref = units.astype(np.float64).sum(0)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=(P(), P(), P(), P()))
    def sums(u):
        exact = unit_sum(u, ("data",))[0]
        plain = jax.lax.psum(u[0], "data")
        sq = jnp.square(u[0])
        return exact, plain, exact_total([sq], ("data",)), jax.lax.psum(jnp.sum(sq), "data")

    placed = jax.device_put(units, NamedSharding(mesh, P("data")))
    exact, plain, sq_exact, sq_plain = (np.asarray(x, np.float64) for x in sums(placed))
    err_exact, err_plain = np.abs(exact - ref), np.abs(plain - ref)
    assert err_exact.max() <= err_plain.max()
    assert err_exact.mean() <= err_plain.mean()
    assert np.all(err_exact <= np.spacing(np.abs(ref).astype(np.float32)))  # <= 1 ulp
    sq_ref = np.sum(units.astype(np.float64) ** 2)
    assert abs(sq_exact - sq_ref) <= abs(sq_plain - sq_ref)
    assert abs(sq_exact - sq_ref) <= 0.5 * np.spacing(np.float32(sq_ref))  # correctly rounded


def test_bad_input_fails_with_the_size_at_fault():
    mesh = mesh_of(8)
    params = mlp_params(jax.random.PRNGKey(0))
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, 24)

    def grads_of(det, batch):
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        def f(p, b):
            loss, _ = jaxsync.value_and_grad(mlp_loss, axis_name="data", deterministic=det)(p, b)
            return loss

        return jax.jit(f).lower(params, batch)

    batch = jaxsync.shard_batch((xs[0], ys[0]), mesh)  # 3 rows per device

    def with_aux(p, b):
        loss = mlp_loss(p, b)
        return loss, {"loss": loss}

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
    def aux_of(p, b):
        vg = jaxsync.value_and_grad(with_aux, axis_name="data", has_aux=True, deterministic=DET)
        return vg(p, b)[0]

    loss, aux = jax.eval_shape(aux_of, params, jaxsync.shard_batch((xs[0], ys[0]), mesh))
    assert loss.shape == () and aux["loss"].shape == (8,)  # aux: one per unit
    with pytest.raises(ValueError, match="local batch size 3 .* divisible by 2"):
        grads_of(jaxsync.Deterministic(units=16), batch)
    with pytest.raises(ValueError, match="units=4 is not divisible by the 8 devices"):
        grads_of(jaxsync.Deterministic(units=4), batch)
    with pytest.raises(ValueError, match="units"):
        jaxsync.Deterministic(units=0)
    with pytest.raises(TypeError, match="Deterministic"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", deterministic=8)

    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    specs = tx.state_specs(params, mesh)
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, 32)

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=specs)
    def mixed(p, s, b):
        _, g = jaxsync.value_and_grad(mlp_loss, axis_name="data", deterministic=DET)(p, b)
        return tx.update(g, s, p)[1]

    with pytest.raises(TypeError, match="without `deterministic=`"):
        batch = jaxsync.shard_batch((xs[0], ys[0]), mesh)
        jax.jit(mixed).lower(params, tx.sharded_init(params, mesh), batch)
    with pytest.raises(NotImplementedError, match="sync="):
        jaxsync.value_and_grad(mlp_loss, axis_name="data", deterministic=DET, sync=tx)


# ------------------------------------------------------------- multi-process
MP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import jax, numpy as np
import jaxsync
jaxsync.initialize()
from jax.experimental import multihost_utils
import test_deterministic as t
mesh = t.mesh_of(8, jax.devices())
params, state, logs = t.train("zero", mesh, t.model(), t.init_state("zero", mesh), 0, t.STEPS)
state = multihost_utils.process_allgather(state, tiled=True)
port = t.host_state("zero", state, mesh)
params = jax.tree.map(lambda p: np.asarray(p.addressable_data(0)), params)
if jax.process_index() == 0:
    leaves = jax.tree.leaves((params, port, logs))
    np.savez({out!r}, *[np.asarray(x).astype(np.float64) for x in leaves])
print("mp done", jax.process_count(), jax.device_count(), flush=True)
"""


@pytest.mark.multiprocess
def test_two_processes_equal_one_process(tmp_path):
    """2 processes x 4 devices (gloo) against 1 process x 8 devices: the same bits."""
    out = tmp_path / "mp.npz"
    script = tmp_path / "mp.py"
    script.write_text(MP_SCRIPT.format(tests=os.path.join(ROOT, "tests"), out=str(out)))
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "jaxsync.launch", "--nproc", "2", "--devices-per-proc", "4"]
    res = subprocess.run(
        [*cmd, str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "mp done 2 8" in res.stdout
    with np.load(out) as f:
        got = [f[f"arr_{i}"] for i in range(len(f.files))]
    want = jax.tree.leaves(run("zero", 8))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, np.asarray(b).astype(np.float64), equal_nan=True)  # exact casts

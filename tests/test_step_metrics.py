"""``train_step(..., metrics=jaxsync.TrainerMetrics(...))``: update norm, param norm
and learning rate as plain optax on one device on the global batch gives them.

Every mode (DDP, ZeRO, FSDP, a 2-D mesh, ZeRO's held stacked groups), with
microbatches and an active clip, against ``optax.global_norm`` of the ``updates``
optax returns and of the params after the step, and the schedule at optax's count.
SGD shows a wrong scale of the update (a sum over devices instead of a mean, a
norm counted on every copy); adamw with a schedule shows the rate.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import (
    make_batches,
    mlp_loss,
    mlp_params,
    place_by_specs,
    scanned_batches,
    scanned_loss,
    scanned_params,
)
from jax.sharding import AxisType
from tp_gpt import gpt_batches, gpt_loss, gpt_params, tp_specs

import jaxsync

SCHEDULE = optax.linear_schedule(3e-2, 1e-2, transition_steps=3)
STEPS = 3


def optimizer(name):
    """``(tx, schedule or None)``."""
    if name == "sgd":
        return optax.sgd(0.1), None
    return optax.adamw(SCHEDULE, weight_decay=0.1), SCHEDULE


def reference(tx, params, batches, loss_fn, clip=None, schedule=None):
    """Plain optax on one device: per step ``(update norm, param norm, rate)``."""
    if clip is not None:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return params, state, optax.tree.norm(updates), optax.tree.norm(params)

    out = []
    for i, batch in enumerate(batches):
        params, state, u, p = step(params, state, batch)
        out.append((float(u), float(p), None if schedule is None else float(schedule(i))))
    return out


def run(step, params, batches):
    state = step.init(params)
    out = []
    for batch in batches:
        state, _ = step(state, batch)
        m = jax.device_get(state.metrics)
        lr = None if m.learning_rate is None else float(m.learning_rate)
        out.append((float(m.update_norm), float(m.param_norm), lr))
    return state, out


def assert_matches(got, want, rtol=2e-5):
    for i, ((gu, gp, gl), (wu, wp, wl)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(gu, wu, rtol=rtol, err_msg=f"update_norm, step {i}")
        np.testing.assert_allclose(gp, wp, rtol=rtol, err_msg=f"param_norm, step {i}")
        if wl is None:
            assert gl is None
        else:
            np.testing.assert_allclose(gl, wl, rtol=1e-6, err_msg=f"learning_rate, step {i}")


def mlp_batches(n=STEPS, rows=32):
    xs, ys = make_batches(jax.random.key(1), n, rows)
    return [(xs[i], ys[i]) for i in range(n)]


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_norms_and_rate_match_single_device_optax(mesh8, mode, opt):
    tx, schedule = optimizer(opt)
    clip = 0.5 if opt == "adamw" else None  # active: the grad norms here are ~1-2
    params, batches = mlp_params(jax.random.key(0)), mlp_batches()
    step = jaxsync.train_step(
        mlp_loss, tx, mesh8, mode, clip_grad_norm=clip, microbatches=2,
        metrics=jaxsync.TrainerMetrics(learning_rate=schedule),
    )  # fmt: skip
    state, got = run(step, params, batches)
    assert_matches(got, reference(tx, params, batches, mlp_loss, clip, schedule))
    assert float(state.metrics.grad_norm) > 0.5 or clip is None  # the clip did act
    # param_norm is the norm of what step.params reads
    want = float(optax.tree.norm(jax.device_get(step.params(state))))
    np.testing.assert_allclose(float(state.metrics.param_norm), want, rtol=2e-6)


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_rate_from_inject_hyperparams(mesh8, mode):
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, weight_decay=0.1)
    params, batches = mlp_params(jax.random.key(0)), mlp_batches()
    step = jaxsync.train_step(mlp_loss, tx, mesh8, mode, metrics=True)
    _, got = run(step, params, batches)
    assert_matches(got, reference(tx, params, batches, mlp_loss, schedule=SCHEDULE))


def test_a_constant_rate_and_none_when_unknown(mesh8):
    params, batches = mlp_params(jax.random.key(0)), mlp_batches(1)
    step = jaxsync.train_step(
        mlp_loss, optax.sgd(0.1), mesh8, "zero", metrics=jaxsync.TrainerMetrics(0.1)
    )
    state, _ = run(step, params, batches)
    assert float(state.metrics.learning_rate) == np.float32(0.1)
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, "zero", metrics=True)
    state, _ = run(step, params, batches)
    assert state.metrics.learning_rate is None and state.metrics.update_norm is not None


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_zero_held_stacked_groups(mesh8, opt):
    tx, schedule = optimizer(opt)
    xs, ys = scanned_batches(jax.random.key(1), steps=STEPS, batch=32)
    batches = [(xs[i], ys[i]) for i in range(STEPS)]
    params = scanned_params(jax.random.key(0))
    step = jaxsync.train_step(
        scanned_loss, tx, mesh8, "zero", stacked="blocks", clip_grad_norm=0.05,
        metrics=jaxsync.TrainerMetrics(learning_rate=schedule),
    )  # fmt: skip
    state, got = run(step, params, batches)
    assert type(state.params["blocks"]).__name__ == "HeldLayers"  # held as master shards
    assert_matches(got, reference(tx, params, batches, scanned_loss, 0.05, schedule))


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_two_d_mesh(mode):
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = gpt_params(jax.random.key(0))
    xs, ys = gpt_batches(jax.random.key(1), 2, 8)
    batches = [(xs[i], ys[i]) for i in range(2)]
    tx, schedule = optimizer("adamw")
    step = jaxsync.train_step(
        gpt_loss, tx, mesh, mode, stacked="blocks", clip_grad_norm=0.5,
        microbatches=2 if mode != "zero" else 1,
        metrics=jaxsync.TrainerMetrics(learning_rate=schedule),
    )  # fmt: skip
    _, got = run(step, place_by_specs(mesh, params, tp_specs()), batches)
    assert_matches(got, reference(tx, params, batches, gpt_loss, 0.5, schedule), rtol=1e-4)


def test_whole_matrix_owners(mesh8):
    """Muon as written under ZeRO: each matrix owned whole by one rank."""
    tx = optax.contrib.muon(0.02)
    params, batches = mlp_params(jax.random.key(0)), mlp_batches()
    step = jaxsync.train_step(mlp_loss, tx, mesh8, "zero", metrics=True)
    _, got = run(step, params, batches)
    assert_matches(got, reference(tx, params, batches, mlp_loss), rtol=1e-4)


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_a_skipped_step(mesh8, mode):
    """A skipped step: update_norm 0, param_norm and the rate those of the last
    applied step (the params did not move)."""
    params = mlp_params(jax.random.key(0))
    good, (x, y) = mlp_batches(1)[0], mlp_batches(1)[0]
    bad = (x.at[3, 0].set(jnp.nan), y)
    step = jaxsync.train_step(
        mlp_loss, optax.adamw(SCHEDULE), mesh8, mode,
        metrics=jaxsync.TrainerMetrics(learning_rate=SCHEDULE),
    )  # fmt: skip
    state = step.init(params)
    state, _ = step(state, good)
    before = jax.device_get(state.metrics)
    state, _ = step(state, bad)
    m = jax.device_get(state.metrics)
    assert bool(m.skipped) and int(state.step) == 1
    assert float(m.update_norm) == 0.0
    assert float(m.param_norm) == float(before.param_norm)
    assert float(m.learning_rate) == float(before.learning_rate) == np.float32(SCHEDULE(0))
    state, _ = step(state, good)  # the next applied step uses count 1
    assert float(state.metrics.learning_rate) == np.float32(SCHEDULE(1))


@pytest.mark.default_xla  # bitwise across programs of other shapes: XLA's own options
@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_deterministic_bitwise_across_dp_sizes(mode):
    """Deterministic mode through the builder: the losses, the params and the norms
    (ZeRO: summed exactly in fixed point over shards whose boundaries move with the
    DP size) and the rate are the same bits at DP 8 and 2, with clipping active, and
    mean what optax's do."""
    require_devices(8)
    params = mlp_params(jax.random.key(0))
    batches = mlp_batches(2)
    seen = []
    for n in (8, 2):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        step = jaxsync.train_step(
            mlp_loss, optax.adamw(SCHEDULE), mesh, mode, clip_grad_norm=0.5,
            deterministic=jaxsync.Deterministic(units=8),
            metrics=jaxsync.TrainerMetrics(learning_rate=SCHEDULE),
        )  # fmt: skip
        state, losses = step.init(params), []
        for batch in batches:
            state, loss = step(state, batch)
            losses.append(np.asarray(loss).tobytes())
        m = jax.device_get(state.metrics)
        assert float(m.grad_norm) > 0.5  # clipping was active
        seen.append(losses + [np.asarray(x).tobytes() for x in jax.tree.leaves(m)])
        seen[-1] += [np.asarray(x).tobytes() for x in jax.tree.leaves(step.params(state))]
    assert seen[0] == seen[1]
    want = reference(optax.adamw(SCHEDULE), params, batches, mlp_loss, 0.5, SCHEDULE)
    assert_matches([run(step, params, batches)[1][-1]], want[-1:])


def test_bf16_params_measure_the_inner_update(mesh8):
    """bf16 params: DDP's fp32 master (optim/master.py) and ZeRO's measure the same
    inner update and fp32 master, not the distance to the rounded params."""
    params = mlp_params(jax.random.key(0), dtype=jnp.bfloat16)
    batches = mlp_batches()
    got = {}
    for mode in ("ddp", "zero"):
        step = jaxsync.train_step(mlp_loss, optax.sgd(1e-3), mesh8, mode, metrics=True)
        state, got[mode] = run(step, params, batches)
        master = jax.device_get(step.master(state))
        np.testing.assert_allclose(got[mode][-1][1], float(optax.tree.norm(master)), rtol=1e-6)
    assert_matches(got["ddp"], got["zero"], rtol=1e-5)
    # sgd(1e-3): the update is 1e-3 * grad norm, far below bf16's spacing of the params
    grad_norm = float(state.metrics.grad_norm)
    np.testing.assert_allclose(got["zero"][-1][0], 1e-3 * grad_norm, rtol=1e-5)


def collectives(step, state, batch):
    stats = jaxsync.collective_stats(step.lower(state, batch).compile().as_text())
    return {k: v.count for k, v in stats.items()}


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_off_by_default_and_one_small_all_reduce_when_on(mesh8, mode):
    params, batches = mlp_params(jax.random.key(0)), mlp_batches(1)
    off = jaxsync.train_step(mlp_loss, optax.adamw(1e-2), mesh8, mode)
    state = off.init(params)
    m = state.metrics
    assert (m.update_norm, m.param_norm, m.learning_rate) == (None, None, None)
    assert len(jax.tree.leaves(m)) == 7  # no leaf for them: the seven fields as before
    on = jaxsync.train_step(mlp_loss, optax.adamw(1e-2), mesh8, mode, metrics=True)
    on_state = on.init(params)
    assert len(jax.tree.leaves(on_state)) == len(jax.tree.leaves(state)) + 2  # no rate found
    got, want = collectives(on, on_state, batches[0]), collectives(off, state, batches[0])
    if mode != "ddp":  # the norms of the shards: one all-reduce (of two floats) more
        want["all-reduce"] = want.get("all-reduce", 0) + 1
    assert got == want


def test_metrics_argument_is_checked(mesh8):
    with pytest.raises(TypeError, match="TrainerMetrics"):
        jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, metrics="norms")
    with pytest.raises(TypeError, match="learning_rate"):
        jaxsync.TrainerMetrics(learning_rate="1e-3")
    noisy = optax.chain(optax.sgd(0.1), optax.add_decayed_weights(0.0))  # still zero: fine
    jaxsync.train_step(mlp_loss, noisy, mesh8, "zero", metrics=True)
    moves = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(lambda x: x + 1, u), s)
    )
    with pytest.raises(ValueError, match="zero gradients on zero params"):
        jaxsync.train_step(mlp_loss, moves, mesh8, "fsdp", metrics=True)


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_a_checkpoint_keeps_the_metrics_across_dp_sizes_and_settings(tmp_path, mode):
    """Saved with the metrics on at DP 8, restored on at DP 4: the same values, and the
    next step goes on from them. Across the setting (a run turns them on or off on
    resume) it restores too: the metrics the step does not record are dropped, the
    ones it records start at 0, the rest of the state is the saved one."""
    require_devices(8)
    params, batches = mlp_params(jax.random.key(0)), mlp_batches(3)

    def make(n, metrics):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        return jaxsync.train_step(mlp_loss, optax.adamw(SCHEDULE), mesh, mode, metrics=metrics)

    def restore(path, step):
        with jaxsync.Checkpointer(path) as ckpt:
            return ckpt.restore_state(step, step.init(params)).state

    on = jaxsync.TrainerMetrics(learning_rate=SCHEDULE)
    step8 = make(8, on)
    state, _ = run(step8, params, batches[:2])
    with jaxsync.Checkpointer(tmp_path / "on") as ckpt:
        ckpt.save_state(step8, state)
    step4 = make(4, on)
    new = restore(tmp_path / "on", step4)
    want, got = jax.device_get(state.metrics), jax.device_get(new.metrics)
    for name in ("update_norm", "param_norm", "learning_rate", "grad_norm"):
        assert float(getattr(got, name)) == float(getattr(want, name)), name
    new, _ = step4(new, batches[2])
    ref = reference(optax.adamw(SCHEDULE), params, batches, mlp_loss, schedule=SCHEDULE)
    m = jax.device_get(new.metrics)
    assert_matches([(float(m.update_norm), float(m.param_norm), float(m.learning_rate))],
                   ref[-1:])  # fmt: skip
    # on -> off: the norms and the rate dropped, the rest restored
    off = make(4, None)
    new = restore(tmp_path / "on", off)
    assert (new.metrics.update_norm, new.metrics.learning_rate) == (None, None)
    assert float(new.metrics.grad_norm) == float(want.grad_norm) and int(new.step) == 2
    # off -> on: they start at 0 and the next step records them
    off8 = make(8, None)
    state, _ = off8(off8.init(params), batches[0])
    with jaxsync.Checkpointer(tmp_path / "off") as ckpt:
        ckpt.save_state(off8, state)
    new = restore(tmp_path / "off", step4)
    assert float(new.metrics.update_norm) == float(new.metrics.learning_rate) == 0.0
    new, _ = step4(new, batches[1])
    m = jax.device_get(new.metrics)
    assert_matches([(float(m.update_norm), float(m.param_norm), float(m.learning_rate))],
                   reference(optax.adamw(SCHEDULE), params, batches[:2], mlp_loss,
                             schedule=SCHEDULE)[-1:])  # fmt: skip

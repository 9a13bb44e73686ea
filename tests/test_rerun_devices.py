"""Rerun in deterministic mode names the device: every unit of a suspicious step is
computed again on other devices (rows rotated by one and two devices' shares), and a
device whose result moves with it is named; a NaN in the data stays with its unit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_loss, mlp_params

import jaxsync

SIZES = (12, 33, 17, 5)
UNITS = 8
ROWS = 32  # 4 rows per unit
FAULTY = 5  # the device the faults are injected on (its place in mesh.devices.flat)
FAULT = {"left": 0}  # loss calls left that see the one-off fault (one step: UNITS calls)


def _armed(_):
    """True for the calls of the one step the fault is armed for, then False again."""
    on = FAULT["left"] > 0
    FAULT["left"] = max(FAULT["left"] - 1, 0)
    return np.bool_(on)


def _flip(x, on):
    """``x`` with bit 30 (the exponent's top bit) of its first element flipped where ``on``."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    first = bits.reshape(-1)[0] ^ jnp.uint32(1 << 30)
    flipped = jax.lax.bitcast_convert_type(bits.reshape(-1).at[0].set(first), x.dtype)
    return jnp.where(on, flipped.reshape(x.shape), x)


@jax.custom_vjp
def corrupt_grad(w, on):
    return w


def _fwd(w, on):
    return w, on


def _bwd(on, g):  # a flipped bit in this device's gradient of `w`
    return _flip(g, on), None


corrupt_grad.defvjp(_fwd, _bwd)


def _faulty_loss(kind, faulty=FAULTY):
    def loss(params, batch):
        device = jax.lax.axis_index("data")
        if kind == "nan once":  # a device's arithmetic goes wrong once: a NaN
            on = jax.experimental.io_callback(_armed, jax.ShapeDtypeStruct((), jnp.bool_), 0)
            x, y = batch
            batch = (jnp.where(on & (device == faulty), jnp.nan, x), y)
        elif kind in ("flip once", "flip always"):
            on = device == faulty
            if kind == "flip once":
                on = on & jax.experimental.io_callback(
                    _armed, jax.ShapeDtypeStruct((), jnp.bool_), 0
                )
            w = params["layer0"]["w"]
            params = {**params, "layer0": {**params["layer0"], "w": corrupt_grad(w, on)}}
        return mlp_loss(params, batch)

    return loss


def _run(mesh, kind=None, arm_at=None, batches=None, mode="ddp", steps=4):
    loss = mlp_loss if kind is None else _faulty_loss(kind)
    det = jaxsync.Deterministic(units=UNITS)
    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh, mode, deterministic=det)
    rerun = jaxsync.Rerun(step)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    if batches is None:
        xs, ys = make_batches(jax.random.PRNGKey(1), steps, ROWS, SIZES)
        batches = [(xs[i], ys[i]) for i in range(steps)]
    for i, b in enumerate(batches):
        FAULT["left"] = UNITS if i == arm_at else 0
        state, _ = rerun(state, b)
    return step, state, rerun.reports


def _names(report, device=FAULTY, mesh=None):
    (ref,) = report.devices
    d = mesh.devices.flat[device]
    assert (ref.index, ref.id, ref.process) == (device, d.id, d.process_index)
    assert f"device {device} (id {d.id}" in str(report)


def test_a_persistent_bit_flip_reproduces_and_is_named_by_rotation(mesh8):
    # The same wrong bits every run: the plain rerun reproduces them, yet device 5's
    # units (5 as placed, then 6 and 7 when it holds its neighbours' rows) move with it.
    _, state, (report,) = _run(mesh8, "flip always", steps=1)
    assert (report.reason, report.reproducible, report.case) == (
        "nonfinite", True, "persistent device fault",
    )  # fmt: skip
    _names(report, mesh=mesh8)
    assert report.units == (5, 6, 7)  # unit 5 as placed; 6 and 7 with the rows rotated
    assert report.grads == ("params['layer0']['w']",)
    assert "take the device out" in str(report) and int(state.step) == 0


def test_a_one_off_bit_flip_is_transient_and_unnamed_and_says_why(mesh8):
    # Once, finite: the step is skipped (its grad norm overflows), the rerun is clean,
    # and nothing the first run kept says which device computed the flipped unit.
    _, state, (report,) = _run(mesh8, "flip once", arm_at=1)
    assert (report.step, report.reproducible, report.case) == (1, False, "transient fault")
    assert report.devices == () and "cannot be named" in report.where
    assert "every gradient finite" in str(report)
    assert int(state.step) == 4  # the rerun's result was kept


def test_a_one_off_nan_is_transient_and_named_from_the_first_runs_record(mesh8):
    _, clean, none = _run(mesh8, "nan once")  # the same program, never armed
    assert none == []
    step, state, (report,) = _run(mesh8, "nan once", arm_at=2)
    assert (report.step, report.reproducible, report.case) == (2, False, "transient fault")
    _names(report, mesh=mesh8)
    assert report.units == (FAULTY,) and "first run" in report.where
    # Training went on from the rerun: the same bits as the run with no fault.
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(clean.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_a_nan_in_the_data_stays_with_its_unit(mesh8, mode):
    xs, ys = make_batches(jax.random.PRNGKey(1), 3, ROWS, SIZES)
    batches = [(xs[i], ys[i]) for i in range(3)]
    x, y = batches[1]
    batches[1] = (x.at[13, 0].set(jnp.nan), y)  # row 13: unit 3 (rows 12-15)
    _, state, (report,) = _run(mesh8, batches=batches, mode=mode)
    assert (report.step, report.reproducible, report.case) == (1, True, "numerical event")
    assert report.devices == () and report.units == (3,) and report.rows_per_unit == 4
    assert "global rows 12-15" in str(report) and int(state.step) == 2


def test_outside_deterministic_mode_the_report_says_why_no_device(mesh8):
    step = jaxsync.train_step(_faulty_loss("flip once"), optax.sgd(0.1), mesh8, "ddp")
    rerun = jaxsync.Rerun(step)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    xs, ys = make_batches(jax.random.PRNGKey(1), 2, ROWS, SIZES)
    FAULT["left"] = 8
    state, _ = rerun(state, (xs[0], ys[0]))
    (report,) = rerun.reports
    assert report.case == "transient fault" and report.devices == ()
    assert "outside deterministic mode" in report.where


def test_the_probe_is_not_in_the_step_and_clean_steps_build_none(mesh8):
    from jaxsync._src.integrity import rotation

    step, _, reports = _run(mesh8, steps=3)
    assert reports == [] and step not in rotation._PROBES


def _noisy_loss(params, batch, key):
    x, y = batch
    return mlp_loss(params, (x + 0.1 * jax.random.normal(key, x.shape), y))


def test_clean_steps_name_no_device_and_units_keep_their_keys(mesh8):
    # A loss jump on clean rows (and each unit's own random key): every unit gives the
    # same bits on every device, so no device is named; then 20 clean steps probed.
    from jaxsync._src.integrity.rotation import rotated_units

    det = jaxsync.Deterministic(units=UNITS)
    step = jaxsync.train_step(_noisy_loss, optax.adam(1e-2), mesh8, "zero", deterministic=det)
    rerun = jaxsync.Rerun(step, loss_jump=3.0)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    xs, ys = make_batches(jax.random.PRNGKey(1), 24, ROWS, SIZES)
    keys = jax.random.split(jax.random.PRNGKey(2), 24)
    for i in range(4):
        y = ys[i] * (100.0 if i == 3 else 1.0)
        state, _ = rerun(state, (xs[i], y), key=keys[i])
    (report,) = rerun.reports
    assert (report.reason, report.case, report.devices) == ("loss jump", "numerical event", ())
    assert "every unit gave the same bits on every device" in str(report)
    for i in range(4, 24):
        batch = (xs[i], ys[i])
        rotation = rotated_units(step, state, batch, keys[i])
        assert rotation.moved() == ({}, set(), False), i
        state, _ = step(state, batch, key=keys[i])


def test_keeping_the_copy_on_the_host_gives_the_same_report_and_result(mesh8):
    loss = _faulty_loss("nan once")
    det = jaxsync.Deterministic(units=UNITS)
    step = jaxsync.train_step(loss, optax.adam(1e-2), mesh8, "zero", deterministic=det)
    xs, ys = make_batches(jax.random.PRNGKey(1), 3, ROWS, SIZES)
    out = {}
    for keep in ("device", "host"):
        rerun = jaxsync.Rerun(step, keep=keep)
        state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
        for i in range(3):
            FAULT["left"] = UNITS if i == 1 else 0
            state, _ = rerun(state, (xs[i], ys[i]))
        out[keep] = (str(rerun.reports[0]), jax.tree.map(np.asarray, state.params))
    assert out["host"][0] == out["device"][0] and "device 5" in out["host"][0]
    for a, b in zip(jax.tree.leaves(out["host"][1]), jax.tree.leaves(out["device"][1]),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="`keep`"):
        jaxsync.Rerun(step, keep="disk")


JOB = """
import sys
import jax, numpy as np, optax
import jaxsync
jaxsync.initialize()
sys.path.insert(0, sys.argv[1])
from helpers import mlp_params
from test_rerun_devices import _faulty_loss
mesh = jax.make_mesh((jax.device_count(),), ("data",))
last = jax.device_count() - 1  # process 1's second device
det = jaxsync.Deterministic(units=4)
loss = _faulty_loss("flip always", faulty=last)
step = jaxsync.train_step(loss, optax.adam(1e-3), mesh, "zero", deterministic=det)
rerun = jaxsync.Rerun(step, keep="host")
state = step.init(mlp_params(jax.random.PRNGKey(0)))
rows = 16 // jax.process_count()
rng = np.random.default_rng(jax.process_index())
batch = (rng.normal(size=(rows, 12)).astype(np.float32), np.ones((rows, 5), np.float32))
state, _ = rerun(state, batch)
(r,) = rerun.reports
named = [(d.index, d.process, d.id == mesh.devices.flat[d.index].id) for d in r.devices]
print("case", r.case, named, r.units, flush=True)
"""


@pytest.mark.multiprocess
def test_two_processes_name_the_faulty_device_of_the_other_process(tmp_path):
    from helpers import launch

    out = launch(tmp_path, JOB)
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):  # every process names the same device: process 1's second
        line = f"[{rank}] case persistent device fault [(3, 1, True)] (0, 1, 3)"
        assert line in out.stdout, out.stdout


def test_on_one_device_a_one_off_nan_is_named_from_the_record_and_nothing_rotates():
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    det = jaxsync.Deterministic(units=4)
    step = jaxsync.train_step(_faulty_loss("nan once", 0), optax.sgd(0.1), mesh, "ddp",
                              deterministic=det)  # fmt: skip
    rerun = jaxsync.Rerun(step)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, ROWS, SIZES)
    FAULT["left"] = 4
    rerun(state, (xs[0], ys[0]))
    (report,) = rerun.reports
    assert report.case == "transient fault" and report.units == (0,)
    assert [tuple(d)[:1] for d in report.devices] == [(0,)]


def test_with_two_devices_there_is_no_majority_and_the_report_says_so():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    det = jaxsync.Deterministic(units=4)
    step = jaxsync.train_step(_faulty_loss("flip always", 1), optax.sgd(0.1), mesh, "ddp",
                              deterministic=det)  # fmt: skip
    rerun = jaxsync.Rerun(step)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    xs, ys = make_batches(jax.random.PRNGKey(1), 1, ROWS, SIZES)
    rerun(state, (xs[0], ys[0]))
    (report,) = rerun.reports
    assert report.case == "persistent device fault" and report.units == (0, 1, 2, 3)
    assert [d.index for d in report.devices] == [0, 1] and "one of them" in str(report)

"""``TrainerMetrics(unit_prints=True)``: a deterministic step records each unit's
gradient fingerprints in ``state.metrics.unit_prints``, and :class:`jaxsync.Rerun`
names the device of a one-off fault that left every gradient finite from them.

The faults are injected as in ``test_rerun_devices.py``: a custom VJP flips bit 30
of device 5's gradient of ``layer0.w``, armed for one step by a host countdown.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import make_batches, mlp_loss, mlp_params
from test_rerun_devices import FAULT, FAULTY, ROWS, SIZES, _faulty_loss

import jaxsync

LEAF = "params['layer0']['w']"
PRINTS = jaxsync.TrainerMetrics(norms=False, unit_prints=True)  # the record alone


def _batches(steps):
    xs, ys = make_batches(jax.random.PRNGKey(1), steps, ROWS, SIZES)
    return [(xs[i], ys[i]) for i in range(steps)]


def _step(mesh, mode, units, loss=mlp_loss, metrics=PRINTS):
    det = jaxsync.Deterministic(units=units)
    return jaxsync.train_step(loss, optax.sgd(0.1), mesh, mode, deterministic=det, metrics=metrics)


def _rerun(step, units, arm_at=None, steps=4):
    rerun = jaxsync.Rerun(step)
    state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
    for i, batch in enumerate(_batches(steps)):
        FAULT["left"] = units if i == arm_at else 0  # one loss call per unit and step
        state, _ = rerun(state, batch)
    return state, rerun.reports


@pytest.mark.parametrize(("mode", "units", "named"), [("ddp", 8, (5,)), ("zero", 16, (10, 11))])
def test_a_one_off_bit_flip_is_named_from_the_unit_prints(mesh8, mode, units, named):
    # Once, finite: the rerun is clean and gives other bits (a transient fault); the
    # first run's record of device 5's units differs from the rerun's, in layer0.w only.
    step = _step(mesh8, mode, units, _faulty_loss("flip once"))
    state, (report,) = _rerun(step, units, arm_at=1)
    assert (report.step, report.reproducible, report.case) == (1, False, "transient fault")
    (ref,) = report.devices
    d = mesh8.devices.flat[FAULTY]
    assert (ref.index, ref.id, ref.process) == (FAULTY, d.id, d.process_index)
    assert report.units == named and report.grads == (LEAF,)
    text = str(report)
    assert f"device {FAULTY} (id {d.id}" in text and f"its units {list(named)}" in text
    assert "fingerprints" in text and "training goes on from the rerun" in text
    # Training went on from the rerun: the same bits as a run with no fault.
    clean, none = _rerun(_step(mesh8, mode, units), units)
    assert none == [] and int(state.step) == int(clean.step) == 4
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(clean), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_without_the_record_the_report_names_the_option(mesh8):
    step = _step(mesh8, "ddp", 8, _faulty_loss("flip once"), metrics=None)
    _, (report,) = _rerun(step, 8, arm_at=1)
    assert report.case == "transient fault" and report.devices == ()
    assert "TrainerMetrics(unit_prints=True)" in report.where


@pytest.mark.default_xla  # bitwise across programs of other shapes: XLA's own options
@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_clean_unit_prints_are_the_same_bits_at_dp_8_and_4(mode):
    """A unit's gradient is the same bits at any DP size: so are its fingerprints,
    numbered by global unit (device-major), every step."""
    require_devices(8)
    seen = []
    for n in (8, 4):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        step = _step(mesh, mode, 8)
        state = step.init(mlp_params(jax.random.PRNGKey(0), sizes=SIZES))
        prints = []
        for batch in _batches(3):
            state, _ = step(state, batch)
            prints.append(np.asarray(jax.device_get(state.metrics.unit_prints)))
        seen.append(np.stack(prints))
    n_leaves = len(jax.tree.leaves(mlp_params(jax.random.PRNGKey(0), sizes=SIZES)))
    assert seen[0].shape == (3, 8, n_leaves) and seen[0].dtype == np.uint32
    np.testing.assert_array_equal(seen[0], seen[1])
    # Not constant: each unit and each step has its own gradient.
    assert len({seen[0][s, u].tobytes() for s in range(3) for u in range(8)}) == 24


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_off_keeps_the_state_and_program_and_on_adds_one_small_all_gather(mesh8, mode):
    params, (batch,) = mlp_params(jax.random.PRNGKey(0), sizes=SIZES), _batches(1)
    n_leaves = len(jax.tree.leaves(params))
    plain = _step(mesh8, mode, 8, metrics=None)
    off = _step(mesh8, mode, 8, metrics=jaxsync.TrainerMetrics(norms=False))  # nothing on
    on = _step(mesh8, mode, 8)
    s_plain, s_off, s_on = plain.init(params), off.init(params), on.init(params)
    assert s_plain.metrics.unit_prints is None and s_off.metrics.unit_prints is None
    assert len(jax.tree.leaves(s_plain.metrics)) == 7  # the fields checkpoints always held
    assert jax.tree.structure(s_off) == jax.tree.structure(s_plain)
    assert off.lower(s_off, batch).as_text() == plain.lower(s_plain, batch).as_text()
    assert len(jax.tree.leaves(s_on)) == len(jax.tree.leaves(s_plain)) + 1
    assert s_on.metrics.unit_prints.shape == (8, n_leaves)
    hlo_off = plain.lower(s_plain, batch).compile().as_text()
    hlo_on = on.lower(s_on, batch).compile().as_text()
    stats_off, stats_on = jaxsync.collective_stats(hlo_off), jaxsync.collective_stats(hlo_on)
    counts = lambda s: {k: v.count for k, v in s.items()}  # noqa: E731
    want = counts(stats_off)
    want["all-gather"] = want.get("all-gather", 0) + 1
    assert counts(stats_on) == want
    assert f"u32[8,{n_leaves}]" in hlo_on and f"u32[8,{n_leaves}]" not in hlo_off


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_a_step_outside_deterministic_mode_refuses_the_record(mesh8, mode):
    with pytest.raises(ValueError, match="not in deterministic mode.*Deterministic"):
        jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, mode, metrics=PRINTS)
    with pytest.raises(TypeError, match="unit_prints"):
        jaxsync.TrainerMetrics(unit_prints=1)
    with pytest.raises(TypeError, match="norms"):
        jaxsync.TrainerMetrics(norms=None)


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_a_checkpoint_with_the_record_restores_at_another_dp_size(tmp_path, mode):
    require_devices(8)
    params, batches = mlp_params(jax.random.PRNGKey(0), sizes=SIZES), _batches(3)

    def make(n):  # the norms too: ZeRO saves its metrics by position, the prints last
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        return _step(mesh, mode, 8, metrics=jaxsync.TrainerMetrics(unit_prints=True))

    step8 = make(8)
    state = step8.init(params)
    for batch in batches[:2]:
        state, _ = step8(state, batch)
    with jaxsync.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save_state(step8, state)
    step4 = make(4)
    with jaxsync.Checkpointer(tmp_path / "ckpt") as ckpt:
        new = ckpt.restore_state(step4, step4.init(params)).state
    want = np.asarray(jax.device_get(state.metrics.unit_prints))
    got = np.asarray(jax.device_get(new.metrics.unit_prints))
    assert want.any() and want.tobytes() == got.tobytes() and int(new.step) == 2
    assert float(new.metrics.update_norm) == float(state.metrics.update_norm) > 0
    new, _ = step4(new, batches[2])  # and the next step records its own
    assert np.asarray(jax.device_get(new.metrics.unit_prints)).tobytes() != want.tobytes()


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_a_checkpoint_restores_across_the_record_setting(tmp_path, mode, mesh8):
    """Turned on at resume (what a report without the record suggests): the prints start
    at 0 and the next step records them; turned off: dropped; kept where the other
    metrics change; started at 0 where the number of units changed."""
    params, batches = mlp_params(jax.random.PRNGKey(0), sizes=SIZES), _batches(2)
    rate = jaxsync.TrainerMetrics(learning_rate=0.1, unit_prints=True)
    cases = [(None, PRINTS, 8, "zero"), (PRINTS, None, 8, None), (PRINTS, rate, 8, "kept"),
             (PRINTS, PRINTS, 16, "zero")]  # fmt: skip
    for i, (saved_as, restored_as, units, prints) in enumerate(cases):
        first = _step(mesh8, mode, 8, metrics=saved_as)
        state, _ = first(first.init(params), batches[0])
        with jaxsync.Checkpointer(tmp_path / str(i)) as ckpt:
            ckpt.save_state(first, state)
        step = _step(mesh8, mode, units, metrics=restored_as)
        with jaxsync.Checkpointer(tmp_path / str(i)) as ckpt:
            new = ckpt.restore_state(step, step.init(params)).state
        got = new.metrics.unit_prints
        if prints is None:
            assert got is None, i
        else:
            got = np.asarray(jax.device_get(got))
            assert got.shape == (units, len(jax.tree.leaves(params))), i
            want = np.asarray(jax.device_get(state.metrics.unit_prints)) if prints == "kept" else 0
            assert np.all(got == want) and int(new.step) == 1, i
        new, _ = step(new, batches[1])
        assert (new.metrics.unit_prints is None) == (restored_as is None), i
        assert float(new.metrics.grad_norm) > 0, i

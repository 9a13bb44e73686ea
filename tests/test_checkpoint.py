import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import make_batches, mlp_loss, mlp_params, sharded_step
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync


def mesh_of(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def trainer(mesh, tx, params):
    step = sharded_step(mesh, tx, params)

    def run(params, state, batches, lo, hi):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        for i in range(lo, hi):
            batch = jaxsync.shard_batch((batches[0][i], batches[1][i]), mesh)
            params, state = step(params, state, batch)
        return params, state

    return run


@pytest.fixture
def setup():
    params = mlp_params(jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    tx = jaxsync.distributed_optimizer(
        {"decay": optax.adamw(5e-3, weight_decay=0.1), "no_decay": optax.adam(5e-3)},
        axis_name="data",
        labels=lambda p: jax.tree.map(lambda x: "decay" if x.ndim > 1 else "no_decay", p),
        bucket_size=300,
    )
    batches = make_batches(jax.random.PRNGKey(1), 8, 32)
    return params, tx, batches


def test_portable_form_is_independent_of_dp_size(setup):
    params, tx, batches = setup
    m8, m2 = mesh_of(8), mesh_of(2)
    run8 = trainer(m8, tx, params)
    p, s = run8(params, tx.sharded_init(params, m8), batches, 0, 3)
    port8 = tx.to_portable(s, p, m8)
    s2 = tx.from_portable(port8, p, m2)
    assert s2.master[0].shape[0] == 2 * tx.layout(p, m2).shard_size(0)
    port2 = tx.to_portable(s2, p, m2)
    assert jax.tree.structure(port2) == jax.tree.structure(port8)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), port8, port2
    )
    # per-parameter master arrays have the params' shapes
    assert port8["master"]["layer0.w"].shape == params["layer0"]["w"].shape


@pytest.mark.parametrize("n_from, n_to", [(8, 8), (8, 4), (8, 2), (2, 8)])
def test_resume_on_another_dp_size(tmp_path, setup, n_from, n_to):
    params, tx, batches = setup
    ma, mb = mesh_of(n_from), mesh_of(n_to)
    run_a, run_b = trainer(ma, tx, params), trainer(mb, tx, params)
    p, s = run_a(params, tx.sharded_init(params, ma), batches, 0, 4)
    ckpt = jaxsync.Checkpointer(tmp_path / "ckpt")
    ckpt.save(
        4,
        params=p,
        opt_state=s,
        tx=tx,
        mesh=ma,
        meta={"data_position": 4},
        extra={"rng": jax.random.PRNGKey(5)},
    )
    ckpt.wait()
    ref_p, ref_s = run_a(p, s, batches, 4, 8)  # uninterrupted

    r = jaxsync.Checkpointer(tmp_path / "ckpt").restore(
        params_like=params, tx=tx, mesh=mb, extra_like={"rng": jax.random.PRNGKey(0)}
    )
    assert r.step == 4 and r.meta == {"data_position": 4}
    np.testing.assert_array_equal(r.extra["rng"], jax.random.PRNGKey(5))
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p, r.params
    )
    if n_from == n_to:  # same mesh: the restored state is bitwise the saved one
        jax.tree.map(
            lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), s, r.opt_state
        )
        assert jax.tree.map(lambda x: x.sharding, s) == jax.tree.map(
            lambda x: x.sharding, r.opt_state
        )
    got_p, _ = run_b(r.params, r.opt_state, batches, 4, 8)
    for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(got_p), strict=True):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if n_from == n_to:
            np.testing.assert_array_equal(a32, b32)
        else:  # other reduction order: bf16 params at most one ulp apart
            np.testing.assert_allclose(a32, b32, rtol=2**-7, atol=1e-4)


@pytest.mark.parametrize("n_to", [8, 4])
def test_restored_params_land_on_the_mesh_restored_onto(tmp_path, setup, n_to):
    """``restore(params_like=<the run's own arrays>, mesh=...)`` gave the params back on
    their template's devices (one device, or the old mesh) beside an optimizer state on
    ``mesh``, and the next step refused the mix of devices (found by probing the
    documented resume; the other tests here placed the params themselves)."""
    params, tx, batches = setup  # built on the host: one device's arrays
    m8, mb = mesh_of(8), mesh_of(n_to)
    p, s = trainer(m8, tx, params)(params, tx.sharded_init(params, m8), batches, 0, 2)
    want, _ = trainer(m8, tx, params)(p, s, batches, 2, 3)  # uninterrupted
    ck = jaxsync.Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(2, params=p, opt_state=s, tx=tx, mesh=m8)
    step = sharded_step(mb, tx, params)
    batch = jaxsync.shard_batch((batches[0][2], batches[1][2]), mb)
    for like in (params, p):  # one device's arrays; the 8-device mesh's
        r = ck.restore(params_like=like, tx=tx, mesh=mb)
        whole = NamedSharding(mb, P())
        assert all(x.sharding.is_equivalent_to(whole, x.ndim) for x in jax.tree.leaves(r.params))
        got, _ = step(r.params, r.opt_state, batch)  # as restored, no device_put
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if n_to == 8:
                np.testing.assert_array_equal(a32, b32)
            else:  # another reduction order: bf16 params at most one ulp apart
                np.testing.assert_allclose(a32, b32, rtol=2**-7, atol=1e-4)


def test_a_template_sharded_over_an_axis_the_mesh_lacks_is_named(tmp_path):
    require_devices(8)
    params = {"w": jnp.arange(8.0).reshape(2, 4)}
    ck = jaxsync.Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, params=params, opt_state={})
    two_d = jax.make_mesh((4, 2), ("data", "model"))
    like = {"w": jax.device_put(params["w"], NamedSharding(two_d, P(None, "model")))}
    r = ck.restore(params_like=like, opt_state_like={}, mesh=two_d)  # the same mesh: kept
    assert r.params["w"].sharding == NamedSharding(two_d, P(None, "model"))
    np.testing.assert_array_equal(np.asarray(r.params["w"]), np.asarray(params["w"]))
    with pytest.raises(ValueError, match=r"params_like\['w'\] is sharded .* \['model'\]"):
        ck.restore(params_like=like, opt_state_like={}, mesh=mesh_of(4))


def test_a_distributed_state_restores_under_other_data_axes_names(tmp_path, setup):
    """Saved by an optimizer over ("replica", "data"), a state restores into one over
    "data" alone (any size): its buffers are found by their params, not their names,
    which hold the axes' (before: OPTIMIZER_CHANGED on `axis_name`, then the buffers
    missing)."""
    require_devices(8)
    params, tx, _ = setup
    two_d = jax.make_mesh((2, 4), ("replica", "data"))
    tx2 = jaxsync.distributed_optimizer(
        {"decay": optax.adamw(5e-3, weight_decay=0.1), "no_decay": optax.adam(5e-3)},
        axis_name=("replica", "data"),
        labels=lambda p: jax.tree.map(lambda x: "decay" if x.ndim > 1 else "no_decay", p),
        bucket_size=300,
    )
    # a state of distinct values everywhere, made from the portable form
    form = tx2.to_portable(tx2.sharded_init(params, two_d), params, two_d)
    keys = iter(jax.random.split(jax.random.PRNGKey(3), len(jax.tree.leaves(form))))
    want = jax.tree.map(
        lambda x: jax.random.normal(next(keys), x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating) else x,
        form,
    )  # fmt: skip
    ck = jaxsync.Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, params=params, opt_state=tx2.from_portable(want, params, two_d), tx=tx2, mesh=two_d)

    def by_role(inner):  # buffer name without its data axes' part
        return {".".join(k.split(".")[:1] + k.split(".")[2:]): v for k, v in inner.items()}

    for n in (8, 4):
        r = ck.restore(params_like=params, tx=tx, mesh=mesh_of(n))
        got = tx.to_portable(r.opt_state, r.params, mesh_of(n))
        assert set(got["inner_state"]) != set(want["inner_state"])  # named by other axes
        for a, b in zip(
            jax.tree.leaves((want["master"], by_role(want["inner_state"]))),
            jax.tree.leaves((got["master"], by_role(got["inner_state"]))),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mismatched_checkpoint_lists_every_difference(tmp_path, setup):
    params, tx, batches = setup
    m = mesh_of(4)
    ckpt = jaxsync.Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(1, params=params, opt_state=tx.sharded_init(params, m), tx=tx, mesh=m)
    before = sorted(os.listdir(tmp_path / "ckpt" / "1"))
    other = dict(params)
    other["layer0"] = {"w": jnp.zeros((12, 34), jnp.bfloat16), "b": params["layer0"]["b"]}
    other["extra"] = jnp.zeros((3,), jnp.bfloat16)
    with pytest.raises(ValueError) as e:
        ckpt.restore(params_like=other, tx=tx, mesh=m)
    msg = str(e.value)
    assert "shape differs: params.layer0.w saved (12, 33), model (12, 34)" in msg
    assert "missing from checkpoint: params.extra (3,)" in msg
    assert "opt_state.master.extra" in msg
    assert sorted(os.listdir(tmp_path / "ckpt" / "1")) == before  # nothing overwritten
    assert ckpt.latest_step() == 1


def test_missing_or_half_written_checkpoint(tmp_path, setup):
    params, tx, _ = setup
    m = mesh_of(2)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in .*empty"):
        jaxsync.Checkpointer(tmp_path / "empty").restore(params_like=params, tx=tx, mesh=m)
    # a save that died half way leaves only a temporary directory behind
    half = tmp_path / "half"
    half.mkdir()
    (half / "3.orbax-checkpoint-tmp-1234").mkdir()
    (half / "3.orbax-checkpoint-tmp-1234" / "partial").write_text("x")
    ck = jaxsync.Checkpointer(half)
    assert ck.latest_step() is None
    with pytest.raises(FileNotFoundError, match="temporary directories"):
        ck.restore(params_like=params, tx=tx, mesh=m)
    ck.save(5, params=params, opt_state=tx.sharded_init(params, m), tx=tx, mesh=m)
    ck.wait()
    with pytest.raises(FileNotFoundError, match=r"complete steps: \[5\]"):
        ck.restore(params_like=params, tx=tx, mesh=m, step=3)


def test_keep_last_n(tmp_path, setup):
    params, tx, _ = setup
    m = mesh_of(2)
    state = tx.sharded_init(params, m)
    ck = jaxsync.Checkpointer(tmp_path / "k", max_to_keep=2)
    for step in (1, 2, 3):
        ck.save(step, params=params, opt_state=state, tx=tx, mesh=m)
    ck.close()
    assert jaxsync.Checkpointer(tmp_path / "k").all_steps() == [2, 3]


def test_plain_optax_state_round_trips(tmp_path):
    params = mlp_params(jax.random.PRNGKey(0))
    m = mesh_of(2)
    opt = optax.adam(1e-3)
    grads = jax.grad(mlp_loss)(
        params, jax.tree.map(lambda x: x[0], make_batches(jax.random.PRNGKey(1), 1, 8))
    )
    _, state = opt.update(grads, opt.init(params), params)  # non-trivial moments
    state = jax.device_put(state, NamedSharding(m, P()))
    ck = jaxsync.Checkpointer(tmp_path / "p", async_save=False)
    ck.save(1, params=params, opt_state=state)
    r = ck.restore(params_like=params, opt_state_like=state, mesh=m)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, r.opt_state
    )


def test_saving_sharded_state_needs_tx(tmp_path, setup):
    params, tx, _ = setup
    m = mesh_of(2)
    ck = jaxsync.Checkpointer(tmp_path / "x")
    with pytest.raises(ValueError, match="needs `tx`"):
        ck.save(1, params=params, opt_state=tx.sharded_init(params, m))


def test_conversion_compiles_once_per_model_and_mesh(setup):
    from jaxsync._src.optim import portable

    params, tx, batches = setup
    m = mesh_of(4)
    state = tx.sharded_init(params, m)
    # The cache keeps 64 programs: after a long run of other tests a new entry evicts
    # an old one and its size stays put, so start it empty.
    portable._PROGRAMS.clear()
    first = tx.to_portable(state, params, m)
    p2, s2 = trainer(m, tx, params)(params, state, batches, 0, 1)
    second = tx.to_portable(s2, p2, m)  # a later save: same program, new values
    assert len(portable._PROGRAMS) == 1
    assert not np.array_equal(
        np.asarray(first["master"]["layer0.w"]), np.asarray(second["master"]["layer0.w"])
    )


# ---------------------------------------------------------------- no silent wrong answers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 1 saved on 2 ranks with a dynamic loss scale (read-only for the tests)."""
    params = mlp_params(jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    tx = jaxsync.distributed_optimizer(
        optax.adam(5e-3), axis_name="data", loss_scale=jaxsync.DynamicLossScale(4096.0)
    )
    m = mesh_of(2)
    state = tx.sharded_init(params, m)
    d = tmp_path_factory.mktemp("saved")
    with jaxsync.Checkpointer(d, async_save=False) as ck:
        ck.save(1, params=params, opt_state=state, tx=tx, mesh=m, meta={"data_position": 1})
    return d, params, tx, m, state


@pytest.mark.parametrize(
    "now, words",
    [
        (dict(), ["loss_scale", '"kind": "dynamic"', '"initial_scale": 4096.0', '"none"']),
        (dict(loss_scale=2.0), ["loss_scale", '"constant"']),
        (
            dict(loss_scale=jaxsync.DynamicLossScale(4096.0), clip_grad_norm=0.5),
            ["clip_grad_norm: saved null, now 0.5"],
        ),
        (
            dict(loss_scale=jaxsync.DynamicLossScale(4096.0), inner=optax.adamw(5e-3)),
            ["inner optimizer state for label 'all'", "EmptyState"],
        ),
        (
            dict(
                loss_scale=jaxsync.DynamicLossScale(4096.0),
                inner={"a": optax.adam(5e-3), "b": optax.adam(5e-3)},
                labels=lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", p),
            ),
            ["labels: saved null", "inner optimizer state for label 'a'"],
        ),
    ],
)
def test_restore_into_another_optimizer_is_refused(saved, now, words):
    d, params, _, m, _ = saved
    inner = now.pop("inner", optax.adam(5e-3))
    tx = jaxsync.distributed_optimizer(inner, axis_name="data", **now)
    with (
        jaxsync.Checkpointer(d) as ck,
        pytest.raises(jaxsync.CheckpointMismatchError) as e,
    ):
        ck.restore(params_like=params, tx=tx, mesh=m)
    msg = str(e.value)
    assert "step 1" in msg and "saved vs now" in msg and "allow_optimizer_change=True" in msg
    for w in words:
        assert w in msg, msg


def test_allowed_optimizer_change_restarts_the_loss_scale(saved):
    d, params, _, m, state = saved
    # Another bucket size and DP size are no change: checkpoints reshard.
    same = jaxsync.distributed_optimizer(
        optax.adam(5e-3),
        axis_name="data",
        loss_scale=jaxsync.DynamicLossScale(4096.0),
        bucket_size=64,
    )
    with jaxsync.Checkpointer(d) as ck:
        r = ck.restore(params_like=params, tx=same, mesh=mesh_of(4))
        assert float(r.opt_state.loss_scale.scale) == 4096.0
        plain = jaxsync.distributed_optimizer(optax.adam(5e-3), axis_name="data")
        r = ck.restore(params_like=params, tx=plain, mesh=m, allow_optimizer_change=True)
    assert float(r.opt_state.loss_scale.scale) == 1.0  # not the saved 4096
    np.testing.assert_array_equal(np.asarray(r.opt_state.master[0]), np.asarray(state.master[0]))


def test_restore_without_tx_says_what_to_pass(saved):
    d, params, tx, m, _ = saved
    with jaxsync.Checkpointer(d) as ck:
        with pytest.raises(ValueError, match=r"step 1 .* `tx=` .* `mesh=`"):
            ck.restore(params_like=params)
        with pytest.raises(ValueError, match=r"needs `mesh=`"):
            ck.restore(params_like=params, tx=tx)


def test_saving_an_old_step_is_refused(tmp_path, setup):
    params, tx, _ = setup
    m = mesh_of(2)
    state = tx.sharded_init(params, m)
    with jaxsync.Checkpointer(tmp_path / "c") as ck:
        ck.save(2, params=params, opt_state=state, tx=tx, mesh=m)
        # The save of step 2 may still be in flight: it counts.
        for step in (2, 1):
            with pytest.raises(ValueError, match=f"cannot save step {step} .* holds step 2.*fresh"):
                ck.save(step, params=params, opt_state=state, tx=tx, mesh=m)
    with (
        jaxsync.Checkpointer(tmp_path / "c") as again,
        pytest.raises(ValueError, match="delete the old checkpoints first"),
    ):
        again.save(2, params=params, opt_state=state, tx=tx, mesh=m)
    assert jaxsync.Checkpointer(tmp_path / "c").all_steps() == [2]


def test_meta_that_is_not_json_is_refused_at_save(tmp_path, setup):
    params, tx, _ = setup
    m = mesh_of(2)
    state = tx.sharded_init(params, m)
    with jaxsync.Checkpointer(tmp_path / "c") as ck:
        with pytest.raises(
            TypeError, match=r"meta\['data_position'\] is .*3.* of type .*int64.*int\(x\)"
        ):
            ck.save(
                1,
                params=params,
                opt_state=state,
                tx=tx,
                mesh=m,
                meta={"data_position": np.int64(3)},
            )
        with pytest.raises(TypeError, match=r"meta\['config'\]\['lr'\]"):
            ck.save(
                1,
                params=params,
                opt_state=state,
                tx=tx,
                mesh=m,
                meta={"config": {"lr": jnp.float32(1.0)}},
            )
    assert not (tmp_path / "c" / "1").exists()


def _flip(path, pos):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x5A
    path.write_bytes(bytes(data))


# Orbax leaves a callback on its closed event loop when a restore fails: harmless.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_flipped_bytes_are_detected(tmp_path, saved):
    d, params, tx, m, _ = saved
    with jaxsync.Checkpointer(d) as ck:
        good = ck.restore(params_like=params, tx=tx, mesh=m)
    good = jax.tree.leaves((good.params, good.opt_state))
    # Orbax's chunks are compressed without a checksum: some flips fail to decode,
    # others decode to other numbers, others land in bytes never read. None may
    # restore other numbers silently. Flip one byte at a time, largest files (the
    # array data) first, until one decodes to other numbers.
    files = sorted(
        (p for p in (d / "1" / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: (-p.stat().st_size, p.name),
    )
    outcomes = []
    for i, f in enumerate(files):
        for frac in (0.5, 0.25, 0.75, 0.1, 0.9):
            copy = tmp_path / f"{i}-{frac}"
            shutil.copytree(d, copy)
            _flip(copy / f.relative_to(d), int(f.stat().st_size * frac))
            with jaxsync.Checkpointer(copy) as ck:
                try:
                    r = ck.restore(params_like=params, tx=tx, mesh=m)
                except jaxsync.CorruptCheckpointError as e:
                    outcomes.append(str(e))
                    continue
            for a, b in zip(good, jax.tree.leaves((r.params, r.opt_state)), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            outcomes.append("unchanged")
        if any("differ from what was saved" in o for o in outcomes):
            break
    caught = [o for o in outcomes if "differ from what was saved" in o]
    assert caught, outcomes
    assert re.search(
        r"step 1 .* is damaged.*\n  (params|opt_state)\.\S+: [0-9a-f]{16} ->", caught[0]
    )


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_files_name_the_step_and_file(tmp_path, setup):
    params, tx, _ = setup
    m = mesh_of(2)
    state = tx.sharded_init(params, m)
    with jaxsync.Checkpointer(tmp_path / "c") as ck:
        for step in (1, 2):
            ck.save(step, params=params, opt_state=state, tx=tx, mesh=m, meta={"step": step})
    (tmp_path / "c" / "2" / "meta" / "metadata").write_text('{"step": 2')  # truncated JSON
    with (
        jaxsync.Checkpointer(tmp_path / "c") as ck,
        pytest.raises(jaxsync.CorruptCheckpointError) as e,
    ):
        ck.restore(params_like=params, tx=tx, mesh=m)
    msg = str(e.value)
    assert "step 2" in msg and "meta (JSON)" in msg and "/c/2/meta" in msg
    assert "other complete steps: [1]" in msg
    for f in (tmp_path / "c" / "1" / "state").rglob("*"):  # truncate every array file
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with (
        jaxsync.Checkpointer(tmp_path / "c") as ck,
        pytest.raises(
            jaxsync.CorruptCheckpointError, match=r"step 1 .* could not be read.*c/1/state"
        ),
    ):
        ck.restore(params_like=params, tx=tx, mesh=m, step=1)


UNCLOSED = """
import sys
import jax, jax.numpy as jnp
import jaxsync
ck = jaxsync.Checkpointer(sys.argv[1])  # asynchronous; never closed
ck.save(7, params={"w": jnp.arange(1000.0)}, opt_state={}, meta={"pos": 7})
"""


def test_unclosed_async_save_is_finished_at_exit(tmp_path):
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "c")) == ["7"]  # no *.orbax-checkpoint-tmp left
    with jaxsync.Checkpointer(tmp_path / "c") as ck:
        r = ck.restore(params_like={"w": jnp.zeros(1000)}, opt_state_like={})
    assert r.step == 7 and r.meta == {"pos": 7}
    np.testing.assert_array_equal(r.params["w"], np.arange(1000.0))


def test_label_differences_name_each_param_and_leave_model_changes_alone():
    from jaxsync._src.checkpoint.describe import DISTRIBUTED, optimizer_differences

    saved = {"kind": DISTRIBUTED, "labels": {"a.w": "decay", "a.b": "no_decay", "gone": "x"}}
    now = {"kind": DISTRIBUTED, "labels": {"a.w": "no_decay", "a.b": "no_decay", "new": "y"}}
    assert optimizer_differences(saved, now) == [
        "  labels differ for 1 param(s): a.w: decay -> no_decay"
    ]
    assert optimizer_differences(saved, {**saved, "kind": "optax"}) == [
        f"  optimizer: saved from {DISTRIBUTED}, restoring into optax"
    ]

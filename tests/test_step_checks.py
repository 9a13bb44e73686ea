"""The checks every train_step mode shares: batches, losses, params, donated
states, and what the processes of a run must agree on (fingerprints)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices

import jaxsync
from jaxsync._src.multihost.consistency import describe_value

MODES = ("ddp", "zero", "fsdp")


@pytest.fixture
def mesh():
    require_devices(8)
    return jax.make_mesh((8,), ("data",))


PARAMS = {"w": jnp.ones((4, 2)), "b": jnp.zeros((2,))}


def mse(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def batch(rows=16, y_rows=None):
    return {
        "x": np.ones((rows, 4), np.float32),
        "y": np.ones((y_rows or rows, 2), np.float32),
    }


@pytest.mark.parametrize("mode", MODES)
def test_batch_leaves_with_other_rows_are_refused(mesh, mode):
    # 16 rows of x against 8 of y: before, each device got 2 rows of x and 1 of
    # y, broadcast against each other, and trained without a word.
    step = jaxsync.train_step(mse, optax.sgd(0.1), mesh, mode=mode)
    state = step.init(PARAMS)
    with pytest.raises(ValueError, match=r"\['y'\] has 8, while \['x'\] has 16"):
        step(state, batch(16, 8))
    state, loss = step(state, batch(16))  # the state was not consumed by the refusal
    assert float(loss) == 9.0


def test_shard_batch_refuses_leaves_with_other_rows(mesh):
    with pytest.raises(ValueError, match=r"\['y'\] has 16, while \['x'\] has 8"):
        jaxsync.shard_batch(batch(8, 16), mesh)
    micro = {"x": np.ones((2, 8, 4)), "y": np.ones((2, 16, 1))}
    with pytest.raises(ValueError, match=r"axis 1"):
        jaxsync.shard_batch(micro, mesh, batch_axis=1)


@pytest.mark.parametrize("mode", MODES)
def test_loss_already_averaged_is_refused_in_every_mode(mesh, mode):
    # FSDP used to train it with gradients 1/8 of the right ones.
    step = jaxsync.train_step(
        lambda p, b: jax.lax.pmean(mse(p, b), "data"), optax.sgd(0.1), mesh, mode=mode
    )
    state = step.init(PARAMS)
    with pytest.raises(TypeError, match=rf"already reduced over \['data'\].*mode='{mode}'"):
        step(state, batch())


@pytest.mark.parametrize("mode", MODES)
def test_integer_loss_is_named(mesh, mode):
    step = jaxsync.train_step(
        lambda p, b: jnp.sum(b["x"] @ p["w"] > 0), optax.sgd(0.1), mesh, mode=mode
    )
    state = step.init(PARAMS)
    with pytest.raises(TypeError, match="loss of dtype int32"):
        step(state, batch())


@pytest.mark.parametrize("mode", MODES)
def test_integer_params_are_refused_in_every_mode(mesh, mode):
    # FSDP used to train an int32 param as a float and truncate it back.
    step = jaxsync.train_step(mse, optax.sgd(0.1), mesh, mode=mode)
    with pytest.raises(TypeError, match=rf"param n has dtype int32.*mode='{mode}'"):
        step.init(dict(PARAMS, n=jnp.arange(3)))


def test_shardings_a_step_cannot_honour_are_named():
    """Tensor-parallel specs over "model" used to be re-placed replicated (the "model"
    devices silently repeated the work). They are honoured now (tests/test_two_d.py);
    what a step cannot honour with them is an error naming the param and its spec."""
    require_devices(8)
    mesh2 = jax.make_mesh((4, 2), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh2, jax.sharding.PartitionSpec(None, "model"))
    tp = dict(PARAMS, w=jax.device_put(PARAMS["w"], sharding))
    cases = [
        (dict(mode="ddp", rules=jaxsync.SyncRules()), r"`rules`"),
        (dict(mode="zero", deterministic=True), r"`deterministic`"),
        (dict(mode="fsdp", units=["w"]), r"FSDP `units`"),
    ]
    for kwargs, what in cases:
        step = jaxsync.train_step(mse, optax.sgd(0.1), mesh2, **kwargs)
        with pytest.raises(ValueError, match=rf"param w .*\('model',\).*{what}"):
            step.init(tp)
    # a mesh without the spec's axis, and a spec that does not divide its dim
    mesh8 = jax.make_mesh((8,), ("data",))
    step = jaxsync.train_step(mse, optax.sgd(0.1), mesh8)
    with pytest.raises(ValueError, match=r"param w .*over \['model'\], which the step's mesh"):
        step.init(tp)
    odd = jax.ShapeDtypeStruct((3, 5), jnp.float32, sharding=sharding)
    step = jaxsync.train_step(mse, optax.sgd(0.1), mesh2)
    with pytest.raises(ValueError, match=r"param w .*dimension 1 \(size 5\).*size 2"):
        step.abstract_state(dict(PARAMS, w=odd))


@pytest.mark.parametrize("mode", ("ddp", "fsdp"))
def test_integer_nnx_param_is_named(mesh, mode):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 2)))
            self.n = nnx.Param(jnp.arange(3))

    step = jaxsync.train_step(
        lambda m, b: jnp.mean((b["x"] @ m.w[...] - b["y"]) ** 2), optax.sgd(0.1), mesh, mode=mode
    )
    with pytest.raises(TypeError, match=r"param n has dtype int32.*nnx.Param"):
        step.init(Model())


@pytest.mark.parametrize("mode", MODES)
def test_a_donated_state_used_again_is_refused(mesh, mode):
    step = jaxsync.train_step(mse, optax.sgd(0.1), mesh, mode=mode)
    state = step.init(PARAMS)
    new, _ = step(state, batch())
    with pytest.raises(ValueError, match="donated to an earlier call"):
        step(state, batch())
    new, loss = step(new, batch())
    assert np.isfinite(float(loss))


def test_fingerprints_read_optimizer_hyperparameters():
    same = describe_value(optax.adamw(1e-3, weight_decay=0.1))
    assert same == describe_value(optax.adamw(1e-3, weight_decay=0.1))
    assert same != describe_value(optax.adamw(1e-3, weight_decay=0.2))
    assert same != describe_value(optax.adamw(2e-3, weight_decay=0.1))
    sched = lambda peak: optax.adam(optax.warmup_cosine_decay_schedule(0.0, peak, 10, 100))
    assert describe_value(sched(1.0)) == describe_value(sched(1.0))
    assert describe_value(sched(1.0)) != describe_value(sched(0.5))
    assert "0x" not in same  # no memory addresses: they differ between processes


def test_fully_shard_makes_the_same_checks(mesh):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    fs = jaxsync.fully_shard({"w": jnp.ones((8, 2))}, axis_name="data", units=["w"], mesh=mesh)

    def grads(sh, b):
        loss = lambda s, bb: jax.lax.pmean(jnp.mean(bb @ fs.view(s)["w"]), "data")  # noqa: E731
        return fs.value_and_grad(loss, sh, b)[1]

    run = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(fs.specs(), P("data")),
                                out_specs=fs.specs()))  # fmt: skip
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))
    with pytest.raises(TypeError, match=r"FullyShard.value_and_grad: .*already reduced"):
        run(fs.shard({"w": jnp.ones((8, 2))}), x)
    with pytest.raises(TypeError, match="jaxsync.fully_shard: param n has dtype int32"):
        jaxsync.fully_shard(
            {"w": jnp.ones((8, 2)), "n": jnp.arange(8)}, axis_name="data", units=["w", "n"],
            mesh=mesh,
        )  # fmt: skip


def test_a_state_on_the_same_devices_in_another_order_is_named(mesh):
    from jax.sharding import Mesh

    reversed_mesh = Mesh(np.array(jax.devices()[::-1]), ("data",))
    for mode in MODES:
        made = jaxsync.train_step(mse, optax.sgd(0.1), mesh, mode=mode)
        other = jaxsync.train_step(mse, optax.sgd(0.1), reversed_mesh, mode=mode)
        state = made.init(PARAMS)
        with pytest.raises(ValueError, match=r"the same devices in another order.*device_put"):
            other(state, batch())
        # the fix it names, on a step that has made no state itself
        moved = jax.device_put(state, other.state_shardings(other.abstract_state(PARAMS)))
        _, loss = other(moved, batch())
        assert float(loss) == 9.0


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_a_state_cut_for_other_data_parallel_ranks_is_sent_through_a_checkpoint(mesh, mode):
    """A ZeRO or FSDP state made on 8 devices, handed to a step on 4: its flat shards
    were cut for 8, so moving the arrays cannot help; the error says so and names the
    checkpoint that cuts them again."""
    from jax.sharding import Mesh

    four = Mesh(np.array(jax.devices()[:4]), ("data",))
    state = jaxsync.train_step(mse, optax.sgd(0.1), mesh, mode=mode).init(PARAMS)
    other = jaxsync.train_step(mse, optax.sgd(0.1), four, mode=mode)
    with pytest.raises(ValueError, match=r"cut for 8 data-parallel ranks and this step's are 4.*"
                       r"save_state.*restore_state"):  # fmt: skip
        other(state, batch())


@pytest.mark.parametrize("mode", MODES)
def test_a_step_rebuilt_with_other_settings_takes_the_state_another_step_made(mesh, mode):
    """A step built mid-run (here with 2 microbatches) has made no state; it takes one
    that another step made from the same model, and trains it as that step would. A
    state of another mode is refused naming both modes."""
    tx = optax.sgd(0.1)
    made = jaxsync.train_step(mse, tx, mesh, mode=mode)
    state, _ = made(made.init(PARAMS), batch())
    want = jax.device_get(made.params(made(state, batch())[0]))
    state, _ = made(made.init(PARAMS), batch())
    rebuilt = jaxsync.train_step(mse, tx, mesh, mode=mode, microbatches=2)
    got = jax.device_get(rebuilt.params(rebuilt(state, batch())[0]))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    other = next(m for m in MODES if m != mode)
    foreign = jaxsync.train_step(mse, tx, mesh, mode=other)
    with pytest.raises(ValueError, match=rf"it is a mode='{mode}' state and this step's mode "
                       rf"is '{other}'"):  # fmt: skip
        foreign(made.init(PARAMS), batch())


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_bad_labels_get_the_same_message_in_ddp_and_zero(mesh, mode):
    tx = {"decay": optax.adamw(1e-2), "plain": optax.adam(1e-2)}
    cases = [
        ({"w": "decay", "b": None}, TypeError, r"label of param \['b'\] is None"),
        ({"w": "decay", "b": "nodecay"}, ValueError, r"uses \['nodecay'\].*\['decay', 'plain'\]"),
    ]
    for labels, error, match in cases:
        step = jaxsync.train_step(mse, tx, mesh, mode=mode, labels=labels)
        with pytest.raises(error, match=match):
            step(step.init(PARAMS), batch())


def test_fsdp_shards_restored_at_a_size_that_does_not_fit_their_padding(tmp_path):
    require_devices(8)
    big = jax.make_mesh((8,), ("data",))
    small = jax.make_mesh((3,), ("data",), devices=jax.devices()[:3])
    step8 = jaxsync.train_step(mse, optax.sgd(0.1), big, mode="fsdp")
    state = step8.init(PARAMS)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, params=state.params, opt_state=state.opt_state)
    step3 = jaxsync.train_step(mse, optax.sgd(0.1), small, mode="fsdp")
    like = step3.init(PARAMS)
    ckpt = jaxsync.Checkpointer(tmp_path)
    with pytest.raises(jaxsync.CheckpointMismatchError, match="FSDP shards.*save_state"):
        ckpt.restore(params_like=like.params, opt_state_like=like.opt_state)
    ckpt.close()


def test_step_fingerprints_tell_configs_apart(mesh):
    from jaxsync._src.step.checks import step_items

    def items(**kw):
        return dict(step_items(jaxsync.train_step(mse, optax.adam(1e-3), mesh, **kw)))

    base = items(mode="zero", reduce_dtype=jnp.float32)
    assert base == items(mode="zero", reduce_dtype=jnp.float32)
    for other in (
        items(mode="ddp", reduce_dtype=jnp.float32),
        items(mode="zero", reduce_dtype=jnp.bfloat16),
        items(mode="zero", clip_grad_norm=1.0),
        items(mode="zero", microbatches=2),
    ):
        assert other["mode and options"] != base["mode and options"]


def test_the_probe_message_fits_train_step_users(mesh):
    """The FSDP probe used to send train_step users to `labels` (then refused in FSDP) and
    to `check_elementwise=False` (which train_step does not take)."""
    masked = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    step = jaxsync.train_step(mse, masked, mesh, mode="fsdp")
    with pytest.raises(ValueError, match="not elementwise") as e:
        step.init(PARAMS)
    assert "pass `labels=` with one optimizer per label" in str(e.value)
    assert "works in every mode" in str(e.value)
    assert "`train_step` always probes" in str(e.value)

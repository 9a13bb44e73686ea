"""No silent wrong answers: bad input fails early and names what is wrong.

Most tests here only trace (``.trace``/``eval_shape``): the errors are raised at
trace time, so nothing is compiled.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import mlp_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.optim import elementwise
from jaxsync._src.optim.loss_scale import init_loss_scale, update_loss_scale


def small_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"b": 0.1 * jax.random.normal(k1, (4,)), "w": jax.random.normal(k2, (8, 4))}


def small_loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def small_batch(mesh, rows=16):
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x, y = jax.random.normal(kx, (rows, 8)), jax.random.normal(ky, (rows, 4))
    return jaxsync.shard_batch((x, y), mesh)


# ---------------------------------------------------------------- loss scale
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0, True, "1024", 1e39])
def test_constant_loss_scale_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="`loss_scale`"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", loss_scale=bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"initial_scale": float("nan")}, "`initial_scale` must be a finite number > 0"),
        ({"initial_scale": float("inf")}, "`initial_scale` must be a finite number > 0"),
        ({"initial_scale": 0.0}, "`initial_scale`"),
        ({"initial_scale": -1.0}, "`initial_scale`"),
        ({"initial_scale": 1e39}, "`initial_scale`"),  # Inf in float32
        ({"min_scale": float("nan")}, "`min_scale`"),
        ({"min_scale": 0.0}, "`min_scale`"),
        ({"growth_factor": float("inf")}, "`growth_factor`"),
        ({"growth_factor": 0.5}, "`growth_factor` must be a finite number >= 1"),
        ({"backoff_factor": 1.0}, r"`backoff_factor` must be a number in \(0, 1\)"),
        ({"backoff_factor": 0.0}, "`backoff_factor`"),
        ({"growth_interval": 0}, "`growth_interval` must be an integer >= 1"),
        ({"growth_interval": 2.5}, "`growth_interval`"),
        ({"hysteresis": 0}, "`hysteresis`"),
        ({"initial_scale": 2.0, "min_scale": 4.0}, "`min_scale` .* is above `initial_scale`"),
    ],
)
def test_dynamic_loss_scale_rejects_nonsense(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxsync.DynamicLossScale(**kwargs)


def test_dynamic_loss_scale_never_grows_to_inf():
    """An Inf scale makes every step non-finite and backs off to Inf: never reach it."""
    cfg = jaxsync.DynamicLossScale(initial_scale=2.0**127, growth_interval=1, hysteresis=1)
    s = update_loss_scale(cfg, init_loss_scale(cfg), jnp.asarray(True))
    assert float(s.scale) == 2.0**127
    s = update_loss_scale(cfg, s, jnp.asarray(False))
    assert float(s.scale) == 2.0**126


# ---------------------------------------------------------- elementwise probe
def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


def test_small_weight_decay_with_mask_callable_rejected(mesh8):
    """On flat shards the mask sees 1-D arrays and decays nothing; a decay of 3e-4
    hid under the old probe's tolerance. A step of zero gradients leaves only the
    decay, so tree and shards differ by all of it."""
    params = mlp_params(jax.random.PRNGKey(0))
    inner = optax.adamw(1e-3, weight_decay=3e-4, mask=_decay_mask)
    tx = jaxsync.distributed_optimizer(inner, axis_name="data")
    with pytest.raises(
        ValueError,
        match=r"not elementwise.*\['layer0'\]\['w'\] after a step of "
        "zero gradients.*pass `labels=`",
    ):
        tx.sharded_init(params, mesh8)


def test_unfactored_looking_adafactor_rejected_on_real_shapes():
    """Adafactor factors dims >= 128: the old probe (dims <= 3) never saw it."""
    inner = optax.adafactor(1e-3, multiply_by_parameter_scale=False, clipping_threshold=None)
    params = {"w": jax.ShapeDtypeStruct((128, 160), jnp.float32), "b": jnp.zeros(160)}
    with pytest.raises(ValueError, match=r"not elementwise.*param \['w'\]"):
        elementwise.check_elementwise(inner, params, "all params")
    # Without a factored param it *is* elementwise, and the probe says so.
    elementwise.check_elementwise(inner, {"w": jnp.zeros((8, 160)), "b": jnp.zeros(160)}, "all")


@pytest.mark.parametrize(
    "inner",
    [
        optax.sgd(0.1),
        optax.sgd(0.05, momentum=0.9, nesterov=True),
        optax.adam(1e-3),
        optax.adamw(1e-3, weight_decay=0.1),
        optax.lion(1e-4, weight_decay=1e-2),
        optax.rmsprop(1e-3),
        optax.adagrad(1e-2),
        optax.nadam(1e-3),
        optax.adam(optax.cosine_decay_schedule(1e-3, 10)),
        optax.chain(optax.clip(1.0), optax.adam(1e-3)),  # elementwise clipping is fine
    ],
    ids=[
        "sgd",
        "nesterov",
        "adam",
        "adamw",
        "lion",
        "rmsprop",
        "adagrad",
        "nadam",
        "sched",
        "clip",
    ],
)
def test_elementwise_optimizers_accepted(inner):
    """The probe alone (no raise); test_optimizer.py trains lion, rmsprop, adagrad and
    nadam on shards against single-device optax."""
    elementwise.check_elementwise(inner, mlp_params(jax.random.PRNGKey(0)), "all params")


@pytest.mark.parametrize(
    "inner",
    [
        optax.lamb(1e-3),
        optax.lars(1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.adamw(1e-3, weight_decay=1e-4, mask={"b": False, "w": True}),
    ],
    ids=["lamb", "lars", "clip_by_global_norm", "mask_pytree"],
)
def test_non_elementwise_rejected(inner):
    with pytest.raises(ValueError, match="not elementwise"):
        elementwise.check_elementwise(inner, small_params(), "all params")


def test_labels_buffer_probed_as_a_list_of_its_params():
    """Per-label buffers are probed on the list of their params (what a label's
    transformation sees there): adamw without a mask passes."""
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(12, 33), (33, 17)]]
    elementwise.check_elementwise(optax.adamw(1e-3, weight_decay=3e-4), shapes, "label 'decay'")


def test_probe_cost_is_capped_for_huge_models():
    shapes = ((128_000, 8192),) + ((8192, 8192),) * 4 + ((8192,),) * 8
    capped = elementwise.probe_shapes(shapes)
    assert sum(int(np.prod(s)) for s in capped) <= elementwise.PROBE_ELEMENTS
    # the structure, ranks and "large dimension" class survive the cap
    assert [len(s) for s in capped] == [len(s) for s in shapes]
    assert all(d >= elementwise.MIN_PROBE_DIM for s in capped for d in s)
    small = ((12, 33), (33,))
    assert elementwise.probe_shapes(small) == small  # real shapes below the budget


# ------------------------------------------- already-reduced (plain jax.grad) grads
def abstract_state(tx, params, mesh, param_specs=None):
    return jax.eval_shape(lambda p: tx.sharded_init(p, mesh, param_specs), params)


def trace_step(mesh, tx, params, grad_fn, *, param_spec=None, state_tx=None):
    """Traces (never compiles) one shard_map step of ``tx`` with grads from ``grad_fn``,
    on the state (and state specs) of ``state_tx`` (default: ``tx``)."""
    state_tx = state_tx or tx
    state = abstract_state(state_tx, params, mesh)
    specs = state_tx.state_specs(params, mesh)
    pspecs = jax.tree.map(lambda _: param_spec or P(), params)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(pspecs, specs, P("data")), out_specs=specs)
    def step(params, state, batch):
        grads = grad_fn(params, batch)
        return tx.update(grads, state, params)[1]

    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        params,
        pspecs,
    )
    return step.trace(params, state, small_batch(mesh))


def plain_grads(params, batch):
    return jax.grad(small_loss)(params, batch)


def local_grads(params, batch):
    return jaxsync.value_and_grad(small_loss, axis_name="data")(params, batch)[1]


def test_update_rejects_grads_from_plain_jax_grad(mesh8):
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    with pytest.raises(
        TypeError,
        match=r"update: the gradients of \['b'\], \['w'\] are already reduced over \['data'\].*"
        r" \(8x\).*too large.*jaxsync.value_and_grad\(loss_fn, axis_name='data'\)",
    ):
        trace_step(mesh8, tx, small_params(), plain_grads)
    trace_step(mesh8, tx, small_params(), local_grads)  # local grads: fine


@pytest.mark.parametrize("api", ["all_reduce_grads", "sync_grads"])
def test_dp_sync_rejects_grads_from_plain_jax_grad(mesh8, api):
    sync = jaxsync.sync_grads(axis_name="data")

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P())
    def step(params, batch):
        grads = jax.value_and_grad(small_loss)(params, batch)[1]
        if api == "sync_grads":
            return sync.update(grads, sync.init(params))[0]
        return jaxsync.all_reduce_grads(grads, axis_name="data")

    with pytest.raises(TypeError, match=rf"jaxsync.{api}: the gradients of .* already reduced"):
        step.trace(small_params(), small_batch(mesh8))


def test_value_and_grad_rejects_a_loss_averaged_inside(mesh8):
    def pmean_loss(params, batch):
        return jax.lax.pmean(small_loss(params, batch), "data")

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P())
    def step(params, batch):
        _, g = jaxsync.value_and_grad(pmean_loss, axis_name="data")(params, batch)
        return jaxsync.all_reduce_grads(g, axis_name="data")

    with pytest.raises(
        TypeError, match=r"loss returned by `fun` is already reduced over \['data'\]"
    ):
        step.trace(small_params(), small_batch(mesh8))


def moe_setup():
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "expert"))
    axes = ("data", "expert")
    params = {"dense": jnp.ones((8, 4)), "experts": jnp.ones((2, 4, 4))}
    specs = {"dense": P(), "experts": P("expert")}
    rules = jaxsync.SyncRules.of({r"^experts$": jaxsync.ExpertParallel("expert")})
    gparams = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)

    def loss(p, batch):
        x, y = batch
        h = x @ p["dense"]
        return jnp.mean((h @ p["experts"][0] - y) ** 2)

    return mesh, axes, gparams, specs, rules, loss


def test_expert_params_reduced_over_fewer_axes_pass(mesh8):
    """Expert grads vary over `expert` because the param does; checked over `data` only."""
    mesh, axes, params, specs, rules, loss = moe_setup()
    tx = jaxsync.distributed_optimizer(optax.adam(1e-3), axis_name=axes, rules=rules)
    state_specs = tx.state_specs(params, mesh)
    state = abstract_state(tx, params, mesh, specs)
    batch = jaxsync.shard_batch((jnp.ones((16, 8)), jnp.ones((16, 4))), mesh, axis_name=axes)

    def make(grad_fn):
        @jax.jit
        @partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(specs, state_specs, P(axes)),
            out_specs=(specs, state_specs),
        )
        def step(params, state, batch):
            g = grad_fn(params, batch)
            reduced = jaxsync.all_reduce_grads(g, axis_name=axes, rules=rules)
            return reduced, tx.update(g, state, params)[1]

        return step

    make(lambda p, b: jaxsync.value_and_grad(loss, axis_name=axes, rules=rules)(p, b)[1]).trace(
        params, state, batch
    )
    with pytest.raises(TypeError, match=r"\['experts'\] are already reduced over \['data'\]"):
        make(lambda p, b: jax.grad(loss)(p, b)).trace(params, state, batch)


def sp_setup():
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    params = {"ln": jnp.ones((8,)), "w": jnp.ones((8, 4))}
    rules = jaxsync.SyncRules.of({r"^ln$": jaxsync.SequenceParallel("tensor")})
    batch = jaxsync.shard_batch(
        (jnp.ones((16, 8)), jnp.ones((16, 4))), mesh, axis_name=("data", "tensor")
    )

    def loss(p, batch):
        x, y = batch
        return jnp.mean(((x * p["ln"]) @ p["w"] - y) ** 2)

    return mesh, params, rules, batch, loss


@pytest.mark.parametrize("where", ["value_and_grad", "tx"])
def test_rules_given_to_only_one_side_are_named(where):
    mesh, params, rules, batch, loss = sp_setup()
    tx = jaxsync.distributed_optimizer(
        optax.sgd(0.1), axis_name="data", rules=rules if where == "tx" else None
    )
    specs = tx.state_specs(params, mesh)
    vg_rules = rules if where == "value_and_grad" else None

    @jax.jit
    @partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(("data", "tensor"))), out_specs=specs
    )
    def step(params, state, batch):
        _, g = jaxsync.value_and_grad(loss, axis_name="data", rules=vg_rules)(params, batch)
        return tx.update(g, state, params)[1]

    match = (
        r"gradient of \['ln'\] varies over \['tensor'\].*pass the same `rules=`"
        if where == "value_and_grad"
        else r"\['ln'\] are already reduced over \['tensor'\].*rules=rules"
    )
    with pytest.raises(TypeError, match=match):
        step.trace(params, abstract_state(tx, params, mesh), batch)


# ----------------------------------------- params and state that do not match
def test_params_sharded_over_the_data_axis_are_rejected(mesh8):
    """A P('data') param inside the step: each rank holds other rows of it."""
    params = {"b": jnp.zeros((8,)), "w": jnp.ones((64, 4))}
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")

    def grads(p, b):
        return jaxsync.value_and_grad(
            lambda p, b: jnp.sum(p["w"]) + jnp.sum(p["b"]), axis_name="data"
        )(p, b)[1]

    with pytest.raises(
        TypeError,
        match=r"param \['b'\] differs across the data-parallel axes \['data'\].*PartitionSpec "
        "that does not name",
    ):
        trace_step(mesh8, tx, params, grads, param_spec=P("data"))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=P("data"), out_specs=P())
    def init(params):
        return tx.init(params).loss_scale.scale

    sharded = jax.device_put(params, NamedSharding(mesh8, P("data")))
    with pytest.raises(TypeError, match=r"init: param \['b'\] differs across"):
        init.trace(sharded)


def test_state_from_another_bucket_size_is_named(mesh8):
    params = {"a": jnp.ones(10), "b": jnp.ones(10), "c": jnp.ones(10)}
    old = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    new = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", bucket_size=1)

    def grads(p, b):
        return jaxsync.value_and_grad(
            lambda p, b: sum(jnp.sum(x) for x in p.values()), axis_name="data"
        )(p, b)[1]

    with pytest.raises(
        ValueError,
        match=r"state.master\[0\] has 32 elements per rank, the layout for these params and "
        r"bucket_size=1 has 48.*another `bucket_size`",
    ):
        trace_step(mesh8, new, params, grads, state_tx=old)


def test_state_from_another_inner_optimizer_is_named(mesh8):
    sgd = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    adam = jaxsync.distributed_optimizer(optax.adam(0.1), axis_name="data")
    with pytest.raises(ValueError, match=r"state.inner_state\[0\] has structure .*inner optimizer"):
        trace_step(mesh8, adam, small_params(), local_grads, state_tx=sgd)


def test_state_from_other_param_specs_is_named():
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    params = {"w": jnp.ones((64, 4))}
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    tp = NamedSharding(mesh, P(None, "tensor"))
    tp_params = {"w": jax.ShapeDtypeStruct((64, 4), jnp.float32, sharding=tp)}
    # the state (and its specs) of tensor-parallel params, the step's params replicated
    state = abstract_state(tx, tp_params, mesh, {"w": P(None, "tensor")})
    specs = tx.state_specs(tp_params, mesh, {"w": P(None, "tensor")})

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs), out_specs=specs)
    def step(params, state):
        g = jaxsync.value_and_grad(lambda p: jnp.sum(p["w"]), axis_name="data")(params)[1]
        return tx.update(g, state, params)[1]

    with pytest.raises(ValueError, match=r"master\[0\] has 32 elements.*has 64.*`param_specs`"):
        step.trace(params, state)


def test_state_of_another_optimizer_is_a_type_error(mesh8):
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P(), P("data")), out_specs=P())
    def step(params, state, batch):
        return tx.update(local_grads(params, batch), state, params)[0]

    with pytest.raises(TypeError, match="`state` must be the DistributedOptimizerState"):
        step.trace(small_params(), optax.adam(0.1).init(small_params()), small_batch(mesh8))


# ------------------------------------------------------------ skipped steps
def test_skipped_steps_name_the_param_and_device(mesh8):
    """A NaN gradient in one param on one rank: every step is skipped, and the
    metrics say which param and which device, as data, without a host sync."""
    params = {"a": jnp.ones(4), "b": jnp.ones(4)}

    def loss(p, batch):
        x, y = batch
        return jnp.mean(x @ p["a"]) + jnp.mean(jnp.sqrt(y) @ p["b"])  # sqrt(<0): NaN

    scaler = jaxsync.DynamicLossScale(initial_scale=4.0, min_scale=1.0, hysteresis=1)
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", loss_scale=scaler)
    specs = tx.state_specs(params, mesh8)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    def step(params, state, batch):
        _, g = jaxsync.value_and_grad(loss, axis_name="data")(params, batch)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    x, y = jnp.ones((16, 4)), jnp.ones((16, 4))
    bad = (x, y.at[7, 0].set(-1.0))  # row 7: rank 3 (2 rows per rank)
    state = tx.sharded_init(params, mesh8)
    p = params
    for _ in range(3):
        p, state = step(p, state, jaxsync.shard_batch(bad, mesh8))
    m = state.metrics
    assert bool(m.skipped) and int(m.skipped_steps) == 3 and int(m.consecutive_skips) == 3
    assert float(state.loss_scale.scale) == 1.0  # pinned at min_scale
    np.testing.assert_array_equal(m.nonfinite_devices, [0, 1])  # tree-leaf order: a, b
    np.testing.assert_array_equal(m.first_nonfinite_device, [-1, 3])
    jax.tree.map(np.testing.assert_array_equal, p, params)  # nothing applied
    report = jaxsync.nonfinite_report(state, params, mesh8)
    assert "skipped 3 step(s)" in report and "the last 3 step(s) in a row" in report
    assert "b on 1 device(s), first on device 3 (data=3)" in report and "\n  a " not in report

    p, state = step(p, state, jaxsync.shard_batch((x, y), mesh8))  # a clean step
    assert int(state.metrics.consecutive_skips) == 0 and int(state.metrics.skipped_steps) == 3
    assert not bool(state.metrics.skipped)
    assert "the last step was applied" in jaxsync.nonfinite_report(state, params)
    clean = tx.sharded_init(params, mesh8)
    assert jaxsync.nonfinite_report(clean, params) == ""


# ------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("axis_name", [None, 0, ["data", 1]])
def test_axis_name_must_be_names(axis_name):
    with pytest.raises((TypeError, ValueError), match="`axis_name` must be a mesh axis name"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name=axis_name)
    with pytest.raises((TypeError, ValueError), match="`axis_name` must be a mesh axis name"):
        jaxsync.value_and_grad(small_loss, axis_name=axis_name)
    with pytest.raises((TypeError, ValueError), match="`axis_name` must be a mesh axis name"):
        jaxsync.sync_grads(axis_name=axis_name)


def test_bucket_size_numpy_int_accepted_bool_rejected(mesh8):
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", bucket_size=np.int64(64))
    assert tx.layout(small_params(), mesh8).bucket_size == 64
    with pytest.raises(ValueError, match=r"`bucket_size` must be .* got True \(bool\)"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", bucket_size=True)
    with pytest.raises(ValueError, match="`bucket_size`"):
        jaxsync.build_layout(small_params(), bucket_size=2.5)


@pytest.mark.parametrize("bad", ["1.0", float("nan"), float("inf"), True, 0.0])
def test_clip_grad_norm_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="`clip_grad_norm` must be a finite positive number"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", clip_grad_norm=bad)


def test_other_optimizer_arguments():
    with pytest.raises(TypeError, match="`reduce_dtype` must be a floating dtype.*int32"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", reduce_dtype=jnp.int32)
    with pytest.raises(TypeError, match="`check_elementwise` must be True or False"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", check_elementwise="no")
    with pytest.raises(TypeError, match="`reduce_dtype` must be a floating dtype"):
        jaxsync.sync_grads(axis_name="data", reduce_dtype=jnp.int8)
    with pytest.raises(ValueError, match="`bucket_size`"):
        jaxsync.sync_grads(axis_name="data", bucket_size=0)  # at construction, not in the step


def test_rules_as_a_plain_dict_point_to_sync_rules():
    rules = {r"^ln$": jaxsync.SequenceParallel("tensor")}
    match = r"`rules` must be a jaxsync.SyncRules or None, got a dict.*jaxsync.SyncRules.of"
    with pytest.raises(TypeError, match=match):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", rules=rules)
    with pytest.raises(TypeError, match=match):
        jaxsync.value_and_grad(small_loss, axis_name="data", rules=rules)
    with pytest.raises(TypeError, match=match):
        jaxsync.sync_grads(axis_name="data", rules=rules)
    with pytest.raises(TypeError, match=match):
        jaxsync.all_reduce_grads(small_params(), axis_name="data", rules=rules)


def test_param_specs_checked_against_params_and_mesh(mesh8):
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    params = small_params()
    with pytest.raises(ValueError, match="`param_specs` must have the structure of the params"):
        tx.state_specs(params, mesh8, {"w": P()})
    with pytest.raises(ValueError, match=r"\['w'\] is P\('tensor',\): \['tensor'\] is not an axis"):
        tx.state_specs(params, mesh8, {"b": P(), "w": P("tensor")})
    with pytest.raises(ValueError, match=r"names 3 dimensions; the param has shape \(4,\)"):
        tx.state_specs(params, mesh8, {"b": P(None, None, None), "w": P()})
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with pytest.raises(ValueError, match=r"dimension 1 of shape \(8, 4\) \(4\) is not divisible"):
        tx.state_specs({"w": jnp.ones((8, 4))}, mesh, {"w": P(None, ("data", "tensor"))})


def test_labels_must_be_strings(mesh8):
    inner = {"decay": optax.adamw(1e-3), "no_decay": optax.adam(1e-3)}
    tx = jaxsync.distributed_optimizer(inner, axis_name="data", labels={"b": None, "w": "decay"})
    with pytest.raises(TypeError, match=r"the label of param \['b'\] is None.*'no_decay'"):
        tx.state_specs(small_params(), mesh8)
    tx = jaxsync.distributed_optimizer(inner, axis_name="data", labels=lambda p: {"w": "decay"})
    with pytest.raises(ValueError, match="`labels` must have the structure of the params"):
        tx.state_specs(small_params(), mesh8)


def test_python_float_param_is_named(mesh8):
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data")
    with pytest.raises(TypeError, match=r"param \['scale'\] is a float \(1.0\), not an array"):
        tx.sharded_init({"w": jnp.ones(3), "scale": 1.0}, mesh8)


def test_broadcast_params_src_out_of_range(mesh8):
    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=P(), out_specs=P())
    def bcast(params):
        return jaxsync.broadcast_params(params, axis_name="data", src=8)

    # rank 8 does not exist: every param would have been zeroed
    with pytest.raises(ValueError, match=r"`src` must be a rank in \[0, 8\).*got 8"):
        bcast.trace(small_params())


# --------------------------------------------------------------------- FSDP
def fsdp_setup(mesh):
    params = {"a": {"w": jnp.ones((8, 4))}, "b": {"w": jnp.ones((4, 4)), "bias": jnp.zeros(4)}}
    fs = jaxsync.fully_shard(params, axis_name="data", units=["a", "b"], mesh=mesh)
    return params, fs


@pytest.mark.parametrize(
    "tx, match",
    [
        (
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            r"FullyShard.init_optimizer holds optax.clip_by_global_norm, which is not "
            r"elementwise: on a flat shard it clips by that shard's norm.*"
            r"`clip_grad_norm=max_norm`.*jaxsync.clip_by_global_norm\(max_norm",
        ),
        (optax.lamb(1e-3), "FullyShard.init_optimizer is not elementwise"),
        (  # jaxsync's own sharded clip is not blamed for lamb's trust ratio
            optax.chain(jaxsync.clip_by_global_norm(1.0, axis_name="data"), optax.lamb(1e-3)),
            "FullyShard.init_optimizer is not elementwise",
        ),
    ],
    ids=["clip_by_global_norm", "lamb", "sharded_clip_and_lamb"],
)
def test_fsdp_optimizer_must_be_elementwise(mesh8, tx, match):
    params, fs = fsdp_setup(mesh8)
    shards = fs.shard(params, mesh8)
    with pytest.raises(ValueError, match=match):
        fs.init_optimizer(tx, shards, mesh8)
    fs.init_optimizer(tx, shards, mesh8, check_elementwise=False)  # at your own risk


def test_fsdp_sharded_clip_passes_the_probe(mesh8):
    """jaxsync.clip_by_global_norm sums over the shards: the probe runs the ranks
    under vmap with the axis name, so it sees the same norm as on the tree."""
    params, fs = fsdp_setup(mesh8)
    tx = optax.chain(jaxsync.clip_by_global_norm(1.0, axis_name="data"), optax.adam(1e-3))
    fs.init_optimizer(tx, fs.shard(params, mesh8), mesh8)


def test_fsdp_bad_arguments(mesh8):
    params, fs = fsdp_setup(mesh8)
    with pytest.raises(
        ValueError, match=r"unknown unit 'c'; this FullyShard has units \['a', 'b'\]"
    ):
        fs.apply({"a": None, "b": None}, "c", lambda p, x: x, 1.0)
    with pytest.raises(ValueError, match=r"`shards` has no entry for unit 'b'"):
        fs.apply({"a": None}, "b", lambda p, x: x, 1.0)
    with pytest.raises(TypeError, match="`MixedPrecision.param_dtype` must be a floating dtype"):
        jaxsync.MixedPrecision(param_dtype=jnp.int8)
    # None is not a dtype here: it read as float64, which JAX truncated with a warning
    with pytest.raises(TypeError, match=r"`MixedPrecision.reduce_dtype` .* got None; leave"):
        jaxsync.MixedPrecision(reduce_dtype=None)
    with pytest.raises(TypeError, match=r"`reduce_dtype` must be a floating dtype .* got None"):
        jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name="data", reduce_dtype=None)
    with pytest.raises(TypeError, match=r"`ZeRO.reduce_dtype` .* got None"):
        jaxsync.ZeRO(reduce_dtype=None)
    assert jaxsync.DDP(reduce_dtype=None).reduce_dtype is None  # there: the gradients' own
    with pytest.raises(ValueError, match=r"\['a'\] appear more than once"):
        jaxsync.fully_shard(params, axis_name="data", units=["a", "a", "b"], mesh=mesh8)
    with pytest.raises(ValueError, match="`max_norm` must be a finite positive number"):
        jaxsync.clip_by_global_norm(-1.0, axis_name="data")
    with pytest.raises(ValueError, match=r"`microbatches=3` must divide .* shape \(4, 8\)"):
        fs.value_and_grad(lambda s, b: 0.0, {}, jnp.ones((4, 8)), microbatches=3)
    with pytest.raises(TypeError, match="`reshard_after_forward` must be True or False"):
        jaxsync.fully_shard(
            params, axis_name="data", units=["a", "b"], mesh=mesh8, reshard_after_forward="no"
        )


def test_fsdp_shard_rejects_params_of_another_structure(mesh8):
    """Units take their params by leaf position: renamed params of the same shapes
    would have been sharded under the wrong names."""
    params, fs = fsdp_setup(mesh8)
    renamed = {"a": params["a"], "c": params["b"]}
    with pytest.raises(ValueError, match="FullyShard.shard: `params` does not have the structure"):
        fs.shard(renamed, mesh8)

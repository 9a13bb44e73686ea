"""Finalize rules: the same logical model, trained with explicit shard_map
parallelism (pipeline + tensor + sequence parallel, or experts), equals one device."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

D, F, V, T = 8, 16, 11, 8
STEPS = 3


def reference_train(loss_fn, opt, params, xs, ys):
    """Plain optax on one device; returns the params and the last step's grad norm."""
    state = opt.init(params)
    for i in range(xs.shape[0]):
        g = jax.grad(loss_fn)(params, (xs[i], ys[i]))
        u, state = opt.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, optax.tree.norm(g)


def close(a, b, rtol=2e-5, atol=2e-6):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol),
        a,
        b,
    )


# ----------------------------------------------------------------- pipeline + TP + SP
def pp_params(key):
    ks = jax.random.split(key, 6)
    return {
        "embed": jax.random.normal(ks[0], (V, D)) * 0.5,
        "stages": {
            "ln": {
                "scale": 1.0 + 0.1 * jax.random.normal(ks[1], (2, D)),
                "bias": 0.1 * jax.random.normal(ks[2], (2, D)),
            },
            "w1": jax.random.normal(ks[3], (2, D, F)) / np.sqrt(D),
            "b1": jnp.zeros((2, F)),
            "w2": jax.random.normal(ks[4], (2, F, D)) / np.sqrt(F),
            "b2": 0.1 * jax.random.normal(ks[5], (2, D)),
        },
    }


PP_SPECS = {
    "embed": P(),
    "stages": {
        "ln": {"scale": P("pipe"), "bias": P("pipe")},
        "w1": P("pipe", None, "tensor"),
        "b1": P("pipe", "tensor"),
        "w2": P("pipe", "tensor", None),
        "b2": P("pipe"),
    },
}
PP_RULES = jaxsync.SyncRules.of(
    {
        r"^embed$": [jaxsync.Tied("pipe"), jaxsync.SequenceParallel("tensor")],
        r"^stages\.(ln\.|b2)": jaxsync.SequenceParallel("tensor"),
    }
)


def layernorm(x, scale, bias):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * scale + bias


def ce(logits, targets):
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def pp_reference_loss(params, batch):
    tokens, targets = batch
    x = params["embed"][tokens]
    for s in range(2):
        p = jax.tree.map(lambda a, s=s: a[s], params["stages"])
        h = layernorm(x, p["ln"]["scale"], p["ln"]["bias"])
        x = x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean(ce(x @ params["embed"].T, targets))


def pp_local_loss(params, batch):
    """Per device: stage `pipe`, sequence chunk `tensor`, batch rows `data`."""
    tokens, targets = batch  # (B_local, T / tensor)
    p = jax.tree.map(lambda a: a[0], params["stages"])  # this stage's layer

    def layer(x):
        h = layernorm(x, p["ln"]["scale"], p["ln"]["bias"])  # sequence-parallel region
        h = jax.lax.all_gather(h, "tensor", axis=1, tiled=True)
        o = jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]  # column- then row-parallel
        return x + jax.lax.psum_scatter(o, "tensor", scatter_dimension=1, tiled=True) + p["b2"]

    stage = jax.lax.axis_index("pipe")
    h = jax.lax.ppermute(layer(params["embed"][tokens]), "pipe", [(0, 1)])
    logits = layer(h) @ params["embed"].T
    per_token = jnp.sum(ce(logits, targets)) / (tokens.shape[0] * T)
    return jnp.where(stage == 1, per_token, 0.0)


def pp_batches(key, steps, batch=8):
    k1, k2 = jax.random.split(key)
    return (
        jax.random.randint(k1, (steps, batch, T), 0, V),
        jax.random.randint(k2, (steps, batch, T), 0, V),
    )


@pytest.fixture
def pp_mesh():
    require_devices(8)
    return jax.make_mesh((2, 2, 2), ("data", "pipe", "tensor"))


def put(tree, mesh, specs):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def test_pipeline_tensor_sequence_parallel_grads(pp_mesh):
    params = pp_params(jax.random.PRNGKey(0))
    toks, tgts = pp_batches(jax.random.PRNGKey(1), 1)
    ref = jax.grad(pp_reference_loss)(params, (toks[0], tgts[0]))

    @jax.jit
    @partial(
        jax.shard_map, mesh=pp_mesh, in_specs=(PP_SPECS, P("data", "tensor")), out_specs=PP_SPECS
    )
    def grads(params, batch):
        _, g = jaxsync.value_and_grad(pp_local_loss, axis_name="data", rules=PP_RULES)(
            params, batch
        )
        return jaxsync.all_reduce_grads(g, axis_name="data", rules=PP_RULES, bucket_size=64)

    batch = jax.device_put((toks[0], tgts[0]), NamedSharding(pp_mesh, P("data", "tensor")))
    got = grads(put(params, pp_mesh, PP_SPECS), batch)
    close(ref, got)
    assert float(jnp.abs(ref["embed"]).sum()) > 0


def _pp_step(mesh, tx, params):
    specs = tx.state_specs(params, mesh)

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(PP_SPECS, specs, P("data", "tensor")),
        out_specs=(PP_SPECS, specs),
    )
    def step(params, state, batch):
        _, g = jaxsync.value_and_grad(pp_local_loss, axis_name="data", rules=PP_RULES)(
            params, batch
        )
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    def run(params, state, toks, tgts, lo, hi):
        for i in range(lo, hi):
            batch = jax.device_put((toks[i], tgts[i]), NamedSharding(mesh, P("data", "tensor")))
            params, state = step(params, state, batch)
        return params, state

    return run


def test_pipeline_tensor_sequence_parallel_distributed_optimizer(pp_mesh):
    params = pp_params(jax.random.PRNGKey(0))
    toks, tgts = pp_batches(jax.random.PRNGKey(1), STEPS)
    opt = optax.adam(1e-2)
    max_norm = 0.5
    ref_opt = optax.chain(optax.clip_by_global_norm(max_norm), opt)
    ref_params, last_norm = reference_train(pp_reference_loss, ref_opt, params, toks, tgts)

    tx = jaxsync.distributed_optimizer(
        opt, axis_name="data", rules=PP_RULES, clip_grad_norm=max_norm, bucket_size=64
    )
    gparams = put(params, pp_mesh, PP_SPECS)
    state = tx.sharded_init(gparams, pp_mesh)
    layout = tx.layout(gparams, pp_mesh)
    keys = {(b.key.axes, b.key.sum_axes, b.key.varying) for b in layout.buffers}
    assert keys == {
        (("data",), (("pipe", None), ("tensor", None)), ()),  # tied embedding
        (("data",), (("tensor", None),), ("pipe",)),  # SP layernorm, b2
        (("data",), (), ("pipe", "tensor")),  # TP weights per stage
    }

    gparams, state = _pp_step(pp_mesh, tx, gparams)(gparams, state, toks, tgts, 0, STEPS)
    np.testing.assert_allclose(state.metrics.grad_norm, last_norm, rtol=1e-5)
    assert float(last_norm) > max_norm  # clipping was active
    close(ref_params, gparams, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- MoE
E = 2


def moe_params(key):
    ks = jax.random.split(key, 4)
    return {
        "router": jax.random.normal(ks[0], (D, E)),
        "experts": {
            "w1": jax.random.normal(ks[1], (E, D, F)) / np.sqrt(D),
            "w2": jax.random.normal(ks[2], (E, F, D)) / np.sqrt(F),
        },
        "out": jax.random.normal(ks[3], (D, 3)) / np.sqrt(D),
    }


MOE_SPECS = {"router": P(), "experts": {"w1": P("expert"), "w2": P("expert")}, "out": P()}
MOE_RULES = jaxsync.SyncRules.of({r"^experts\.": jaxsync.ExpertParallel("expert")})
AXES = ("data", "expert")


def moe_reference_loss(params, batch):
    x, y = batch
    gate = jax.nn.softmax(x @ params["router"])
    mix = sum(
        gate[:, e : e + 1]
        * (jax.nn.gelu(x @ params["experts"]["w1"][e]) @ params["experts"]["w2"][e])
        for e in range(E)
    )
    return jnp.mean(((x + mix) @ params["out"] - y) ** 2)


def moe_local_loss(params, batch):
    """Tokens of the expert group are gathered, each rank runs its own expert."""
    x, y = batch
    gate = jax.nn.softmax(x @ params["router"])
    xa = jax.lax.all_gather(x, "expert", tiled=True)
    ga = jax.lax.all_gather(gate, "expert", tiled=True)
    e = jax.lax.axis_index("expert")
    h = jax.nn.gelu(xa @ params["experts"]["w1"][0]) @ params["experts"]["w2"][0]
    mine = jnp.take(ga, e, axis=1)[:, None] * h
    mix = jax.lax.psum_scatter(mine, "expert", tiled=True)
    return jnp.mean(((x + mix) @ params["out"] - y) ** 2)


@pytest.fixture
def moe_mesh():
    require_devices(8)
    return jax.make_mesh((4, 2), AXES)


def moe_batches(key, steps, batch=16):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (steps, batch, D)), jax.random.normal(k2, (steps, batch, 3))


def test_expert_parallel_grads(moe_mesh):
    params = moe_params(jax.random.PRNGKey(0))
    xs, ys = moe_batches(jax.random.PRNGKey(1), 1)
    ref = jax.grad(moe_reference_loss)(params, (xs[0], ys[0]))

    @jax.jit
    @partial(jax.shard_map, mesh=moe_mesh, in_specs=(MOE_SPECS, P(AXES)), out_specs=MOE_SPECS)
    def grads(params, batch):
        _, g = jaxsync.value_and_grad(moe_local_loss, axis_name=AXES, rules=MOE_RULES)(
            params, batch
        )
        return jaxsync.all_reduce_grads(g, axis_name=AXES, rules=MOE_RULES)

    batch = jaxsync.shard_batch((xs[0], ys[0]), moe_mesh, axis_name=AXES)
    lowered = grads.lower(put(params, moe_mesh, MOE_SPECS), batch)
    got = lowered.compile()(put(params, moe_mesh, MOE_SPECS), batch)
    close(ref, got)
    # two buffers (experts over `data` only, the rest over both axes): two all-reduces
    # of gradients, plus the all-gathers / reduce-scatter of the model itself
    assert jaxsync.lowered_collective_counts(lowered.as_text())["all-reduce"] == 2


def test_expert_parallel_distributed_optimizer(moe_mesh):
    params = moe_params(jax.random.PRNGKey(0))
    xs, ys = moe_batches(jax.random.PRNGKey(1), STEPS)
    opt = optax.adam(1e-2)
    ref_params, last_norm = reference_train(moe_reference_loss, opt, params, xs, ys)

    tx = jaxsync.distributed_optimizer(opt, axis_name=AXES, rules=MOE_RULES, clip_grad_norm=1e3)
    gparams = put(params, moe_mesh, MOE_SPECS)
    state = tx.sharded_init(gparams, moe_mesh)
    specs = tx.state_specs(gparams, moe_mesh)
    layout = tx.layout(gparams, moe_mesh)
    by_axes = {b.key.axes: b for b in layout.buffers}
    assert by_axes[("data",)].num_shards == 4 and by_axes[AXES].num_shards == 8
    assert by_axes[("data",)].key.varying == ("expert",)

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=moe_mesh,
        in_specs=(MOE_SPECS, specs, P(AXES)),
        out_specs=(MOE_SPECS, specs),
    )
    def step(params, state, batch):
        _, g = jaxsync.value_and_grad(moe_local_loss, axis_name=AXES, rules=MOE_RULES)(
            params, batch
        )
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(STEPS):
        gparams, state = step(
            gparams, state, jaxsync.shard_batch((xs[i], ys[i]), moe_mesh, axis_name=AXES)
        )
    np.testing.assert_allclose(state.metrics.grad_norm, last_norm, rtol=1e-5)
    close(ref_params, gparams, rtol=1e-4, atol=1e-5)


def test_tied_groups_sum_within_each_group():
    require_devices(8)
    mesh = jax.make_mesh((2, 4), ("data", "pipe"))
    vals = jax.device_put(jnp.arange(8.0).reshape(2, 4), NamedSharding(mesh, P("data", "pipe")))

    def run(groups):
        rules = jaxsync.SyncRules.of({"w": jaxsync.Tied("pipe", groups=groups)})

        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=P("data", "pipe"), out_specs=P("data", "pipe"))
        def f(v):  # rank (d, s) holds the gradient d * 4 + s
            g = {"w": v[0, 0] * jnp.ones((3,))}
            out = jaxsync.all_reduce_grads(g, axis_name="data", rules=rules, average=False)
            return out["w"][:1][None]

        return np.asarray(f(vals))

    # summed over data, stage s holds [4, 6, 8, 10]
    np.testing.assert_array_equal(run(((0, 3), (1, 2))), [[14, 14, 14, 14]] * 2)
    np.testing.assert_array_equal(run(((0, 3),)), [[14, 6, 8, 14]] * 2)  # 1, 2 keep theirs
    np.testing.assert_array_equal(run(None), [[28, 28, 28, 28]] * 2)


def _resolve(
    rules,
    names=("embed", "ln.scale", "w"),
    dp=("data",),
    shape=(("data", 2), ("pipe", 2), ("tensor", 2)),
):
    params = {n: jnp.zeros(3) for n in names}
    return rules.resolve(params, dp, dict(shape))


@pytest.mark.parametrize(
    "rules, match",
    [
        ({"embed": jaxsync.Tied("stage")}, r"axis 'stage', which is not in the mesh.*'pipe'"),
        ({"embed": jaxsync.SequenceParallel("data")}, "is a data-parallel axis"),
        ({"embeding": jaxsync.Tied("pipe")}, r"pattern 'embeding' .* matches no parameter"),
        ({"w": jaxsync.ExpertParallel("tensor")}, "must be one of the data-parallel axes"),
        ({"embed": jaxsync.Tied("pipe", groups=((0, 2),))}, r"groups must be disjoint .*\[0, 2\)"),
        (
            {"embed": jaxsync.Tied("pipe"), "emb": jaxsync.Tied("pipe", groups=((0, 1),))},
            "conflicting rules on axis 'pipe'",
        ),
        (
            {"ln": [jaxsync.SequenceParallel("tensor"), jaxsync.SequenceParallel("tensor", True)]},
            "conflicting rules on axis 'tensor'",
        ),
    ],
)
def test_bad_rules(rules, match):
    with pytest.raises(ValueError, match=match):
        _resolve(jaxsync.SyncRules.of(rules))


def test_rules_compose_on_different_axes():
    (embed, ln, w) = _resolve(
        jaxsync.SyncRules.of(
            {
                "embed": [jaxsync.Tied("pipe"), jaxsync.SequenceParallel("tensor")],
                r"^ln\.": jaxsync.SequenceParallel("tensor", average=True),
            }
        )
    )
    assert embed.sum_axes == (("pipe", None), ("tensor", None))
    assert ln.mean_axes == ("tensor",) and w == jaxsync.ParamSync(("data",))


def test_param_sharded_over_a_data_axis_is_rejected(moe_mesh):
    tx = jaxsync.distributed_optimizer(optax.sgd(0.1), axis_name=AXES)
    params = put(moe_params(jax.random.PRNGKey(0)), moe_mesh, MOE_SPECS)
    with pytest.raises(ValueError, match=r"param experts.w1 differs across data-parallel axes"):
        tx.sharded_init(params, moe_mesh)


def test_model_parallel_state_checkpoint_resumes_on_fewer_data_ranks(tmp_path, pp_mesh):
    """Tensor/pipe-sharded optimizer state is saved per (global) parameter too."""
    params = pp_params(jax.random.PRNGKey(0))
    toks, tgts = pp_batches(jax.random.PRNGKey(1), 4)
    tx = jaxsync.distributed_optimizer(
        optax.adam(1e-2), axis_name="data", rules=PP_RULES, bucket_size=64
    )
    small = jax.make_mesh((1, 2, 2), ("data", "pipe", "tensor"), devices=jax.devices()[:4])
    p8 = put(params, pp_mesh, PP_SPECS)
    p8, s8 = _pp_step(pp_mesh, tx, p8)(p8, tx.sharded_init(p8, pp_mesh), toks, tgts, 0, 2)
    port = tx.to_portable(s8, p8, pp_mesh)
    np.testing.assert_allclose(  # the saved master of a tensor-sharded weight is global
        np.asarray(port["master"]["stages.w1"]), np.asarray(p8["stages"]["w1"]), rtol=1e-6
    )
    ckpt = jaxsync.Checkpointer(tmp_path / "ckpt", async_save=False)
    ckpt.save(2, params=p8, opt_state=s8, tx=tx, mesh=pp_mesh)
    ref, _ = _pp_step(pp_mesh, tx, p8)(p8, s8, toks, tgts, 2, 4)

    like = put(params, small, PP_SPECS)
    r = ckpt.restore(params_like=like, tx=tx, mesh=small)
    back = tx.to_portable(r.opt_state, r.params, small)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), port, back
    )
    got, _ = _pp_step(small, tx, r.params)(r.params, r.opt_state, toks, tgts, 2, 4)
    close(ref, got, rtol=1e-5, atol=1e-6)

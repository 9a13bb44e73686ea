"""jaxsync.train_step: flax NNX models trained in each mode equal single-device optax.

Tiny models, three steps, one compile per test: the whole file is meant to stay
well under a minute on two CPU cores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from tests.helpers import nnx_reference

RTOL, ATOL = 3e-5, 3e-6


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 9, rngs=rngs)
        self.l2 = nnx.Linear(9, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(self.ln(x)))


class Scanned(nnx.Module):
    """Blocks stacked by nnx.vmap and run by jaxsync.scan_layers (lax.scan + tap)."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 3, tapped: bool = True):
        self.tapped = tapped
        self.inp = nnx.Linear(6, 8, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(8, rngs)

        self.blocks = stack(rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        if self.tapped:
            h = jaxsync.scan_layers(self.blocks, lambda block, h: block(h), h)
        else:  # scanned by hand, without jaxsync.tap: the builder must refuse it
            graphdef, state = nnx.split(self.blocks)

            def body(h, layer):
                st = jax.tree.map(lambda v: v, state)
                nnx.replace_by_pure_dict(st, layer)
                return nnx.merge(graphdef, st)(h), None

            h, _ = jax.lax.scan(body, h, nnx.to_pure_dict(state))
        return self.out(h)


class Stateful(nnx.Module):
    """BatchNorm statistics and a dropout RNG counter: model state besides params."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 9, rngs=rngs)
        self.bn = nnx.BatchNorm(9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(9, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jnp.tanh(self.bn(self.l1(x)))))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def make_batches(steps: int = 3, rows: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((rows, 6), np.float32), rng.standard_normal((rows, 3), np.float32))
        for _ in range(steps)
    ]


_REFERENCES: dict[str, tuple] = {}


def cached_reference(key: str, make_model, make_tx, batches):
    """:func:`reference`, computed once per ``key`` (the modes share their reference)."""
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(make_model(), make_tx(), batches)
    return _REFERENCES[key]


def reference(model: nnx.Module, tx, batches):
    """Single-device optax on the whole batch; returns (params, last grad norm)."""
    return nnx_reference(model, tx, loss_fn, batches)


def params_of(model: nnx.Module):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def assert_close(got, want, rtol=RTOL, atol=ATOL):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol, atol),
        got,
        want,
    )


def shardings(tree):
    return [x.sharding for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_nnx_module_matches_single_device_optax(mesh8, mode):
    batches = make_batches()
    step = jaxsync.train_step(loss_fn, optax.adam(1e-2), mesh8, mode=mode, clip_grad_norm=0.5)
    model = MLP(nnx.Rngs(0))
    state = step.init(*nnx.split(model)) if mode == "fsdp" else step.init(model)
    specs, before = step.state_specs(state), shardings(state)
    for b in batches:  # host numpy batches: the step places them
        state, loss = step(state, b)
    clipped_adam = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    want, norm = cached_reference("mlp", lambda: MLP(nnx.Rngs(0)), clipped_adam, batches)
    model = step.model(state)
    assert isinstance(model, MLP)
    assert_close(params_of(model), want)
    assert_close(step.master(state), want)  # fp32 master, shaped like the params
    # one state API: same specs and shardings after steps, metrics in every mode
    assert step.state_specs(state) == specs and shardings(state) == before
    assert int(state.step) == 3 and not bool(state.metrics.skipped)
    np.testing.assert_allclose(state.metrics.grad_norm, norm, rtol=1e-5)
    assert float(state.loss_scale.scale) == 1.0 and np.isfinite(loss) and loss.shape == ()
    if mode != "ddp":  # optimizer state: 1/8 per device
        held = [x for x in jax.tree.leaves(state.opt_state) if "data" in str(x.sharding.spec)]
        assert len(held) >= 2  # Adam's moments (and ZeRO's master)
        assert all(x.addressable_shards[0].data.size * 8 == x.size for x in held)


@pytest.mark.parametrize(("mode", "microbatches"), [("ddp", 2), ("zero", 2), ("fsdp", 1)])
def test_scanned_stack_syncs_in_the_loop(mesh8, mode, microbatches):
    batches = make_batches()
    step = jaxsync.train_step(
        loss_fn, optax.adamw(1e-2), mesh8, mode=mode, stacked="blocks", microbatches=microbatches
    )
    state = step.init(Scanned(nnx.Rngs(0)))
    for b in batches:
        state, _ = step(state, b)
    want, _ = cached_reference(
        "scanned", lambda: Scanned(nnx.Rngs(0)), lambda: optax.adamw(1e-2), batches
    )
    assert_close(params_of(step.model(state)), want)
    # each layer's gradient is reduce-scattered inside the backward scan (3 layers);
    # DDP too, and it gathers the reduced stack after the loop, for its replicated update
    report = jaxsync.overlap_report(step.lower(state, batches[0]).compile())
    in_loop = report.in_loop(kind="reduce-scatter", role="backward")
    assert in_loop and all(c.trip_count == 3 for c in in_loop), report
    if mode == "ddp":
        gathers = [c for c in report.collectives if c.kind == "all-gather"]
        assert gathers and not report.in_loop(kind="all-gather"), report
        assert not report.in_loop(kind="all-reduce"), report


def test_model_state_is_kept_across_steps(mesh8):
    """BatchNorm's running mean is averaged over devices (= the global batch's, as on
    one device) and the dropout RNG counter advances, once per step."""
    batch = make_batches(steps=1)[0]
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, mode="fsdp")
    state = step.init(Stateful(nnx.Rngs(0)))
    state, _ = step(state, batch)
    ref = Stateful(nnx.Rngs(0))
    ref(batch[0])  # one forward pass in training mode updates the statistics
    assert_close(step.model(state).bn.mean[...], ref.bn.mean[...])
    state, _ = step(state, batch)
    assert int(step.model(state).drop.rngs.count[...]) == 2


def test_plain_pytree_microbatches_and_loss_scale_skip(mesh8):
    """Params as a plain pytree, FSDP with microbatches and a dynamic loss scale: a
    NaN batch is skipped (params unchanged, scale backs off, counted in metrics)."""
    model = MLP(nnx.Rngs(1))
    params = params_of(model)
    graphdef, params_state = nnx.split(model, nnx.Param)

    def pytree_loss(params, batch):
        st = jax.tree.map(lambda v: v, params_state)
        nnx.replace_by_pure_dict(st, params)
        return loss_fn(nnx.merge(graphdef, st), batch)

    scaler = jaxsync.DynamicLossScale(initial_scale=2.0**10, hysteresis=1)
    step = jaxsync.train_step(
        pytree_loss, optax.sgd(0.1), mesh8, mode="fsdp", microbatches=2, loss_scale=scaler
    )
    state = step.init(params)
    good = make_batches(steps=1)[0]
    state, _ = step(state, good)
    after_one = step.params(state)
    want, _ = reference(MLP(nnx.Rngs(1)), optax.sgd(0.1), [good])
    assert_close(after_one, want)
    bad = (good[0].copy(), good[1])
    bad[0][5, 2] = np.nan
    state, _ = step(state, bad)
    jax.tree.map(np.testing.assert_array_equal, step.params(state), after_one)
    m = state.metrics
    assert bool(m.skipped) and int(m.skipped_steps) == 1 and int(state.step) == 1
    assert float(state.loss_scale.scale) == 2.0**9


def test_rules_reach_the_sync():
    """Sequence parallelism over "tensor" (each tensor rank takes half of its data
    rank's rows): the rule averages those partial gradients over "tensor"; without
    it JAX's autodiff would sum them (SGD shows the factor 2)."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))

    def sp_loss(model, batch):
        half = jax.tree.map(lambda x: x.reshape(2, -1, *x.shape[1:]), batch)
        mine = jax.tree.map(lambda x: x[jax.lax.axis_index("tensor")], half)
        return loss_fn(model, mine)

    rules = jaxsync.SyncRules.of({r".": jaxsync.SequenceParallel("tensor", average=True)})
    step = jaxsync.train_step(sp_loss, optax.sgd(0.1), mesh, mode="zero", rules=rules)
    state = step.init(MLP(nnx.Rngs(2)))
    batches = make_batches(steps=2)
    for b in batches:
        state, loss = step(state, b)
    want, _ = reference(MLP(nnx.Rngs(2)), optax.sgd(0.1), batches)
    assert_close(params_of(step.model(state)), want)
    np.testing.assert_allclose(loss, loss_fn(step.model(state), batches[-1]), rtol=0.5)


def test_bad_input_is_named(mesh8):
    batch = make_batches(steps=1)[0]
    with pytest.raises(ValueError, match=r"`mode` must be jaxsync.DDP\(...\), jaxsync.ZeRO"):
        jaxsync.train_step(loss_fn, optax.adam(1e-3), mesh8, mode="zero3")
    with pytest.raises(ValueError, match="axis"):
        jaxsync.train_step(loss_fn, optax.adam(1e-3), mesh8, axis_name="batch")
    with pytest.raises(TypeError, match="`tx` must be an optax"):
        jaxsync.train_step(loss_fn, lambda g: g, mesh8)
    with pytest.raises(
        ValueError, match=r"`rules` is an option of jaxsync.DDP or jaxsync.ZeRO, not of mode='fsdp'"
    ):
        jaxsync.train_step(loss_fn, optax.adam(1e-3), mesh8, mode="fsdp",
                           rules=jaxsync.SyncRules.of({}))  # fmt: skip

    step = jaxsync.train_step(loss_fn, optax.adam(1e-3), mesh8, mode="ddp", microbatches=2)
    state = step.init(MLP(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"batch axis 0 must divide evenly over axis \('data',\)"):
        step(state, (batch[0][:12], batch[1][:12]))
    with pytest.raises(ValueError, match="`microbatches=2` does not divide"):
        step(state, (batch[0][:8], batch[1][:8]))
    with pytest.raises(TypeError, match="`state` must be the TrainState"):
        step(state.params, batch)

    def per_row(model, batch):
        return (model(batch[0]) - batch[1]) ** 2

    bad = jaxsync.train_step(per_row, optax.adam(1e-3), mesh8, mode="zero")
    with pytest.raises(ValueError, match="`loss_fn` must return a scalar loss"):
        bad(bad.init(MLP(nnx.Rngs(0))), batch)

    # a scanned model that bypasses jaxsync.tap would lose its stacked gradients; under
    # FSDP it read the stack's placeholders and failed in JAX's lowering instead
    for mode in ("zero", "ddp", "fsdp"):
        untapped = jaxsync.train_step(loss_fn, optax.adam(1e-3), mesh8, mode, stacked="blocks")
        with pytest.raises(ValueError, match="no scanned layer body passed its layer through"):
            untapped(untapped.init(Scanned(nnx.Rngs(0), tapped=False)), batch)


def test_fully_shard_takes_the_mesh_once(mesh8):
    params = params_of(MLP(nnx.Rngs(0)))
    fs = jaxsync.fully_shard(params, axis_name="data", units=["l1", "l2"], mesh=mesh8)
    shards = fs.shard(params)
    opt_state, specs = fs.init_optimizer(optax.adam(1e-3), shards)
    assert specs[0].mu == fs.specs() and fs.state_specs(optax.adam(1e-3)) == specs
    again = fs.sharded_init(
        optax.adam(1e-3), shards, check_elementwise=False
    )  # the distributed optimizer's names
    assert jax.tree.map(lambda x: x.sharding, again) == jax.tree.map(
        lambda x: x.sharding, opt_state
    )
    assert all(s.sharding == NamedSharding(mesh8, P("data")) for s in shards.values())
    assert_close(fs.unshard(shards), params, rtol=0, atol=0)
    assert_close(fs.unshard(shards, mesh8), params, rtol=0, atol=0)  # the old signature


def test_deterministic_step_rejects_what_it_does_not_cover(mesh8):
    det = jaxsync.Deterministic(units=8)
    tx = optax.adam(1e-3)
    with pytest.raises(ValueError, match="mode='fsdp'"):
        jaxsync.train_step(loss_fn, tx, mesh8, mode="fsdp", deterministic=det)
    with pytest.raises(ValueError, match="microbatches=2.*units"):
        jaxsync.train_step(loss_fn, tx, mesh8, microbatches=2, deterministic=det)


def decay_matrices(params):
    return jax.tree.map(lambda p: "decay" if p.ndim > 1 else "no_decay", params)


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_labels_give_weight_decay_to_matrices_only(mesh8, mode):
    """``labels=`` with a mapping of optimizers: optax.multi_transform on one device."""
    batches = make_batches(steps=3)

    def inner():
        return {"decay": optax.adamw(1e-2, weight_decay=0.5), "no_decay": optax.adam(1e-2)}

    step = jaxsync.train_step(loss_fn, inner(), mesh8, mode=mode, labels=decay_matrices)
    state = step.init(MLP(nnx.Rngs(0)))
    for b in batches:
        state, _ = step(state, b)
    want = cached_reference(
        "labels", lambda: MLP(nnx.Rngs(0)),
        lambda: optax.multi_transform(inner(), decay_matrices), batches,
    )[0]  # fmt: skip
    assert_close(params_of(step.model(state)), want)
    # the decay took effect (3 steps of lr 1e-2 x wd 0.5 move the kernels off plain Adam's)
    plain = cached_reference("adam", lambda: MLP(nnx.Rngs(0)), lambda: optax.adam(1e-2), batches)
    got = params_of(step.model(state))
    assert np.abs(got["l1"]["kernel"] - plain[0]["l1"]["kernel"]).max() > 1e-4


def test_labels_are_checked(mesh8):
    tx = {"decay": optax.adamw(1e-2), "no_decay": optax.adam(1e-2)}
    with pytest.raises(ValueError, match="pass `labels`"):
        jaxsync.train_step(loss_fn, tx, mesh8)
    with pytest.raises(TypeError, match="'no_decay': str"):
        jaxsync.train_step(loss_fn, {"decay": tx["decay"], "no_decay": "adam"}, mesh8,
                           labels=decay_matrices)  # fmt: skip


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_the_step_program_is_named_after_its_mode(mesh8, mode):
    """Profiles, XLA dumps and compile logs name the program: jit_jaxsync_zero_step."""
    step = jaxsync.train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1), mesh8, mode)
    state = step.init({"w": jnp.ones((4, 2))})
    text = step.lower(state, jnp.ones((8, 4))).as_text()
    assert f"module @jit_jaxsync_{mode}_step" in text


def test_a_placed_batch_is_not_put_again(mesh8, monkeypatch):
    """A leaf placed over the data axes already (by `place`, or a loader) is used as
    it is: no `device_put` on every step (about 0.5 ms of Python per leaf on 8 CPU
    devices); one on another spec is placed anew. Steps on either equal the step on
    the host batch."""
    step = jaxsync.train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1), mesh8)
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    placed = step.place(host)
    by_user = jax.device_put(host, NamedSharding(mesh8, P("data")))
    replicated = jax.device_put(host, NamedSharding(mesh8, P()))
    puts = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(1) or real_put(*a, **k))
    assert step.place(placed) is placed and step.place(by_user) is by_user and not puts
    other = step.place(replicated)
    assert puts and other.sharding.is_equivalent_to(placed.sharding, 2)
    monkeypatch.undo()
    want = step.params(step(step.init({"w": jnp.ones((4, 2))}), host)[0])
    for batch in (placed, by_user, other):
        got = step.params(step(step.init({"w": jnp.ones((4, 2))}), batch)[0])
        jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("mode", ["ddp", "zero"])
def test_the_loss_returned_under_summing_rules_is_the_objective_trained(mode):
    """Sequence parallelism by hand, each tensor rank's loss its chunk's share of the
    whole (``SequenceParallel``'s default sums the gradients over "tensor"): the step
    trained the sum of the pieces but returned their mean, half the single-device loss
    (found by probing). A tie over pipeline stages likewise sums its stages' terms."""
    seq = 8
    x = np.random.default_rng(0).standard_normal((16, seq)).astype(np.float32)
    p0 = {"w": jnp.linspace(0.5, 1.5, seq)}

    def whole(p, x):
        return jnp.mean((x * p["w"]) ** 2)

    def piece(p, x):
        r = jax.lax.axis_index("tensor")
        xs = jax.lax.dynamic_slice_in_dim(x, r * (seq // 2), seq // 2, 1)
        ws = jax.lax.dynamic_slice_in_dim(p["w"], r * (seq // 2), seq // 2)
        return jnp.sum((xs * ws) ** 2) / (x.shape[0] * seq)

    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    rules = jaxsync.SyncRules.of({"w": jaxsync.SequenceParallel("tensor")})
    step = jaxsync.train_step(piece, optax.sgd(0.1), mesh, mode, rules=rules)
    state, loss = step(step.init(p0), x)
    np.testing.assert_allclose(float(loss), float(whole(p0, x)), rtol=1e-6)
    want = p0["w"] - 0.1 * jax.grad(whole)(p0, x)["w"]
    np.testing.assert_allclose(np.asarray(step.params(state)["w"]), want, rtol=1e-6)

    # four pipeline stages, each adding its term; the tied param sums their gradients
    pipe = jax.make_mesh((2, 4), ("data", "pipe"))

    def staged(p, x):
        return jnp.mean((x * (jax.lax.axis_index("pipe") + 1.0)) @ p["w"])

    tied = jaxsync.SyncRules.of({"w": jaxsync.Tied("pipe")})
    step = jaxsync.train_step(staged, optax.sgd(1.0), pipe, mode, rules=tied)
    _, loss = step(step.init({"w": jnp.full((seq,), 0.5)}), x[:, :seq])
    want = sum(float(jnp.mean((x * (s + 1.0)) @ jnp.full((seq,), 0.5))) for s in range(4))
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)


def test_a_tie_within_stage_groups_is_refused_by_a_train_step():
    """A train step holds params under rules replicated over the stages; a grouped tie
    made the groups' copies differ and failed inside JAX (found by probing)."""
    pipe = jax.make_mesh((2, 4), ("data", "pipe"))
    for groups in (((0, 2), (1, 3)), ((0, 1, 2, 3),)):
        rules = jaxsync.SyncRules.of({"w": jaxsync.Tied("pipe", groups=groups)})
        with pytest.raises(ValueError, match=r"Tied\('pipe', groups=.*Pass `groups=None`"):
            jaxsync.train_step(loss_fn, optax.sgd(0.1), pipe, "ddp", rules=rules)

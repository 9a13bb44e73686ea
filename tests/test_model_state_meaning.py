"""One step, one meaning (issue 41): an NNX module's state besides its params is, after
a step, what ONE device computes on the GLOBAL batch, over devices and microbatches.

Before: float state was averaged over devices (a running max of 4.0 read as the mean
of 8 devices' maxima), integer state took the maximum over devices, and with
microbatches only the last microbatch's update was kept (a row counter read 2 for 32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsync

ROWS = 32


class Amax(nnx.Variable):
    """A running maximum of |x| (an fp8 amax): declared ``"max"``."""


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.bn = nnx.BatchNorm(6, momentum=0.9, rngs=rngs)
        self.lin = nnx.Linear(6, 4, rngs=rngs)
        self.rngs = nnx.Rngs(noise=1)  # an RngCount that every call advances
        self.amax = Amax(jnp.zeros((), jnp.float32))
        self.seen = nnx.Variable(jnp.zeros((), jnp.int32))  # rows seen: a counter

    def __call__(self, x):
        self.amax[...] = jnp.maximum(self.amax[...], jnp.max(jnp.abs(x)))
        self.seen[...] = self.seen[...] + x.shape[0]
        self.rngs.noise()  # a key drawn (unused): the stream's count advances once
        return self.lin(self.bn(x))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def batches(steps=2):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(ROWS, 6)).astype(np.float32)
        x[5] *= 10.0  # one device holds the global maximum
        out.append((x, rng.normal(size=(ROWS, 4)).astype(np.float32)))
    return out


def one_device(bs, lr=0.1):
    """Plain optax SGD on one device on the global batches: the model after them."""
    graphdef, pst, rst = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, rest, b):
        p, r = jax.tree.map(lambda v: v, pst), jax.tree.map(lambda v: v, rst)
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(r, rest)
        model = nnx.merge(graphdef, p, r)
        return loss_fn(model, b), nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

    params, rest = nnx.to_pure_dict(pst), nnx.to_pure_dict(rst)
    opt = optax.sgd(lr)
    ostate = opt.init(params)
    for b in bs:
        (_, rest), g = jax.value_and_grad(loss, has_aux=True)(params, rest, b)
        updates, ostate = opt.update(g, ostate, params)
        params = optax.apply_updates(params, updates)
    nnx.replace_by_pure_dict(pst, params)
    nnx.replace_by_pure_dict(rst, rest)
    return nnx.merge(graphdef, pst, rst)


def two_d_net():
    """A (data=4, model=2) mesh and a Net whose kernel is split over "model"."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    net = Net(nnx.Rngs(0))
    net.lin.kernel[...] = jax.device_put(net.lin.kernel[...], NamedSharding(mesh, P(None, "model")))
    return mesh, net


@pytest.mark.parametrize(
    ("mode", "k", "two_d"),
    [("zero", 1, False), ("ddp", 2, False), ("fsdp", 4, False), ("zero", 2, True),
     ("fsdp", 2, True)],
)  # fmt: skip
def test_state_is_the_one_device_state(mesh8, mode, k, two_d):
    bs = batches()
    mesh, net = two_d_net() if two_d else (mesh8, Net(nnx.Rngs(0)))
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh, mode, microbatches=k,
                              state_reduce={"amax": "max"})  # fmt: skip
    state = step.init(net)
    for b in bs:
        state, _ = step(state, b)
    got, want = step.model(state), one_device(bs)
    np.testing.assert_allclose(got.amax[...], want.amax[...], rtol=1e-6)
    assert int(got.seen[...]) == int(want.seen[...]) == 2 * ROWS
    assert got.seen[...].dtype == jnp.int32
    # A mean of the pieces' EMAs: exactly the global batch's EMA (equal pieces).
    np.testing.assert_allclose(got.bn.mean[...], want.bn.mean[...], rtol=1e-5, atol=1e-6)
    assert int(got.rngs.noise.count[...]) == int(want.rngs.noise.count[...]) == 2
    # (The params are not compared: BatchNorm normalizes each device's rows by their
    # own statistics, as PyTorch DDP without SyncBatchNorm does.)


def test_an_undeclared_float_state_that_differs_is_refused_by_name(mesh8):
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, "ddp")
    state = step.init(Net(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"`amax` \(Amax, float32\).*state_reduce=\{'amax'"):
        step(state, batches(1)[0])
    with pytest.raises(ValueError, match=r"`state_reduce` names \['nope'\]"):
        step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, state_reduce={"nope": "max"})
        step(step.init(Net(nnx.Rngs(0))), batches(1)[0])
    with pytest.raises(ValueError, match="one of"):
        jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, state_reduce={"amax": "rows"})


def test_a_skipped_step_keeps_the_float_state(mesh8):
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, "zero", microbatches=2,
                              state_reduce={"amax": "max"})  # fmt: skip
    state = step.init(Net(nnx.Rngs(0)))
    state, _ = step(state, batches(1)[0])
    before = step.model(state)
    mean, amax = np.asarray(before.bn.mean[...]), float(before.amax[...])
    x, y = batches(1)[0]
    x = x.copy()
    x[3, 1] = np.nan
    state, _ = step(state, (x, y))
    after = step.model(state)
    assert bool(state.metrics.skipped)
    np.testing.assert_array_equal(after.bn.mean[...], mean)
    assert float(after.amax[...]) == amax


def test_a_key_state_is_never_combined(mesh8):
    step = jaxsync.train_step(loss_fn, optax.sgd(0.1), mesh8, "ddp",
                              state_reduce={"amax": "max", "rngs.noise.key": "max"})  # fmt: skip
    with pytest.raises(ValueError, match=r"PRNG key state `rngs.noise.key`"):
        step(step.init(Net(nnx.Rngs(0))), batches(1)[0])


# ------------------------------------------------------------------ flax linen
def linen_model():
    import flax.linen as nn

    class LinenNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen = self.variable("counters", "seen", lambda: jnp.zeros((), jnp.int32))
            if not self.is_initializing():
                seen.value = seen.value + x.shape[0]
            h = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
            return nn.Dense(4)(h)

    return LinenNet()


def linen_loss(model):
    def loss(variables, batch):
        x, y = batch
        out, new = model.apply(variables, x, mutable=["batch_stats", "counters"])
        # (per-row aux of the input: BatchNorm's output depends on each device's rows)
        return jnp.mean((out - y) ** 2), (new, {"x0": x[:, 0]})

    return loss


@pytest.mark.parametrize(("mode", "k"), [("zero", 1), ("ddp", 2), ("fsdp", 4)])
def test_linen_collections_are_the_one_device_state(mesh8, mode, k):
    """A linen model's mutable collections, given to ``init(params, model_state=...)``:
    ``batch_stats`` a mean over the pieces (exact for the running mean), an int
    collection a counter; the per-row aux the global rows."""
    model, bs = linen_model(), batches()
    variables = model.init(jax.random.PRNGKey(0), bs[0][0])
    params = variables["params"]
    state_vars = {k: v for k, v in variables.items() if k != "params"}
    step = jaxsync.train_step(linen_loss(model), optax.sgd(0.1), mesh8, mode, microbatches=k,
                              has_aux=True)  # fmt: skip
    state = step.init(params, model_state=state_vars)
    # One device, the global batches, plain optax SGD.
    p, rest, opt = params, state_vars, optax.sgd(0.1)
    ostate = opt.init(p)
    for b in bs:
        (_, (rest_new, want_aux)), g = jax.value_and_grad(
            lambda p, rest=rest, b=b: linen_loss(model)({"params": p, **rest}, b), has_aux=True
        )(p)
        p = optax.apply_updates(p, opt.update(g, ostate, p)[0])
        state, (_, aux) = step(state, b)
        np.testing.assert_array_equal(aux["x0"], want_aux["x0"])
        rest = rest_new
    got = state.model_state
    assert int(got["counters"]["seen"]) == int(rest["counters"]["seen"]) == 2 * ROWS
    np.testing.assert_allclose(
        got["batch_stats"]["BatchNorm_0"]["mean"], rest["batch_stats"]["BatchNorm_0"]["mean"],
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def test_linen_collections_are_checked(mesh8):
    model = linen_model()
    variables = model.init(jax.random.PRNGKey(0), batches(1)[0][0])
    step = jaxsync.train_step(lambda v, b: jnp.zeros(()), optax.sgd(0.1), mesh8)
    with pytest.raises(ValueError, match="'params' collection"):
        step.init(variables["params"], model_state=dict(variables))
    with pytest.raises(TypeError, match="non-empty mapping"):
        step.init(variables["params"], model_state=[1])
    state = step.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})
    with pytest.raises(ValueError, match=r"returns `\(loss, new_collections\)`"):
        step(state, batches(1)[0])

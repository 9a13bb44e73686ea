"""One step, one meaning for random numbers (issue 41).

Before: a dropout key closed over by the loss (or passed in the batch) was the same on
every device, so every device's rows drew the same masks (4.8e-2 off on params for an
equinox loss with one step key), and an NNX module's ``nnx.Rngs`` stream drew the same
key on every device. Now ``step(state, batch, key=key)`` hands piece ``p`` (the ``p``-th
block of consecutive rows of the global batch: device-major, then microbatch) the key
``fold_in(key, p)``, and an NNX stream's key is folded with ``p`` the same way.

Equality to one device means: a one-device loop over the same pieces, each with the same
folded key, averaging the pieces' gradients, gives the same params (SGD, to float
rounding) and bitwise the same masks.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxsync

ROWS, RATE, LR = 32, 0.5, 0.1


def data(steps=2):
    rng = np.random.default_rng(0)
    return [
        (
            rng.normal(size=(ROWS, 6)).astype(np.float32),
            rng.normal(size=(ROWS, 4)).astype(np.float32),
        )
        for _ in range(steps)
    ]


def keys(steps=2):
    return list(jax.random.split(jax.random.key(7), steps))


def reference(loss, params, bs, ks, pieces, fold):
    """One device, SGD: per step, the mean of the pieces' gradients, piece p run with
    ``fold(key, p)``; returns the params and each step's per-row masks (aux)."""
    masks = []
    for b, k in zip(bs, ks, strict=True):
        r = ROWS // pieces
        grads, ms = [], []
        for p in range(pieces):
            piece = jax.tree.map(lambda x, p=p, r=r: x[p * r : (p + 1) * r], b)
            (_, m), g = jax.value_and_grad(loss, has_aux=True)(params, piece, fold(k, p))
            grads.append(g)
            ms.append(m)
        g = jax.tree.map(lambda *x: sum(x) / pieces, *grads)
        params = jax.tree.map(lambda w, d: w - LR * d, params, g)
        masks.append(None if ms[0] is None else np.concatenate(ms))
    return params, masks


# ----------------------------------------------------------------- a plain key
def key_loss(params, batch, key):
    x, y = batch
    mask = jax.random.bernoulli(key, 1 - RATE, x.shape)
    pred = jnp.where(mask, x / (1 - RATE), 0.0) @ params["w"]
    return jnp.mean((pred - y) ** 2), mask


def init_params():
    return {"w": jax.random.normal(jax.random.key(1), (6, 4)) * 0.3}


@pytest.mark.parametrize(("mode", "k"), [("zero", 1), ("ddp", 2), ("fsdp", 2)])
def test_a_step_key_gives_each_piece_its_own_stream(mesh8, mode, k):
    bs, ks = data(), keys()
    step = jaxsync.train_step(key_loss, optax.sgd(LR), mesh8, mode, microbatches=k, has_aux=True)
    state = step.init(init_params())
    masks = []
    for b, key in zip(bs, ks, strict=True):
        state, (_, mask) = step(state, b, key=key)
        masks.append(np.asarray(mask))
    want, want_masks = reference(key_loss, init_params(), bs, ks, 8 * k, jax.random.fold_in)
    for got, exp in zip(masks, want_masks, strict=True):
        np.testing.assert_array_equal(got, exp)  # bitwise the same masks, in row order
    np.testing.assert_allclose(step.params(state)["w"], want["w"], rtol=1e-5, atol=1e-6)
    r = ROWS // (8 * k)
    assert not np.array_equal(masks[0][:r], masks[0][r : 2 * r])  # devices' masks differ


def test_a_raw_uint32_key_is_handed_on_raw(mesh8):
    seen = []

    def loss(params, batch, key):
        seen.append(key.dtype)
        return key_loss(params, batch, jax.random.wrap_key_data(key))[0]

    step = jaxsync.train_step(loss, optax.sgd(LR), mesh8, "ddp")
    state, _ = step(step.init(init_params()), data(1)[0], key=jax.random.PRNGKey(3))
    assert seen and all(d == jnp.uint32 for d in seen)


# ------------------------------------------------------------------ flax linen
class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.Dropout(RATE, deterministic=False)(jnp.ones_like(x))
        return nn.Dense(4)(x * mask), mask


LINEN = LinenNet()


def linen_loss(params, batch, key):
    x, y = batch
    pred, mask = LINEN.apply({"params": params}, x, rngs={"dropout": key})
    return jnp.mean((pred - y) ** 2), mask


def test_linen_rngs_from_the_step_key(mesh8):
    bs, ks = data(), keys()
    params = LINEN.init(jax.random.key(0), bs[0][0])["params"]
    step = jaxsync.train_step(linen_loss, optax.sgd(LR), mesh8, "zero", microbatches=2,
                              has_aux=True)  # fmt: skip
    state = step.init(params)
    masks = []
    for b, key in zip(bs, ks, strict=True):
        state, (_, mask) = step(state, b, key=key)
        masks.append(np.asarray(mask))
    want, want_masks = reference(linen_loss, params, bs, ks, 16, jax.random.fold_in)
    for got, exp in zip(masks, want_masks, strict=True):
        np.testing.assert_array_equal(got, exp)
    got = step.params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ flax NNX
class NnxNet(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
        self.drop = nnx.Dropout(RATE, rngs=nnx.Rngs(dropout=5))

    def __call__(self, x):
        mask = self.drop(jnp.ones_like(x))
        return self.lin(x * mask), mask


def nnx_loss(model, batch):
    x, y = batch
    pred, mask = model(x)
    return jnp.mean((pred - y) ** 2), mask


@pytest.mark.parametrize(("mode", "k"), [("zero", 2), ("fsdp", 1)])
def test_nnx_rngs_streams_are_folded_per_piece(mesh8, mode, k):
    bs = data()
    step = jaxsync.train_step(nnx_loss, optax.sgd(LR), mesh8, mode, microbatches=k, has_aux=True)
    state = step.init(NnxNet())
    masks = []
    for b in bs:
        state, (_, mask) = step(state, b)
        masks.append(np.asarray(mask))

    graphdef, pst, rst = nnx.split(NnxNet(), nnx.Param, ...)
    rest = nnx.to_pure_dict(rst)

    def loss(params, batch, rest):
        p, r = jax.tree.map(lambda v: v, pst), jax.tree.map(lambda v: v, rst)
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(r, rest)
        return nnx_loss(nnx.merge(graphdef, p, r), batch)

    params, want_masks = nnx.to_pure_dict(pst), []
    for i, b in enumerate(bs):  # the stream's count is i at step i, its key unchanged

        def fold(_, p, i=i):
            stream = rest["drop"]["rngs"]
            r = {**rest, "drop": {"rngs": {"key": jax.random.fold_in(stream["key"], p),
                                           "count": jnp.uint32(i)}}}  # fmt: skip
            return r

        params, ms = reference(loss, params, [b], [None], 8 * k, fold)
        want_masks += ms
    for got, exp in zip(masks, want_masks, strict=True):
        np.testing.assert_array_equal(got, exp)
    got = step.params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    r = ROWS // (8 * k)
    assert not np.array_equal(masks[0][:r], masks[0][r : 2 * r])
    model = step.model(state)  # the stream keeps its own key and counts one call a step
    assert int(model.drop.rngs.count[...]) == 2
    np.testing.assert_array_equal(
        jax.random.key_data(model.drop.rngs.key[...]),
        jax.random.key_data(NnxNet().drop.rngs.key[...]),
    )


# ------------------------------------------------------------------ refusals
def test_a_key_in_the_batch_is_refused_naming_key(mesh8):
    step = jaxsync.train_step(lambda p, b: key_loss(p, b[:2], b[2])[0], optax.sgd(LR), mesh8)
    x, y = data(1)[0]
    with pytest.raises(ValueError, match=r"step\(state, batch, key=key\)"):
        step(step.init(init_params()), (x, y, jax.random.key(0)))
    with pytest.raises(ValueError, match=r"step\(state, batch, key=key\)"):  # raw uint32[2]
        step(step.init(init_params()), (x, y, jax.random.PRNGKey(0)))


def test_a_loss_without_a_key_argument_is_refused(mesh8):
    step = jaxsync.train_step(lambda p, b: jnp.mean(b[0] @ p["w"]), optax.sgd(LR), mesh8)
    with pytest.raises(TypeError, match=r"loss_fn\(params, batch, key\)"):
        step(step.init(init_params()), data(1)[0], key=jax.random.key(0))
    with pytest.raises(ValueError, match="one PRNG key"):
        step(step.init(init_params()), data(1)[0], key=jax.random.split(jax.random.key(0)))


@pytest.mark.default_xla
def test_deterministic_pieces_are_units_the_same_bits_at_every_dp_size():
    """In deterministic mode a piece is a unit (its rows do not depend on N), so the
    step's keys, masks and params are bitwise the same on 8 devices and on 4."""
    from conftest import require_devices

    require_devices(8)
    bits = []
    for n in (8, 4):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
        mode = jaxsync.DDP(deterministic=jaxsync.Deterministic(units=8))
        step = jaxsync.train_step(key_loss, optax.sgd(LR), mesh, mode, has_aux=True)
        state = step.init(init_params())
        for b, key in zip(data(), keys(), strict=True):
            state, _ = step(state, b, key=key)
        bits.append(np.asarray(step.params(state)["w"]).view(np.uint32))
    np.testing.assert_array_equal(bits[0], bits[1])


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_a_2d_mesh_folds_the_data_rank(mode):
    """(data=4, model=2), the kernel split over "model": pieces are the data ranks'
    microbatches; the model axis draws the same numbers (it holds the same rows)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = {"w": jax.device_put(init_params()["w"], NamedSharding(mesh, P(None, "model")))}
    bs, ks = data(), keys()
    step = jaxsync.train_step(key_loss, optax.sgd(LR), mesh, mode, microbatches=2, has_aux=True)
    state = step.init(params)
    masks = []
    for b, key in zip(bs, ks, strict=True):
        state, (_, mask) = step(state, b, key=key)
        masks.append(np.asarray(mask))
    want, want_masks = reference(key_loss, init_params(), bs, ks, 8, jax.random.fold_in)
    for got, exp in zip(masks, want_masks, strict=True):
        np.testing.assert_array_equal(got, exp)
    np.testing.assert_allclose(step.params(state)["w"], want["w"], rtol=1e-5, atol=1e-6)


class DropBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(6, 6, rngs=rngs)
        self.drop = nnx.Dropout(RATE, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.lin(x)))


class Stacked(nnx.Module):
    """Three DropBlocks stacked by nnx.vmap (a key per layer), run by scan_layers."""

    def __init__(self):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> DropBlock:
            return DropBlock(rngs)

        self.blocks = stack(nnx.Rngs(0))
        self.out = nnx.Linear(6, 4, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.out(jaxsync.scan_layers(self.blocks, lambda b, h: b(h), x, remat=False))


def stacked_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def test_stacked_nnx_layers_fold_each_layers_key():
    """Scanned layers keep a key per layer (``[3]``): each is folded with the piece."""
    mesh = jax.make_mesh((8,), ("data",))
    bs = data()
    step = jaxsync.train_step(stacked_loss, optax.sgd(LR), mesh, "zero", stacked="blocks")
    state = step.init(Stacked())
    for b in bs:
        state, _ = step(state, b)

    graphdef, pst, rst = nnx.split(Stacked(), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(pst), nnx.to_pure_dict(rst)
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731

    def loss(params, batch, rest):
        p, r = jax.tree.map(lambda v: v, pst), jax.tree.map(lambda v: v, rst)
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(r, rest)
        return stacked_loss(nnx.merge(graphdef, p, r), batch), None

    for i, b in enumerate(bs):

        def fold(_, p, i=i):
            def one(x):
                if is_key(x):
                    return jax.vmap(lambda k: jax.random.fold_in(k, p))(x.reshape(-1)).reshape(
                        x.shape
                    )
                return jnp.full_like(x, i)  # every stream's count: i calls so far

            return jax.tree.map(one, rest)

        params, _ = reference(loss, params, [b], [None], 8, fold)
    got = step.params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class BnDrop(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(x)
        return nn.Dense(4)(nn.Dropout(RATE, deterministic=False)(x))


def test_linen_collections_take_the_key_too(mesh8):
    """``loss_fn(variables, batch, key)`` with linen collections; ``lower`` takes the key."""
    model, (x, y) = BnDrop(), data(1)[0]
    variables = model.init(jax.random.key(0), x)

    def loss(variables, batch, key):
        out, new = model.apply(variables, batch[0], rngs={"dropout": key}, mutable=["batch_stats"])
        return jnp.mean((out - batch[1]) ** 2), new

    step = jaxsync.train_step(loss, optax.sgd(LR), mesh8, "ddp", microbatches=2)
    state = step.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})
    step.lower(state, (x, y), key=jax.random.key(1)).compile()
    state, got = step(state, (x, y), key=jax.random.key(1))
    assert np.isfinite(float(got))
    assert np.all(np.isfinite(np.asarray(state.model_state["batch_stats"]["BatchNorm_0"]["mean"])))

"""Token-weighted losses (jaxsync.weighted_loss): equal to single-device training on
the global batch whatever the padding of each device's rows.

A mean loss per device, averaged over devices and microbatches, weighs a device's
few real tokens as much as another's many: with uneven padding every mode trained
4.3e-2 (21% relative) away from the single-device run. SGD, so a gradient of the
wrong scale (a missing 1/W, an extra N or k) is seen too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import place_by_specs, scanned_params
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxsync

ROWS, SEQ, DIN, DOUT = 16, 6, 5, 3


def token_sum(p, batch):
    """Squared error summed over the real tokens of a [rows, seq] batch of a scanned MLP."""
    h = jnp.tanh(batch["x"] @ p["inp"]["w"])

    def body(h, layer):
        layer = jaxsync.tap(layer)
        return h + jnp.tanh(h @ layer["w1"] + layer["b1"]) @ layer["w2"] * layer["g"], None

    h, _ = jax.lax.scan(body, h, p["blocks"])
    err = jnp.sum((h @ p["head"]["w"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(err * batch["mask"])


LOSS = jaxsync.weighted_loss(token_sum, lambda b: jnp.sum(b["mask"]))


def batches(steps=2):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        # Real tokens per row from 0 to SEQ: some devices' rows are mostly padding.
        lengths = rng.integers(0, SEQ + 1, size=ROWS)
        lengths[:2] = SEQ  # never an empty global batch
        mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
        out.append({
            "x": rng.normal(size=(ROWS, SEQ, DIN)).astype(np.float32),
            "y": rng.normal(size=(ROWS, SEQ, DOUT)).astype(np.float32),
            "mask": mask,
        })  # fmt: skip
    return out


def reference(params, bs, lr=0.05):
    """One device, the global batch: the loss is the weighted mean of all tokens."""
    p = params
    losses = []
    for b in bs:
        loss, g = jax.value_and_grad(LOSS)(p, b)
        p = jax.tree.map(lambda x, d: x - lr * d, p, g)
        losses.append(float(loss))
    return p, losses


def params0():
    return scanned_params(jax.random.PRNGKey(0), layers=3, din=DIN, dout=DOUT)


def check(step, params, placed=None):
    bs = batches()
    state = step.init(params if placed is None else placed)
    losses = []
    for b in bs:
        state, loss = step(state, b)
        losses.append(float(loss))
    want, want_losses = reference(params, bs)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_uneven_padding_equals_one_device(mesh8, mode):
    step = jaxsync.train_step(LOSS, optax.sgd(0.05), mesh8, mode, microbatches=2, stacked="blocks")
    check(step, params0())


def test_uneven_padding_on_a_two_d_mesh():
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = params0()
    specs = jax.tree.map(lambda x: P(), params)
    specs["blocks"]["w1"] = P(None, None, "model")  # tensor parallel by spec
    step = jaxsync.train_step(LOSS, optax.sgd(0.05), mesh, "zero", microbatches=2,
                              stacked="blocks")  # fmt: skip
    check(step, params, place_by_specs(mesh, params, specs))


def test_a_mean_loss_is_another_objective(mesh8):
    """The plain mean per device, for contrast: with this padding it is not the
    single-device objective (so the test above can fail)."""
    mean = lambda p, b: token_sum(p, b) / jnp.sum(b["mask"])  # noqa: E731
    step = jaxsync.train_step(mean, optax.sgd(0.05), mesh8, "ddp", stacked="blocks")
    bs = batches(1)
    state, _ = step(step.init(params0()), bs[0])
    want, _ = reference(params0(), bs)
    gaps = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), step.params(state), want)
    assert max(jax.tree.leaves(gaps)) > 1e-3


def test_weighted_loss_is_checked():
    with pytest.raises(TypeError, match="two functions"):
        jaxsync.weighted_loss(token_sum, 3)
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match="does not take a jaxsync.weighted_loss"):
        jaxsync.train_step(LOSS, optax.sgd(0.1), mesh, jaxsync.DDP(deterministic=True))


def test_called_directly_it_is_the_weighted_mean_with_its_aux():
    """The same object is the single-device loss, with ``(sum, aux)`` too (the port of
    a trainer evaluates with it)."""
    p, batch = params0(), batches(1)[0]
    want = token_sum(p, batch) / jnp.sum(batch["mask"])
    np.testing.assert_allclose(LOSS(p, batch), want, rtol=1e-6)
    with_aux = jaxsync.weighted_loss(lambda p, b: (token_sum(p, b), {"n": b["mask"].sum()}),
                                     lambda b: jnp.sum(b["mask"]))  # fmt: skip
    loss, aux = with_aux(p, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert int(aux["n"]) == int(np.sum(batch["mask"]))

"""``DDP(param_dtype=...)``: the loss reads the params cast once per step, and one
device keeps each gradient in the dtype it was computed in.

The references are single-device optax on the same program a ``jax.jit`` user
writes: the fp32 params cast to bf16 before the loss. On one device nothing is
summed, so the step matches it to fp32 rounding; on eight, each device's bf16
gradient is summed in fp32 where the reference rounds the whole one to bf16.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_reference, scanned_batches, scanned_block, scanned_loss, scanned_params

import jaxsync

BF16 = jnp.bfloat16
LAYERS = 4


def _cast(tree, dtype=BF16):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def _reference(opt, batches):
    params = scanned_params(jax.random.key(0), layers=LAYERS)
    want, _ = run_reference(opt, params, batches, loss_fn=lambda p, b: scanned_loss(_cast(p), b))
    return want


def _train(mesh, opt, mode, batches, loss=scanned_loss, microbatches=1):
    step = jaxsync.train_step(loss, opt, mesh, mode, stacked="blocks", microbatches=microbatches)
    state = step.init(scanned_params(jax.random.key(0), layers=LAYERS))
    xs, ys = batches
    for i in range(xs.shape[0]):
        state, _ = step(state, (xs[i], ys[i]))
    return step, state


def _assert_close(got, want, rtol, atol):
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        assert g.dtype == jnp.float32, jaxsync.param_name(path)  # the params keep their dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=jaxsync.param_name(path))


@pytest.mark.parametrize("opt", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_one_device_equals_optax_on_the_cast_params(opt):
    batches = scanned_batches(jax.random.key(1), steps=3, batch=16)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step, state = _train(mesh, opt, jaxsync.DDP(param_dtype=BF16), batches)
    _assert_close(step.params(state), _reference(opt, batches), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_eight_devices_equal_optax_on_the_cast_params(mesh8, microbatches):
    """Each device's bf16 gradient summed in fp32 (the reference rounds the global one
    to bf16 once): equal to bf16 rounding of the gradient; a wrong mean would be 8x."""
    opt = optax.sgd(0.1)
    batches = scanned_batches(jax.random.key(1), steps=2, batch=32)
    mode = jaxsync.DDP(param_dtype=BF16)
    step, state = _train(mesh8, opt, mode, batches, microbatches=microbatches)
    _assert_close(step.params(state), _reference(opt, batches), rtol=2e-2, atol=2e-3)


def test_the_layer_loop_reads_the_cast_stack(mesh8):
    """The loss sees every param in bf16, the scanned layers included: the stack is
    cast before the loop, not in each layer of the forward and again in the backward."""
    seen = {}

    def loss(params, batch):
        x, y = batch
        seen["inp"] = params["inp"]["w"].dtype
        h = x @ params["inp"]["w"].astype(jnp.float32)

        def body(h, p):
            p = jaxsync.tap(p)
            seen["layer"] = {k: v.dtype for k, v in p.items()}
            return scanned_block(p, h), None

        h, _ = jax.lax.scan(jax.checkpoint(body), h, params["blocks"])
        return jnp.mean((h @ params["head"]["w"].astype(jnp.float32) - y) ** 2)

    batches = scanned_batches(jax.random.key(1), steps=1, batch=16)
    _train(mesh8, optax.sgd(0.1), jaxsync.DDP(param_dtype=BF16), batches, loss=loss)
    assert seen == {"inp": BF16, "layer": dict.fromkeys(("w1", "b1", "w2", "g"), BF16)}
    _train(mesh8, optax.sgd(0.1), jaxsync.DDP(), batches, loss=loss)
    assert seen["inp"] == jnp.float32 and set(seen["layer"].values()) == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("mode", ["zero", "ddp"])
def test_one_device_keeps_a_gradient_in_its_own_dtype(mode):
    """With nothing to sum (one device, one microbatch) the in-loop gradient buffers
    of a bf16 model are bf16; with two microbatches (an fp32 sum) they are fp32. Both
    train as single-device optax with an fp32 master."""
    opt = optax.sgd(0.1)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    params = scanned_params(jax.random.key(0), layers=LAYERS, dtype=BF16)
    batches = scanned_batches(jax.random.key(1), steps=2, batch=16)
    want, _ = run_reference(opt, params, batches, loss_fn=scanned_loss, master_dtype=jnp.float32)
    sink = f"tensor<{LAYERS}x{16 * 24}x"  # w1's gradient buffer: [layers, 16 * 24]
    for microbatches, dtype in ((1, "bf16"), (2, "f32")):
        step = jaxsync.train_step(scanned_loss, opt, mesh, mode, stacked="blocks",
                                  microbatches=microbatches)  # fmt: skip
        state = step.init(params)
        text = step.lower(state, (batches[0][0], batches[1][0])).as_text()
        found = set(re.findall(re.escape(sink) + r"(bf16|f32)>", text))
        if mode == "ddp":  # (ZeRO's update also casts its [layers, 384] master to bf16)
            assert found == {dtype}, microbatches
        xs, ys = batches
        for i in range(xs.shape[0]):
            state, _ = step(state, (xs[i], ys[i]))
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(step.params(state))[0],
                                jax.tree.leaves(want), strict=True):  # fmt: skip
            np.testing.assert_allclose(np.float32(g), np.float32(w.astype(BF16)), rtol=1e-2,
                                       atol=1e-2, err_msg=jaxsync.param_name(path))  # fmt: skip


def test_bad_param_dtype_is_refused_by_name():
    with pytest.raises((TypeError, ValueError), match="DDP.param_dtype"):
        jaxsync.DDP(param_dtype=jnp.int8)


@pytest.mark.parametrize("opt", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_fsdp_on_one_device_casts_each_unit_once(opt):
    """FSDP with a bf16 policy on one device gathers nothing: each unit's shard stack is
    cast once, before the layer loop (the loop reads the blocks' shard stack in bf16,
    not in fp32 cast per layer), and its gradient (one contribution) stays bf16 until
    the update. Single-device optax on the cast params, to fp32 rounding."""
    batches = scanned_batches(jax.random.key(1), steps=3, batch=16)
    policy = jaxsync.MixedPrecision(param_dtype=BF16)
    for n in (1, 2):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        step, state = _train(mesh, opt, jaxsync.FSDP(policy=policy), batches)
        stack = "tensor<{}x{}xbf16>".format(*state.params.as_dict()["blocks"].shape)
        text = step.lower(state, (batches[0][0], batches[1][0])).as_text()
        assert (stack in text) is (n == 1), n
        if n == 1:
            _assert_close(step.params(state), _reference(opt, batches), rtol=2e-5, atol=2e-6)


def test_an_nnx_model_reads_its_params_cast_once(mesh8):
    """An NNX module (stacked blocks run by jaxsync.scan_layers) under
    ``DDP(param_dtype=bf16)``: single-device SGD on the module with its params cast."""
    from flax import nnx
    from test_nnx_bridge import Net, batches, model_loss

    graphdef, state = nnx.split(Net(nnx.Rngs(0)), nnx.Param)

    def ref_loss(params, batch):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, _cast(params))
        return model_loss(nnx.merge(graphdef, st), batch)

    opt = optax.sgd(0.1)
    want = nnx.to_pure_dict(state)
    for b in batches():
        want = jax.tree.map(lambda p, g: p - 0.1 * g, want, jax.grad(ref_loss)(want, b))
    seen = []

    def loss(model, batch):
        seen.append(model.inp.kernel.value.dtype)
        return model_loss(model, batch)

    step = jaxsync.train_step(loss, opt, mesh8, jaxsync.DDP(param_dtype=BF16), stacked="blocks")
    state8 = step.init(Net(nnx.Rngs(0)))
    for b in batches():
        state8, _ = step(state8, b)
    got = step.params(state8)
    got = got if isinstance(got, dict) else nnx.to_pure_dict(nnx.state(got, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, 2e-2, 2e-3), got, want)
    assert seen and set(seen) == {jnp.dtype(BF16)}


@pytest.mark.parametrize(
    "mode",
    [jaxsync.DDP(param_dtype=BF16), jaxsync.DDP(param_dtype=BF16, deterministic=True)],
    ids=["bucketed", "deterministic"],
)
def test_unstacked_params_are_cast_once_too(mesh8, mode):
    """Without stacked groups (and in deterministic mode) the loss reads the cast
    params as well: single-device optax on the cast params, to bf16 rounding of the
    gradient."""
    from helpers import mlp_loss, mlp_params

    params = mlp_params(jax.random.key(0))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((2, 32, 12), np.float32)
    ys = rng.standard_normal((2, 32, 5), np.float32)
    want, _ = run_reference(optax.sgd(0.1), params, (xs, ys),
                            loss_fn=lambda p, b: mlp_loss(_cast(p), b))  # fmt: skip
    seen = set()

    def loss(p, b):
        seen.add(p["layer0"]["w"].dtype)
        return mlp_loss(p, b)

    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh8, mode)
    state = step.init(params)
    for i in range(2):
        state, _ = step(state, (xs[i], ys[i]))
    assert seen == {jnp.dtype(BF16)}
    _assert_close(step.params(state), want, rtol=2e-2, atol=2e-3)


def test_a_two_d_mesh_reads_the_cast_params():
    """DDP on (data, model) axes, the compiler partitioning the model: the loss reads
    bf16 and the step trains as single-device optax on the cast params."""
    from helpers import place_by_specs
    from tp_gpt import gpt_batches, gpt_loss, gpt_params, tp_specs

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = gpt_params(jax.random.key(0))
    batches = gpt_batches(jax.random.key(1), 2, 8)
    want, _ = run_reference(optax.sgd(0.1), params, batches,
                            loss_fn=lambda p, b: gpt_loss(_cast(p), b))  # fmt: skip
    seen = set()

    def loss(p, b):
        seen.add(p["head"].dtype)
        return gpt_loss(p, b)

    step = jaxsync.train_step(loss, optax.sgd(0.1), mesh, jaxsync.DDP(param_dtype=BF16),
                              stacked="blocks")  # fmt: skip
    state = step.init(place_by_specs(mesh, params, tp_specs()))
    for i in range(2):
        state, _ = step(state, (batches[0][i], batches[1][i]))
    assert seen == {jnp.dtype(BF16)}
    _assert_close(step.params(state), want, rtol=2e-2, atol=2e-3)

"""Modes as values: jaxsync.DDP / ZeRO / FSDP carry their own options, checked once."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_loss, mlp_params, run_reference

import jaxsync


def _train(step, params, batches):
    state = step.init(params)
    for b in zip(*batches, strict=True):
        state, _ = step(state, b)
    return step.params(state)


@pytest.mark.parametrize(
    "value, shorthand",
    [
        (jaxsync.DDP(bucket_size=64), dict(mode="ddp", bucket_size=64)),
        (jaxsync.ZeRO(bucket_size=64), dict(mode="zero", bucket_size=64)),
        (jaxsync.FSDP(units=("layer0", "layer1", "layer2", "scale"), reshard_after_forward=False),
         dict(mode="fsdp", units=("layer0", "layer1", "layer2", "scale"),
              reshard_after_forward=False)),
    ],
    ids=["ddp", "zero", "fsdp"],
)  # fmt: skip
def test_value_and_shorthand_train_as_single_device_sgd(mesh8, value, shorthand):
    """SGD sees a gradient's scale: a mode that lost an option's meaning, or reduced
    twice, would not match single-device optax."""
    params = mlp_params(jax.random.PRNGKey(0))
    batches = make_batches(jax.random.PRNGKey(1), steps=3, batch=16)
    tx = optax.sgd(0.5)
    by_value = _train(jaxsync.train_step(mlp_loss, tx, mesh8, value), params, batches)
    by_keywords = _train(jaxsync.train_step(mlp_loss, tx, mesh8, **shorthand), params, batches)
    want, _ = run_reference(tx, params, batches)
    for got in (by_value, by_keywords):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, want)
    step = jaxsync.train_step(mlp_loss, tx, mesh8, **shorthand)
    assert step.mode == value  # the keywords build the same value


def test_mode_values_are_frozen_and_checked_at_construction():
    z = jaxsync.ZeRO(deterministic=True)
    assert z.deterministic == jaxsync.Deterministic()
    assert hash(jaxsync.FSDP(units=["a", "b"])) == hash(jaxsync.FSDP(units=("a", "b")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        z.bucket_size = 8
    with pytest.raises(TypeError, match="units"):
        jaxsync.ZeRO(units=("a",))  # a wrong mix cannot be written
    with pytest.raises(ValueError, match="`bucket_size` must be a positive number"):
        jaxsync.DDP(bucket_size=0)
    with pytest.raises(TypeError, match=r"`DDP.reduce_dtype` must be a floating dtype"):
        jaxsync.DDP(reduce_dtype=jnp.int32)
    with pytest.raises(TypeError, match="`FSDP.units` must be a sequence"):
        jaxsync.FSDP(units="blocks")
    with pytest.raises(TypeError, match="`FSDP.policy` must be a jaxsync.MixedPrecision"):
        jaxsync.FSDP(policy=jnp.bfloat16)
    with pytest.raises(TypeError, match="`FSDP.reshard_after_forward` must be True or False"):
        jaxsync.FSDP(reshard_after_forward="no")
    with pytest.raises(ValueError, match=r"DDP: `deterministic` sums exactly.*bfloat16"):
        jaxsync.DDP(deterministic=True, reduce_dtype=jnp.bfloat16)  # it was ignored silently
    with pytest.raises(ValueError, match="ZeRO: `deterministic` supports plain data"):
        jaxsync.ZeRO(rules=jaxsync.SyncRules.of({}), deterministic=True)


def test_old_keywords_show_the_new_spelling(mesh8):
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"`units` is an option of jaxsync.FSDP, not of "
                       r"mode='zero'.*jaxsync.FSDP\(units=\['a'\]\)"):  # fmt: skip
        jaxsync.train_step(mlp_loss, tx, mesh8, mode="zero", units=["a"])
    with pytest.raises(TypeError, match=r"pass them inside it: jaxsync.ZeRO\(bucket_size=64, "
                       r"reduce_dtype=.*bfloat16"):  # fmt: skip
        jaxsync.train_step(
            mlp_loss, tx, mesh8, jaxsync.ZeRO(bucket_size=64), reduce_dtype=jnp.bfloat16
        )
    with pytest.raises(TypeError, match=r"`bucket_size` is an option of jaxsync.DDP or "
                       r"jaxsync.ZeRO, not of jaxsync.FSDP"):  # fmt: skip
        jaxsync.train_step(mlp_loss, tx, mesh8, jaxsync.FSDP(), bucket_size=8)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['bucket'\]"):
        jaxsync.train_step(mlp_loss, tx, mesh8, bucket=8)
    # An option that only a mode value takes shows that value, not a bare TypeError.
    with pytest.raises(TypeError, match=r"inside it: jaxsync.DDP\(param_dtype=jnp.bfloat16\)"):
        jaxsync.train_step(mlp_loss, tx, mesh8, mode="ddp", param_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match=r"`param_dtype` is an option of jaxsync.DDP, not of "
                       r"mode='zero'"):  # fmt: skip
        jaxsync.train_step(mlp_loss, tx, mesh8, mode="zero", param_dtype=jnp.bfloat16)
    # A keyword of another mode is refused at its default value too (#44): it was
    # dropped without a word.
    with pytest.raises(ValueError, match=r"`reduce_dtype` is an option of jaxsync.DDP or "
                       r"jaxsync.ZeRO, not of mode='fsdp'"):  # fmt: skip
        jaxsync.train_step(mlp_loss, tx, mesh8, mode="fsdp", reduce_dtype=jnp.float32)
    assert jaxsync.train_step(mlp_loss, tx, mesh8).mode == jaxsync.ZeRO()

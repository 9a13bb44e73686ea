"""The DDP/FSDP update guard skips the same way with selects (GPU) and a branch (CPU).

The step picks the form by platform (``parts.finish``: a ``lax.cond`` on XLA:CPU,
a select per output elsewhere), so the suite, which runs on CPU, would otherwise
never run the select form that GPU users get.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsync._src.optim.loss_scale import init_loss_scale
from jaxsync._src.optim.state import initial_metrics
from jaxsync._src.step.train_state import GuardState, TrainState, global_stats, guarded_update


def _state(tx, params):
    n = len(jax.tree.leaves(params))
    guard = GuardState(init_loss_scale(None), initial_metrics(n))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), {}, guard)


def _run(tx, state, grads, branch):
    def f(state, grads):
        return guarded_update(
            state, tx, grads, grads, global_stats(grads),
            clip_grad_norm=1.0, loss_scale=None, branch=branch,
        )  # fmt: skip

    return jax.jit(f)(state, grads)


@pytest.mark.parametrize("branch", [False, True], ids=["selects", "branch"])
@pytest.mark.parametrize("make_tx", [lambda: optax.adamw(0.1), lambda: optax.sgd(0.5)])
def test_a_finite_step_is_clipped_optax_and_a_nonfinite_one_changes_nothing(branch, make_tx):
    tx = make_tx()
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(2,)), jnp.bfloat16),
    }
    grads = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32), "b": jnp.ones(2, jnp.bfloat16)}
    state = _state(tx, params)

    # Finite: optax's clip-then-update, step by step.
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
    upd, ref_opt = ref_tx.update(grads, ref_tx.init(params), params)
    ref_params = optax.apply_updates(params, upd)
    new_params, opt_state, _, metrics, finite = _run(tx, state, grads, branch)
    assert bool(finite) and int(metrics.skipped_steps) == 0
    for got, want in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=1e-6, atol=1e-7)
    for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(ref_opt[1]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)

    # A NaN in one element: params and optimizer state come back bit for bit.
    bad = {**grads, "w": grads["w"].at[1, 0].set(jnp.nan)}
    kept_params, kept_opt, _, metrics, finite = _run(tx, state, bad, branch)
    assert not bool(finite) and int(metrics.skipped_steps) == 1
    for got, want in zip(
        jax.tree.leaves((kept_params, kept_opt)), jax.tree.leaves((params, state.opt_state)),
        strict=True,
    ):  # fmt: skip
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _drifting(dtype):
    """SGD whose state, made in bf16 by init, comes back from update in ``dtype``."""

    def init(params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.bfloat16), params)

    def update(grads, state, params=None):
        return jax.tree.map(lambda g: -0.1 * g, grads), jax.tree.map(
            lambda s, g: (s + g).astype(dtype), state, grads
        )

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("branch", [False, True], ids=["selects", "branch"])
def test_an_optimizer_state_that_changes_dtype_is_named(branch):
    params = {"w": jnp.ones((2, 2), jnp.float32)}
    grads = {"w": jnp.full((2, 2), 0.5, jnp.float32)}
    ok = _run(_drifting(jnp.bfloat16), _state(_drifting(jnp.bfloat16), params), grads, branch)
    np.testing.assert_allclose(np.asarray(ok[0]["w"]), 0.95)  # the same dtype: trains
    tx = _drifting(jnp.float32)
    with pytest.raises(TypeError, match=r"\['w'\] as float32, but `tx.init` made it bfloat16"):
        _run(tx, _state(tx, params), grads, branch)

"""Gradient accumulation means what a ``MultiSteps`` trainer means (issue 41).

A trainer's ``optax.MultiSteps(optax.chain(optax.clip_by_global_norm(c), opt), k)``,
ported by following jaxsync's clip error alone (``clip_grad_norm=c`` beside
``MultiSteps(opt, k)``), clipped every microbatch's gradient and counted microbatches
in ``state.step``: 15% off on the params. It is refused, and every message's
rewrite (``microbatches=k``, ``clip_grad_norm=c``) trains what the trainer trains.
SGD, so a wrong scale shows.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import make_batches, mlp_loss, mlp_params

import jaxsync

K, CALL_ROWS, CLIP, LR = 2, 16, 0.05, 0.5


def trainer_batches(steps=2):
    """The batches a MultiSteps trainer takes, one per call: ``steps * K`` of them."""
    xs, ys = make_batches(jax.random.PRNGKey(3), steps=steps * K, batch=CALL_ROWS)
    return [(xs[i], ys[i]) for i in range(steps * K)]


def one_device(params, calls):
    """The trainer: MultiSteps with the clip inside, on one device."""
    tx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(LR)), K)
    opt = tx.init(params)
    for b in calls:
        g = jax.grad(mlp_loss)(params, b)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    return params


def step_batches(calls):
    """One jaxsync batch per K trainer calls: the K batches, row after row."""
    return [
        tuple(np.concatenate([c[j] for c in calls[i : i + K]]) for j in range(2))
        for i in range(0, len(calls), K)
    ]


def gap(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("mode", ["zero", "ddp"])
def test_multi_steps_beside_clip_grad_norm_is_refused_with_the_rewrite(mesh8, mode):
    """Before: no error; the params ended 0.8% (max relative) from the trainer's and
    ``state.step`` read 4 for 2 optimizer steps."""
    with pytest.raises(ValueError, match=r"microbatches=2, clip_grad_norm=0\.05\)") as e:
        jaxsync.train_step(
            mlp_loss, optax.MultiSteps(optax.sgd(LR), K), mesh8, mode, clip_grad_norm=CLIP
        )
    assert "clips each call's gradient" in str(e.value)
    with pytest.raises(ValueError, match=r"microbatches=2"):  # a label's optimizer too
        jaxsync.train_step(
            mlp_loss, {"a": optax.MultiSteps(optax.sgd(LR), K)}, mesh8, mode,
            clip_grad_norm=CLIP, labels=lambda p: jax.tree.map(lambda _: "a", p),
        )  # fmt: skip


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_the_rewrite_trains_what_the_trainer_trains(mesh8, mode):
    """``microbatches=K, clip_grad_norm=CLIP``, the inner optimizer, a K times larger
    batch: the params of the one-device MultiSteps trainer, one step per K calls."""
    params, calls = mlp_params(jax.random.PRNGKey(0)), trainer_batches()
    want = one_device(params, calls)
    step = jaxsync.train_step(
        mlp_loss, optax.sgd(LR), mesh8, mode, microbatches=K, clip_grad_norm=CLIP
    )
    state = step.init(params)
    for b in step_batches(calls):
        state, _ = step(state, b)
    assert int(state.step) == len(calls) // K
    assert float(state.metrics.grad_norm) > CLIP  # the clip acts
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip
    # The unclipped run is far away, so the clip is what the comparison checks.
    free = jaxsync.train_step(mlp_loss, optax.sgd(LR), mesh8, mode, microbatches=K)
    s = free.init(params)
    for b in step_batches(calls):
        s, _ = free(s, b)
    assert gap(free.params(s), want) > 1e-2


def test_the_clip_error_inside_multi_steps_points_past_multi_steps(mesh8):
    """The sharded optimizer's clip error, for a clip inside MultiSteps, names the
    rewrite that drops MultiSteps too (it used to say only `clip_grad_norm=`)."""
    tx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(LR)), K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxsync.MultiStepsWarning)
        step = jaxsync.train_step(mlp_loss, tx, mesh8, "zero")
    with pytest.raises(ValueError, match="clip_by_global_norm") as e:
        step.init(mlp_params(jax.random.PRNGKey(0)))
    assert "drop MultiSteps too" in str(e.value)
    assert "microbatches=k, clip_grad_norm=max_norm" in str(e.value)


def test_the_multi_steps_warning_names_the_whole_rewrite(mesh8):
    with pytest.warns(jaxsync.MultiStepsWarning) as seen:
        jaxsync.train_step(mlp_loss, optax.MultiSteps(optax.sgd(LR), K), mesh8, "ddp")
    text = str(seen[0].message)
    for part in ("`microbatches=2`", "`clip_grad_norm=`", "state.step", "normalize='microbatch'"):
        assert part in text, part


# ------------------------------------------- weighted_loss: mean of microbatch means
SEQ, DIN, DOUT, N = 6, 4, 3, 8


def token_sum(p, b):
    err = jnp.sum((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2, axis=-1)
    return jnp.sum(err * b["mask"])


def token_sum_aux(p, b):
    s = token_sum(p, b)
    return s, {"tok_mean": s / jnp.maximum(jnp.sum(b["mask"]), 1.0)}


def weight(b):
    return jnp.sum(b["mask"])


def padded_calls(steps=2, rows=CALL_ROWS):
    """A MultiSteps trainer's batches, one per call, padded unevenly: the first call of
    each step is mostly padding, the second mostly real tokens."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(steps * K):
        hi = 2 if i % K == 0 else SEQ
        lengths = rng.integers(1 if i % K == 0 else 4, hi + 1, size=rows)
        out.append({
            "x": rng.normal(size=(rows, SEQ, DIN)).astype(np.float32),
            "y": rng.normal(size=(rows, SEQ, DOUT)).astype(np.float32),
            "mask": (np.arange(SEQ)[None] < lengths[:, None]).astype(np.float32),
        })  # fmt: skip
    return out


def interleave(calls):
    """The K calls of one step as one jaxsync batch whose microbatch j (the j-th slice
    of each device's rows) is call j: ``[K, N, rows/N] -> [N, K, rows/N]``."""
    return {
        name: np.stack([c[name] for c in calls])
        .reshape(K, N, -1, *calls[0][name].shape[1:])
        .swapaxes(0, 1)
        .reshape(-1, *calls[0][name].shape[1:])
        for name in calls[0]
    }


def tok_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    return {"w1": jax.random.normal(k1, (DIN, 8)) / 2, "w2": jax.random.normal(k2, (8, DOUT)) / 3}


def multi_steps_trainer(params, calls):
    """By hand, one device: each call's loss is its own token mean; MultiSteps averages
    the K calls' gradients and SGD steps once. Returns params and each step's mean of
    the K microbatch means."""
    losses = []
    for i in range(0, len(calls), K):
        vals, grads = zip(
            *(jax.value_and_grad(lambda p, b: token_sum(p, b) / weight(b))(params, b)
              for b in calls[i : i + K]),
            strict=True,
        )  # fmt: skip
        g = jax.tree.map(lambda *x: sum(x) / K, *grads)
        params = jax.tree.map(lambda p, d: p - LR * d, params, g)
        losses.append(float(sum(vals) / K))
    return params, losses


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_normalize_microbatch_is_the_multi_steps_objective(mesh8, mode):
    """``weighted_loss(..., normalize="microbatch")``, ``microbatches=K``: the params, the
    loss and a token-mean aux of the MultiSteps trainer that takes each microbatch as a
    global batch. Before there was no such option: the step form (below) ends 12%
    (max relative) away from the trainer's params with this padding."""
    params, calls = tok_params(), padded_calls()
    want, want_losses = multi_steps_trainer(params, calls)
    loss = jaxsync.weighted_loss(token_sum_aux, weight, normalize="microbatch")
    step = jaxsync.train_step(loss, optax.sgd(LR), mesh8, mode, microbatches=K, has_aux=True)
    state = step.init(params)
    for i, j in enumerate(range(0, len(calls), K)):
        state, (value, aux) = step(state, interleave(calls[j : j + K]))
        np.testing.assert_allclose(value, want_losses[i], rtol=1e-5)
        np.testing.assert_allclose(aux["tok_mean"], want_losses[i], rtol=1e-5)
    assert int(state.step) == len(calls) // K
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip
    # The default, the token mean of the whole step, is another objective here.
    whole = jaxsync.train_step(
        jaxsync.weighted_loss(token_sum, weight), optax.sgd(LR), mesh8, mode, microbatches=K
    )
    s = whole.init(params)
    for j in range(0, len(calls), K):
        s, _ = whole(s, interleave(calls[j : j + K]))
    assert gap(whole.params(s), want) > 1e-2


def test_normalize_is_checked_and_an_empty_microbatch_skips(mesh8):
    with pytest.raises(ValueError, match=r"`normalize` must be 'step'.*got 'tokens'"):
        jaxsync.weighted_loss(token_sum, weight, normalize="tokens")
    calls = padded_calls(steps=1)
    calls[0]["mask"][:] = 0  # microbatch 0 is all padding on every device
    loss = jaxsync.weighted_loss(token_sum, weight, normalize="microbatch")
    step = jaxsync.train_step(loss, optax.sgd(LR), mesh8, "zero", microbatches=K)
    state, _ = step(step.init(tok_params()), interleave(calls))
    assert int(state.step) == 0 and int(state.metrics.skipped_steps) == 1
    jax.tree.map(np.testing.assert_array_equal, step.params(state), tok_params())


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_normalize_microbatch_with_stacked_layers(mesh8, mode):
    """The same objective where the stacked group's gradients are reduced inside the
    backward scan (ZeRO's held layers, FSDP's stacked unit)."""
    from test_weighted_loss import params0
    from test_weighted_loss import token_sum as scanned_sum

    rng = np.random.default_rng(1)
    calls = []
    for i in range(K):
        lengths = rng.integers(1 if i == 0 else 4, (2 if i == 0 else 6) + 1, size=CALL_ROWS)
        calls.append({
            "x": rng.normal(size=(CALL_ROWS, 6, 5)).astype(np.float32),
            "y": rng.normal(size=(CALL_ROWS, 6, 3)).astype(np.float32),
            "mask": (np.arange(6)[None] < lengths[:, None]).astype(np.float32),
        })  # fmt: skip
    p = params0()
    grads = [jax.grad(lambda q, b: scanned_sum(q, b) / weight(b))(p, b) for b in calls]
    want = jax.tree.map(lambda x, *g: x - LR * sum(g) / K, p, *grads)
    loss = jaxsync.weighted_loss(scanned_sum, weight, normalize="microbatch")
    step = jaxsync.train_step(loss, optax.sgd(LR), mesh8, mode, microbatches=K, stacked="blocks")
    state, _ = step(step.init(p), interleave(calls))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip


def test_distributed_optimizer_refuses_multi_steps_beside_its_clip():
    """The explicit path's same trap: its clip ran on each call's reduced gradient."""
    with pytest.raises(ValueError, match=r"accumulate_grads.*inner=opt, clip_grad_norm=c"):
        jaxsync.distributed_optimizer(
            optax.MultiSteps(optax.sgd(LR), K), axis_name="data", clip_grad_norm=CLIP
        )
    jaxsync.distributed_optimizer(optax.sgd(LR), axis_name="data", clip_grad_norm=CLIP)

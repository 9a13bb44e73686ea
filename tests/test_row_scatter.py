"""The gradient of a per-row label gather as a select (``program/row_scatter.py``).

``take_along_axis`` transposes to a scatter-add into zeros the logits' size, which XLA
materializes. These tests hold the rewrite to ``jax.value_and_grad``'s values bit for
bit (labels out of bounds, clipped, negative, several per row, along another axis),
to the scatters it must leave alone, to the buffer it removes from a compiled program,
and every mode's step to single-device optax on an integer-label cross-entropy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import lower_on_h100s, train_beside_optax
from jax.extend import core as jcore

import jaxsync
from jaxsync._src.program import grad_program, row_scatter

ROWS, SEQ, VOCAB, D = 2, 8, 50, 16


def _logp(w, h):
    return jax.nn.log_softmax((h @ w.astype(jnp.bfloat16)).astype(jnp.float32), axis=-1)


def _ce(w, h, t):
    return -jnp.mean(jnp.take_along_axis(_logp(w, h), t[..., None], axis=-1))


def _clipped(w, h, t):
    return -jnp.mean(jnp.take_along_axis(_logp(w, h), t[..., None], axis=-1, mode="clip"))


def _two_per_row(w, h, t):  # the second label of a row may repeat the first
    both = jnp.stack([t, jnp.abs(t) % 3], axis=-1)
    return -jnp.mean(jnp.take_along_axis(_logp(w, h), both, axis=-1))


def _first_axis(w, h, t):  # labels picked along the rows' axis
    logp = jnp.moveaxis(_logp(w, h), -1, 0)
    return -jnp.mean(jnp.take_along_axis(logp, (jnp.abs(t) % SEQ)[None], axis=0))


def _optax_ce(w, h, t):
    return optax.softmax_cross_entropy_with_integer_labels(_logp(w, h), t % VOCAB).mean()


def _args(seed=0):
    r = np.random.default_rng(seed)
    w = jnp.asarray(r.standard_normal((D, VOCAB)), jnp.float32)
    h = jnp.asarray(r.standard_normal((ROWS, SEQ, D)), jnp.bfloat16)
    t = jnp.asarray(r.integers(0, VOCAB, (ROWS, SEQ)), jnp.int32)
    return w, h, t.at[0, :3].set(jnp.array([-1, -VOCAB, VOCAB + 4]))  # negative, out of bounds


def _scatters(jaxpr, size=0):
    """The scatter-adds in ``jaxpr`` (at any depth) of at least ``size`` elements."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scatter-add" and e.outvars[0].aval.size >= size:
            found.append(e)
        for sub in jcore.jaxprs_in_params(e.params):
            found += _scatters(sub, size)
    return found


@pytest.mark.parametrize("loss", [_ce, _clipped, _two_per_row, _first_axis, _optax_ce])
def test_values_are_jax_value_and_grads_exactly(loss):
    args = _args()
    closed = jax.make_jaxpr(jax.value_and_grad(loss))(*args)
    logits = ROWS * SEQ * VOCAB  # optax's own transposes add a small one: kept
    assert _scatters(closed.jaxpr, logits)
    assert not _scatters(row_scatter.select_row_scatters(closed).jaxpr, logits)
    want = jax.jit(jax.value_and_grad(loss))(*args)
    got = jax.jit(grad_program.value_and_grad(loss))(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_scatters_it_cannot_read_as_rows_are_left_alone():
    """An embedding's gradient (rows of a table: a window per index) and a scatter
    into values that are not zero keep their scatters."""

    def loss(table, base, tokens):
        picked = jnp.take_along_axis(base, tokens[..., None] % VOCAB, axis=-1)
        kept = base.at[:, :, 0].add(picked[..., 0])  # adds into `base`, not zeros
        return jnp.sum(table[tokens % VOCAB] ** 2) + jnp.sum(kept**2)

    r = np.random.default_rng(1)
    table = jnp.asarray(r.standard_normal((VOCAB, D)), jnp.float32)
    base = jnp.asarray(r.standard_normal((ROWS, SEQ, VOCAB)), jnp.float32)
    tokens = jnp.asarray(r.integers(0, VOCAB, (ROWS, SEQ)), jnp.int32)
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(table, base, tokens)
    rewritten = row_scatter.select_row_scatters(closed)
    # the gather's own transpose goes; the table's and the `.at[].add`'s stay
    assert len(_scatters(rewritten.jaxpr)) == len(_scatters(closed.jaxpr)) - 1 >= 2
    windowed = [e for e in _scatters(rewritten.jaxpr) if row_scatter.rows_of(e) is None]
    assert len(windowed) == len(_scatters(rewritten.jaxpr))
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(table, base, tokens)
    got = jax.jit(grad_program.value_and_grad(loss, argnums=(0, 1)))(table, base, tokens)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert row_scatter.select_row_scatters(jax.make_jaxpr(lambda x: x * 2)(1.0)) is not None


def test_the_compiled_h100_gradient_no_longer_holds_a_logits_sized_buffer():
    """Compiled for H100s, the loss's gradient holds one fp32 buffer of the logits'
    size fewer (the scatter's: what the rewrite removes from a step's peak)."""
    rows, seq, vocab = 4, 256, 8192
    shapes = ((D, vocab), jnp.float32), ((rows, seq, D), jnp.bfloat16), ((rows, seq), jnp.int32)

    def temps(grad):
        lowered = lower_on_h100s(lambda *a: grad(_ce)(*a)[1], *shapes)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    logits_fp32 = rows * seq * vocab * 4
    assert temps(jax.value_and_grad) - temps(grad_program.value_and_grad) >= logits_fp32


def _model_loss(params, batch):
    x, t = batch

    @jax.checkpoint
    def body(h, layer):
        return jnp.tanh(h @ jaxsync.tap(layer)["w"]) + h, None

    h, _ = jax.lax.scan(body, x @ params["embed"], params["blocks"])
    logp = jax.nn.log_softmax(h @ params["head"], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, t[..., None], axis=-1))


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_every_modes_step_selects_and_trains_as_optax(mesh8, mode, monkeypatch):
    """Inside ``shard_map`` the select's operands vary over the data axis: the step
    traces, rewrites and trains as optax does on one device."""
    k = jax.random.split(jax.random.key(4), 6)
    params = {"embed": 0.3 * jax.random.normal(k[0], (D, D)),
              "blocks": {"w": 0.3 * jax.random.normal(k[1], (3, D, D))},
              "head": 0.3 * jax.random.normal(k[2], (D, VOCAB))}  # fmt: skip
    batches = [(jax.random.normal(jax.random.fold_in(k[3], i), (16, SEQ, D)),
                jax.random.randint(jax.random.fold_in(k[4], i), (16, SEQ), 0, VOCAB))
               for i in range(2)]  # fmt: skip
    seen = []
    select = row_scatter.select_row_scatters

    def spy(closed):
        seen.append((len(_scatters(closed.jaxpr)), len(_scatters(select(closed).jaxpr))))
        return select(closed)

    monkeypatch.setattr(grad_program, "select_row_scatters", spy)
    tx = optax.sgd(0.1)
    step = jaxsync.train_step(_model_loss, tx, mesh8, mode, stacked="blocks")
    state, ref = train_beside_optax(step, step.init(params), tx, params, _model_loss, batches)
    assert seen and all(after == before - 1 for before, after in seen), seen
    for g, w in zip(jax.tree.leaves(step.params(state)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)

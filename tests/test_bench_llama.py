"""benchmarks/llama.py's numerics on CPU: the model bench_gpu compiles for H100s.

bench_gpu only compiles and prices the model; these check that what it prices is
the model it claims: the scanned layers compute what a Python loop over the same
block does, grouped-query attention reduces to multi-head attention, the loss
starts near log(vocab), and a jaxsync ZeRO step on 8 devices is single-device
AdamW on the same global batch. fp32 throughout.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsync

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import llama  # noqa: E402

F32 = jnp.float32
CFG = llama.Config(vocab=256, seq=16, d_model=64, heads=4, kv_heads=2, ffn=96, layers=3,
                   batch_per_device=2)  # fmt: skip
LOSS = partial(llama.scanned_loss, heads=CFG.heads, kv_heads=CFG.kv_heads, dtype=F32)
ROWS = 8 * CFG.batch_per_device  # the global batch of the 8-device step; one shape for all
jitted_loss = jax.jit(LOSS)


@functools.cache
def params():
    return jax.jit(partial(llama.device_params, CFG))()  # one compile, not one per op


@functools.cache
def tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (ROWS, CFG.seq + 1), 0, CFG.vocab)


def unrolled_loss(params, tokens):
    """The scanned loss as a Python loop over layers of the same ``block_fn``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"]["tok"][inputs]
    cos_sin = llama.rope(CFG.seq, CFG.d_model // CFG.heads)
    for i in range(CFG.layers):
        p = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
        x = llama.block_fn(p, x, heads=CFG.heads, kv_heads=CFG.kv_heads, cos_sin=cos_sin,
                           dtype=F32)  # fmt: skip
    return llama.head_loss(params["head"], x, targets, dtype=F32)


def test_shapes():
    shapes = jax.eval_shape(lambda: llama.device_params(CFG))
    hd = CFG.d_model // CFG.heads
    L, D, F, V = CFG.layers, CFG.d_model, CFG.ffn, CFG.vocab
    want = {
        "embed": {"tok": (V, D)},
        "blocks": {"attn_norm": (L, D), "wq": (L, D, CFG.heads * hd),
                   "wk": (L, D, CFG.kv_heads * hd), "wv": (L, D, CFG.kv_heads * hd),
                   "wo": (L, CFG.heads * hd, D), "mlp_norm": (L, D), "w_gate": (L, D, F),
                   "w_up": (L, D, F), "w_down": (L, F, D)},
        "head": {"norm": (D,), "w": (D, V)},
    }  # fmt: skip
    assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(
        tuple, want, is_leaf=lambda x: isinstance(x, tuple)
    )
    assert all(x.dtype == F32 for x in jax.tree.leaves(shapes))


def test_scanned_is_unrolled():
    scanned = jitted_loss(params(), tokens())
    unrolled = jax.jit(unrolled_loss)(params(), tokens())
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)


def test_gqa_is_multi_head_attention():
    """kv_heads == heads: causal multi-head attention computed head by head in numpy;
    kv_heads < heads: the same, q head i reading kv head i // (heads // kv_heads)."""
    b, s, h, hd = 2, 8, 4, 16
    q, k, v = np.random.default_rng(0).standard_normal((3, b, s, h, hd), np.float32)

    def by_hand(q, k, v):
        group = h // k.shape[2]
        out = np.zeros_like(q)
        for i in range(h):
            qi, ki, vi = q[:, :, i], k[:, :, i // group], v[:, :, i // group]  # [b, s, hd]
            logits = qi @ ki.transpose(0, 2, 1) / math.sqrt(hd)  # [b, q, k]
            logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            out[:, :, i] = (w / w.sum(-1, keepdims=True)) @ vi
        return out

    attention = jax.jit(llama.attention)
    np.testing.assert_allclose(attention(q, k, v), by_hand(q, k, v), rtol=1e-5, atol=1e-6)
    k2, v2 = k[:, :, :2], v[:, :, :2]  # 2 kv heads, each serving 2 consecutive q heads
    np.testing.assert_allclose(attention(q, k2, v2), by_hand(q, k2, v2), rtol=1e-5, atol=1e-6)


def test_loss_at_init_is_log_vocab():
    loss = float(jitted_loss(params(), tokens()))
    assert abs(loss - math.log(CFG.vocab)) < 0.1 * math.log(CFG.vocab), loss


def test_zero_step_is_single_device_adamw(mesh8):
    tx = optax.adamw(1e-3)
    batch, start = tokens(), params()

    @jax.jit
    def reference(p, batch):
        loss, g = jax.value_and_grad(LOSS)(p, batch)
        updates, _ = tx.update(g, tx.init(p), p)
        return optax.apply_updates(p, updates), loss, g

    want, want_loss, grads = reference(start, batch)
    step = jaxsync.train_step(LOSS, tx, mesh8, mode="zero", stacked="blocks")
    state, loss = step(step.init(start), batch)
    got = step.params(state)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    # Adam's first update is lr * g / (|g| + 1e-8), ~lr * sign(g): each weight moves by
    # ~1e-3 (a wrong gradient scale is invisible; the sign and the sum over devices are
    # not), so 1e-7 is 0.01% of a step. Where |g| is at rounding level (a few weights'
    # gradients cancel to ~1e-9) the update hangs on the last digits of a sum whose
    # order differs: those only stay within one step, and must be rare.
    got, want, grads, start = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
                               for t in (got, want, grads, start))  # fmt: skip
    clear = (np.abs(grads) > 1e-6) | (grads == 0)  # 0: rows of tokens not in the batch
    assert clear.mean() > 0.99
    np.testing.assert_allclose(got[clear], want[clear], rtol=1e-6, atol=1e-7)
    assert np.max(np.abs(got - want)) <= 2e-3
    assert np.median(np.abs(want - start)[clear]) > 5e-4


def test_sizes():
    """The benchmark's sizes have the advertised parameter counts (shapes only)."""
    count = lambda cfg: sum(
        x.size for x in jax.tree.leaves(jax.eval_shape(lambda: llama.device_params(cfg)))
    )
    assert 1.05e9 < count(llama.SIZES["1b"]) < 1.2e9
    assert 6.5e9 < count(llama.SIZES["7b"]) < 7.5e9
    assert 1.4e9 < count(llama.SIZES["1b128k"]) < 1.6e9  # Llama-3.2-1B's shape, untied
    assert 7.9e9 < count(llama.SIZES["8b"]) < 8.2e9  # Llama-3-8B's
    assert count(llama.SIZES["quick"]) < 5e7

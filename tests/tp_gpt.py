"""A small GPT written as on one device, plus the PartitionSpecs that make it tensor-parallel.

Pre-norm attention and MLP blocks stacked ``[L, ...]`` under ``lax.scan`` with
remat per layer. The model code never names a mesh axis: :func:`tp_specs`
shards the attention heads, the MLP hidden dim and the vocabulary over
``"model"`` (Megatron's column/row split), and GSPMD does the rest.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxsync

VOCAB, D, HEADS, FF, LAYERS, SEQ = 32, 16, 4, 32, 2, 8


def gpt_params(key, dtype=jnp.float32):
    ks = jax.random.split(key, 8)
    n = lambda k, *s: (jax.random.normal(k, s) / np.sqrt(s[-2])).astype(dtype)  # noqa: E731
    return {
        "embed": (0.5 * jax.random.normal(ks[0], (VOCAB, D))).astype(dtype),
        "blocks": {
            "ln1": jnp.ones((LAYERS, D), dtype),
            "qkv": n(ks[1], LAYERS, D, 3 * D),
            "out": n(ks[2], LAYERS, D, D),
            "ln2": jnp.ones((LAYERS, D), dtype),
            "up": n(ks[3], LAYERS, D, FF),
            "up_b": jnp.zeros((LAYERS, FF), dtype),
            "down": n(ks[4], LAYERS, FF, D),
        },
        "ln_f": jnp.ones((D,), dtype),
        "head": n(ks[5], D, VOCAB),
    }


def tp_specs(model="model"):
    """Column-parallel qkv/up/head, row-parallel out/down; the rest replicated."""
    return {
        "embed": P(),
        "blocks": {
            "ln1": P(), "qkv": P(None, None, model), "out": P(None, model, None),
            "ln2": P(), "up": P(None, None, model), "up_b": P(None, model),
            "down": P(None, model, None),
        },
        "ln_f": P(),
        "head": P(None, model),
    }  # fmt: skip


def rms_norm(x, g):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * g.astype(jnp.float32)


def attention(p, h):
    """Causal self-attention with a pre-norm residual (``ln1``, ``qkv``, ``out``)."""
    b, t, _ = h.shape
    x = rms_norm(h, p["ln1"])
    q, k, v = jnp.split(x @ p["qkv"].astype(jnp.float32), 3, axis=-1)
    heads = lambda a: a.reshape(b, t, HEADS, D // HEADS)  # noqa: E731
    s = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(D // HEADS)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), heads(v)).reshape(b, t, D)
    return h + a @ p["out"].astype(jnp.float32)


def block(p, h):
    h = attention(p, h)
    x = rms_norm(h, p["ln2"])
    u = jax.nn.gelu(x @ p["up"].astype(jnp.float32) + p["up_b"].astype(jnp.float32))
    return h + u @ p["down"].astype(jnp.float32)


def gpt_loss(params, batch, remat_policy=None):
    tokens, targets = batch
    h = params["embed"][tokens].astype(jnp.float32)

    def body(h, p):
        p = jaxsync.tap(p)  # identity outside jaxsync's in-loop sync
        return block(p, h), None

    h, _ = jax.lax.scan(jax.checkpoint(body, policy=remat_policy), h, params["blocks"])
    logits = rms_norm(h, params["ln_f"]) @ params["head"].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def gpt_batches(key, steps, batch):
    tokens = jax.random.randint(key, (steps, batch, SEQ + 1), 0, VOCAB)
    return tokens[..., :-1], tokens[..., 1:]

"""A Llama-style decoder written the way large JAX models are (for ``bench_gpu``).

Pre-norm blocks (RMSNorm, rotary embeddings, grouped-query causal attention,
SwiGLU MLP) whose params are stacked ``[L, ...]`` and run by ``lax.scan`` over a
``jax.checkpoint``-ed body that calls ``p = jaxsync.tap(p)`` first; untied token
embedding and LM head; no biases. Params are fp32 and cast to the compute dtype
where they are used, so the same code reads fp32 masters and bf16 params alike.
Norms, rotary angles, softmax and the loss run in fp32 whatever the compute dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

import jaxsync

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    seq: int = 64
    d_model: int = 128
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 256
    layers: int = 2
    batch_per_device: int = 2


SIZES = {
    "quick": Config(vocab=8192, seq=512, d_model=512, heads=8, kv_heads=4, ffn=1408,
                    layers=4, batch_per_device=2),
    # TinyLlama-1.1B's widths with 128-wide heads: ~1.12B params.
    "1b": Config(vocab=32000, seq=2048, d_model=2048, heads=16, kv_heads=4, ffn=5632,
                 layers=22, batch_per_device=4),
    # Mistral-7B's shape (GQA 32/8; Llama-2-7B's ffn=11008 with 8 kv heads is 5.9B): 7.24B.
    # ZeRO-1 at data=64: bf16 params + grads ~29 GB per GPU, fp32 master + AdamW 1/64 of
    # 87 GB; with remat 2 rows add a few GB (1b at 4 rows: 3.5-6 GB of temps). Estimated.
    "7b": Config(vocab=32000, seq=2048, d_model=4096, heads=32, kv_heads=8, ffn=14336,
                 layers=32, batch_per_device=2),
    # Llama-3.2-3B's shape, which the library was not tuned on: a 128256-token vocab
    # (embedding and head 0.4B params each), GQA 24/8; ~3.6B params untied.
    "3b": Config(vocab=128256, seq=2048, d_model=3072, heads=24, kv_heads=8, ffn=8192,
                 layers=28, batch_per_device=2),
    # Held-out shapes, measured once and never tuned on (docs/gpu.md, "Shapes we did not
    # tune on"): Llama-3.2-1B's (untied: 1.5B) at 8 GPUs, Llama-3-8B's at 64.
    "1b128k": Config(vocab=128256, seq=2048, d_model=2048, heads=32, kv_heads=8, ffn=8192,
                     layers=16, batch_per_device=4),
    "8b": Config(vocab=128256, seq=2048, d_model=4096, heads=32, kv_heads=8, ffn=14336,
                 layers=32, batch_per_device=2),
}  # fmt: skip


def device_params(cfg: Config, seed: int = 0) -> dict[str, Any]:
    """fp32 params (traceable: ``jax.eval_shape`` gives the shapes). Fan-in scaled
    projections; the residual outputs (wo, w_down) also by 1/sqrt(2L), as GPT-2 does,
    and the head by 1/2, so logits start ~N(0, 1/4) and the loss near log(vocab)."""
    d, L, f = cfg.d_model, cfg.layers, cfg.ffn
    hd = d // cfg.heads
    q, kv = cfg.heads * hd, cfg.kv_heads * hd
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 9))

    def normal(shape, scale):
        return scale * jax.random.normal(next(ks), shape, F32)

    return {
        "embed": {"tok": normal((cfg.vocab, d), 0.02)},
        "blocks": {
            "attn_norm": jnp.ones((L, d), F32),
            "wq": normal((L, d, q), d**-0.5),
            "wk": normal((L, d, kv), d**-0.5),
            "wv": normal((L, d, kv), d**-0.5),
            "wo": normal((L, q, d), (2 * L * q) ** -0.5),
            "mlp_norm": jnp.ones((L, d), F32),
            "w_gate": normal((L, d, f), d**-0.5),
            "w_up": normal((L, d, f), d**-0.5),
            "w_down": normal((L, f, d), (2 * L * f) ** -0.5),
        },
        "head": {"norm": jnp.ones((d,), F32), "w": normal((d, cfg.vocab), 0.5 * d**-0.5)},
    }


def rms_norm(x, g, eps=1e-5):
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps) * g.astype(F32)


def rope(seq: int, head_dim: int, base: float = 10000.0):
    """(cos, sin) of the rotary angles, ``[seq, head_dim // 2]`` fp32: computed once per
    step, outside the layer loop."""
    inv = base ** (-jnp.arange(0, head_dim, 2, dtype=F32) / head_dim)
    angles = jnp.arange(seq, dtype=F32)[:, None] * inv[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates ``x [B, S, heads, hd]``'s two halves (the Llama/HF layout), in fp32."""
    x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention(q, k, v):
    """Causal grouped-query attention: ``q [B, S, H, hd]``, ``k, v [B, S, KV, hd]``;
    each kv head serves ``H // KV`` consecutive q heads. Softmax in fp32.

    k and v are repeated to H heads (small: the size of q) and attention runs as
    plain multi-head attention. The grouped form (q reshaped to ``[B, S, KV, G, hd]``,
    5-D einsums) makes XLA's GPU dots transpose the whole ``[B, KV, G, S, S]`` score
    tensor: modeled on 8 H100s, the 1b step took 173-662 ms that way against 157 ms."""
    b, s, h, hd = q.shape
    groups = h // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) * hd**-0.5
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def block_fn(p, x, *, heads, kv_heads, cos_sin, dtype):
    """One pre-norm block on the residual stream ``x [B, S, D]``."""
    b, s, _ = x.shape
    c = lambda a: a.astype(dtype)
    hd = p["wq"].shape[-1] // heads
    h = rms_norm(x, p["attn_norm"]).astype(dtype)
    q = (h @ c(p["wq"])).reshape(b, s, heads, hd)
    k = (h @ c(p["wk"])).reshape(b, s, kv_heads, hd)
    v = (h @ c(p["wv"])).reshape(b, s, kv_heads, hd)
    q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
    x = x + attention(q, k, v).reshape(b, s, heads * hd) @ c(p["wo"])
    h = rms_norm(x, p["mlp_norm"]).astype(dtype)
    return x + (jax.nn.silu(h @ c(p["w_gate"])) * (h @ c(p["w_up"]))) @ c(p["w_down"])


def head_loss(p, x, targets, *, dtype):
    h = rms_norm(x, p["norm"]).astype(dtype)
    logp = jax.nn.log_softmax((h @ p["w"].astype(dtype)).astype(F32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def scanned_loss(params, tokens, *, heads, kv_heads, dtype, constrain=None, remat_policy=None):
    """Mean next-token cross-entropy (fp32) of ``tokens [B, S+1]`` int32.

    ``constrain``: applied to the activations entering each block (GSPMD's hint);
    ``remat_policy``: the layer body's ``jax.checkpoint`` policy (default: save nothing).
    """
    constrain = constrain or (lambda x: x)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"]["tok"].astype(dtype)[inputs]
    # head_dim = d_model // heads (the stacked blocks are opaque here under jaxsync's sync)
    cos_sin = rope(inputs.shape[1], x.shape[-1] // heads)

    def body(h, p):
        p = jaxsync.tap(p)  # identity outside jaxsync's in-loop sync
        return block_fn(p, constrain(h), heads=heads, kv_heads=kv_heads, cos_sin=cos_sin,
                        dtype=dtype), None  # fmt: skip

    x, _ = jax.lax.scan(jax.checkpoint(body, policy=remat_policy), x, params["blocks"])
    return head_loss(params["head"], x, targets, dtype=dtype)

"""A small character-level GPT in flax NNX (its data: text_data.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import jaxsync


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    dtype: str = "float32"
    scan: bool = True  # stacked blocks run by lax.scan (False: a Python loop)


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        kw = {"dtype": dt, "param_dtype": dt, "rngs": rngs}
        self.ln1 = nnx.LayerNorm(cfg.d_model, **kw)
        self.attn = nnx.MultiHeadAttention(
            cfg.n_heads, cfg.d_model, decode=False, use_bias=False, **kw
        )
        self.ln2 = nnx.LayerNorm(cfg.d_model, **kw)
        self.up = nnx.Linear(cfg.d_model, 4 * cfg.d_model, **kw)
        self.down = nnx.Linear(4 * cfg.d_model, cfg.d_model, **kw)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    """Decoder-only transformer with a tied input/output embedding.

    With ``cfg.scan`` (the default) the blocks are one ``Block`` whose params
    carry a leading layer axis (``nnx.vmap`` at init), run by ``lax.scan`` with
    remat per layer, as large JAX models are written: compile time stays flat in
    depth, and jaxsync syncs each layer's gradient inside the backward scan.
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
        self.pos = nnx.Param(
            (0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model))).astype(dt)
        )
        if cfg.scan:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stack(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs)

            self.blocks = stack(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dt, param_dtype=dt, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        x = self.embed(tokens) + self.pos[...][:t]
        mask = nnx.make_causal_mask(tokens)
        if self.cfg.scan:  # lax.scan + remat + jaxsync.tap, written once by jaxsync
            x = jaxsync.scan_layers(self.blocks, lambda block, h: block(h, mask), x)
        else:
            for block in self.blocks:
                x = block(x, mask)
        return self.embed.attend(self.ln_f(x)).astype(jnp.float32)


def loss_fn(model: GPT, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

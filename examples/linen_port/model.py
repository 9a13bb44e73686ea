"""A small nanodo-style decoder in flax linen, and padded token data for it.

What a trainer written for ``jax.jit`` + ``NamedSharding`` looks like: every kernel
carries ``nn.with_partitioning`` names (tensor parallelism over a ``"model"`` axis
when the mesh has one), the blocks run one after another in Python, and rows are
padded to a fixed length with token 0, so each row has its own number of real
tokens. ``train_gspmd.py`` trains it as written for GSPMD; ``train_jaxsync.py`` is
the same file ported to jaxsync.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

PAD = 0

# Column-parallel kernels split their outputs over "model", row-parallel ones their inputs.
COLUMN = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
ROW = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", None))
EMBED = nn.with_partitioning(nn.initializers.normal(0.02), (None, "model"))


@dataclasses.dataclass(frozen=True)
class Config:
    """The model, the optimizer and the data: one run."""

    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    seq_len: int = 16
    batch_size: int = 16  # rows per update (the global batch)
    grad_accum: int = 2  # microbatches per update
    lr: float = 3e-3
    warmup: int = 2
    steps: int = 4
    weight_decay: float = 0.1
    clip: float = 0.5
    mode: str = "zero"  # the jaxsync port's mode: "zero", "ddp" or "fsdp"


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        head = c.d_model // c.heads
        h = nn.LayerNorm(use_bias=False)(x)
        qkv = nn.Dense(3 * c.d_model, use_bias=False, kernel_init=COLUMN)(h)
        q, k, v = jnp.split(qkv.reshape(*x.shape[:2], 3 * c.heads, head), 3, axis=2)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        att = nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
        x = x + nn.Dense(c.d_model, use_bias=False, kernel_init=ROW)(out)
        h = nn.LayerNorm(use_bias=False)(x)
        h = nn.gelu(nn.Dense(4 * c.d_model, kernel_init=COLUMN)(h))
        return x + nn.Dense(c.d_model, kernel_init=ROW)(h)


class Decoder(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = nn.Embed(c.vocab, c.d_model, embedding_init=EMBED)
        x = embed(tokens)
        for _ in range(c.layers):
            x = Block(c)(x)
        return embed.attend(nn.LayerNorm(use_bias=False)(x))


def batches(cfg: Config, rows: int, seed: int = 0):
    """Endless ``[rows, seq_len + 1]`` int32 batches; each row is padded with ``PAD``
    after a random number of real tokens (at least 2), so rows weigh differently."""
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(1, cfg.vocab, size=(rows, cfg.seq_len + 1), dtype=np.int32)
        lengths = rng.integers(2, cfg.seq_len + 2, size=(rows, 1))
        yield np.where(np.arange(cfg.seq_len + 1) < lengths, tokens, PAD).astype(np.int32)

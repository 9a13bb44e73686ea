"""A small character-level GPT in flax NNX, and the text it learns from.

The corpus is generated (a deterministic toy grammar), so the example needs no
download and every run, on any number of processes, sees the same data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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

    def __call__(self, tokens: jax.Array, blocks: Any = None) -> jax.Array:
        """Logits; ``blocks`` overrides the stacked blocks' params (a pure dict, or
        jaxsync's view of them under in-loop sync)."""
        t = tokens.shape[-1]
        x = self.embed(tokens) + self.pos[...][:t]
        mask = nnx.make_causal_mask(tokens)
        if self.cfg.scan:
            x = self._scan_blocks(x, mask, blocks)
        else:
            for block in self.blocks:
                x = block(x, mask)
        return self.embed.attend(self.ln_f(x)).astype(jnp.float32)

    def _scan_blocks(self, x: jax.Array, mask: jax.Array, blocks: Any) -> jax.Array:
        block_def, stacked = nnx.split(self.blocks)
        if blocks is None:
            blocks = nnx.to_pure_dict(stacked)

        def body(x: jax.Array, layer: Any) -> tuple[jax.Array, None]:
            layer = jaxsync.tap(layer)  # identity unless jaxsync syncs in the loop
            state = jax.tree.map(lambda v: v, stacked)
            nnx.replace_by_pure_dict(state, layer)
            return nnx.merge(block_def, state)(x, mask), None

        x, _ = jax.lax.scan(jax.checkpoint(body), x, blocks)
        return x


_SUBJECTS = [
    "the cat",
    "a dog",
    "the old sailor",
    "my neighbour",
    "the small robot",
    "a tired student",
    "the queen",
    "every child",
]
_VERBS = ["sees", "likes", "paints", "follows", "finds", "builds", "remembers", "carries"]
_OBJECTS = [
    "the red boat",
    "a quiet garden",
    "the long road",
    "a paper map",
    "the bright moon",
    "an empty house",
    "the wooden box",
    "a warm loaf",
]
_ENDS = [" today.", " at night.", " again.", " slowly.", " in the rain.", "."]


def make_corpus(n_sentences: int = 6000, seed: int = 0) -> str:
    """A deterministic toy corpus: short sentences from a tiny grammar."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_sentences):
        s = (
            f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
            f"{_OBJECTS[rng.integers(len(_OBJECTS))]}{_ENDS[rng.integers(len(_ENDS))]}"
        )
        out.append(s[0].upper() + s[1:])
    return " ".join(out)


class CharData:
    """Character tokens and deterministic batches: batch ``step`` is a pure
    function of (seed, step), so a resumed run sees exactly the data it would have."""

    def __init__(self, text: str, seq_len: int, seed: int = 0):
        chars = sorted(set(text))
        self.vocab = {c: i for i, c in enumerate(chars)}
        self.tokens = np.array([self.vocab[c] for c in text], dtype=np.int32)
        self.seq_len = seq_len
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def batch(self, step: int, global_batch: int, rows: slice | None = None) -> np.ndarray:
        """Rows ``rows`` of global batch ``step``: ``(rows, seq_len + 1)`` int32."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=global_batch)
        if rows is not None:
            starts = starts[rows]
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.tokens[idx]


def loss_fn(model: GPT, tokens: jax.Array, blocks: Any = None) -> jax.Array:
    logits = model(tokens[:, :-1], blocks)
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

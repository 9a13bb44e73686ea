"""A small mixture-of-experts GPT written as on one device, plus the specs that make it
expert- and tensor-parallel.

tests/tp_gpt.py's attention, then a top-2 routed MoE layer in place of the MLP:
each block's experts are stacked ``[L, E, ...]``. Dispatch is dense (one-hot
masks and einsums over the expert dim, no capacity), which is exact and cheap at
this size. :func:`moe_specs` splits the experts over ``"expert"`` and each
expert's hidden dim over ``"model"``; the model code never names an axis, and
GSPMD turns the einsums over a split expert dim into expert parallelism.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from tp_gpt import LAYERS, SEQ, VOCAB, D, attention, rms_norm

import jaxsync

EXPERTS, FF, TOP = 4, 32, 2


def moe_params(seed=0, dtype=jnp.float32):
    """Host (numpy) draws: eager jax.random would compile a kernel per shape."""
    rng = np.random.default_rng(seed)
    n = lambda *s: (rng.standard_normal(s, np.float32) / np.sqrt(s[-2])).astype(dtype)  # noqa: E731
    return {
        "embed": (0.5 * rng.standard_normal((VOCAB, D), np.float32)).astype(dtype),
        "blocks": {
            "ln1": np.ones((LAYERS, D), dtype),
            "qkv": n(LAYERS, D, 3 * D),
            "out": n(LAYERS, D, D),
            "ln2": np.ones((LAYERS, D), dtype),
            "router": n(LAYERS, D, EXPERTS),
            "up": n(LAYERS, EXPERTS, D, FF),
            "down": n(LAYERS, EXPERTS, FF, D),
        },
        "ln_f": np.ones((D,), dtype),
        "head": n(D, VOCAB),
    }


def moe_specs(model="model", expert="expert"):
    """Experts over ``expert`` (their hidden dim over ``model``), attention and head
    tensor-parallel as in tp_gpt; router and norms replicated."""
    return {
        "embed": P(),
        "blocks": {
            "ln1": P(), "qkv": P(None, None, model), "out": P(None, model, None),
            "ln2": P(), "router": P(),
            "up": P(None, expert, None, model), "down": P(None, expert, model, None),
        },
        "ln_f": P(),
        "head": P(None, model),
    }  # fmt: skip


def moe(p, x):
    """Top-2 routing: each token goes to its two highest-scoring experts, their
    outputs mixed by the softmax of those two scores."""
    logits = x @ p["router"].astype(jnp.float32)  # [b, t, E]
    top, idx = jax.lax.top_k(logits, TOP)
    picked = jax.nn.one_hot(idx, EXPERTS, dtype=jnp.float32)  # [b, t, k, E]
    combine = jnp.einsum("btk,btke->bte", jax.nn.softmax(top, -1), picked)
    routed = jnp.einsum("btd,bte->ebtd", x, jnp.sum(picked, 2))  # zeros where not routed
    hidden = jax.nn.gelu(jnp.einsum("ebtd,edf->ebtf", routed, p["up"].astype(jnp.float32)))
    out = jnp.einsum("ebtf,efd->ebtd", hidden, p["down"].astype(jnp.float32))
    return jnp.einsum("ebtd,bte->btd", out, combine)


def block(p, h):
    h = attention(p, h)
    return h + moe(p, rms_norm(h, p["ln2"]))


def moe_loss(params, batch):
    tokens, targets = batch
    h = params["embed"][tokens].astype(jnp.float32)

    def body(h, p):
        p = jaxsync.tap(p)  # identity outside jaxsync's in-loop sync
        return block(p, h), None

    h, _ = jax.lax.scan(jax.checkpoint(body), h, params["blocks"])
    logits = rms_norm(h, params["ln_f"]) @ params["head"].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    # A one-hot product, not take_along_axis: XLA's SPMD partitioner (jax 0.10.2, CPU)
    # aborts on that gather when the rows are split over "expert" inside the step's
    # data-manual shard_map and the vocab over "model".
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, VOCAB, dtype=logp.dtype), -1))


def moe_batches(seed, steps, batch):
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (steps, batch, SEQ + 1), np.int32)
    return tokens[..., :-1], tokens[..., 1:]

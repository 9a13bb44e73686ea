"""Train the nanodo-style decoder with jaxsync: ``train_gspmd.py`` ported.

    python examples/linen_port/train_jaxsync.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

sys.path.insert(0, str(Path(__file__).parent))
from model import PAD, Config, Decoder, batches  # noqa: E402


def decay_mask(params):
    """Weight decay on kernels and embeddings, not on norms and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in ("kernel", "embedding"), params
    )


def make_optimizer(c: Config):
    schedule = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup, c.steps)
    adamw = functools.partial(optax.adamw, schedule, b1=0.9, b2=0.95)
    return {"decay": adamw(weight_decay=c.weight_decay), "none": adamw(weight_decay=0.0)}


def make_loss(c: Config):
    model = Decoder(c)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        targets, weights = batch[:, 1:], batch[:, 1:] != PAD
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        ntokens = weights.sum()
        correct = jnp.sum((logits.argmax(-1) == targets) & weights)
        return jnp.sum(losses * weights), {"ntokens": ntokens, "correct": correct}

    return jaxsync.weighted_loss(loss_fn, lambda batch: jnp.sum(batch[:, 1:] != PAD))


def train(c: Config, mesh: jax.sharding.Mesh, log=print):
    """Trains ``c.steps`` updates on ``mesh`` (axes ``data`` and ``model``); returns the
    params and each call's ``(loss, aux)``."""
    tx, loss_fn = make_optimizer(c), make_loss(c)
    boxed = Decoder(c).init(jax.random.PRNGKey(0), jnp.ones((1, c.seq_len), jnp.int32))["params"]
    labels = lambda p: jax.tree.map(lambda d: "decay" if d else "none", decay_mask(p))
    train_step = jaxsync.train_step(loss_fn, tx, mesh, c.mode, microbatches=c.grad_accum,
                                    clip_grad_norm=c.clip, labels=labels, has_aux=True)
    state = train_step.init(boxed)

    data = batches(c, c.batch_size)
    history = []
    for i in range(c.steps):
        batch = jax.device_put(next(data), NamedSharding(mesh, P("data")))
        state, (loss, aux) = train_step(state, batch)
        history.append((float(loss), jax.tree.map(int, aux)))
        log(f"step {i}: loss {loss:.4f}, {aux['ntokens']} tokens")
    params = train_step.params(state)
    n = sum(x.size for x in jax.tree.leaves(params))
    log(f"{n:,} params")
    return params, history


def make_mesh(data: int, model: int) -> jax.sharding.Mesh:
    """A (data, model) mesh whose axes the compiler partitions (GSPMD's Auto axes)."""
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


if __name__ == "__main__":
    n = jax.device_count()
    train(Config(), make_mesh(n // 2, 2) if n > 1 else make_mesh(1, 1))

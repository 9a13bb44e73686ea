"""Train the nanodo-style decoder with ``jax.jit`` and ``NamedSharding``: the trainer as
a JAX user writes it without jaxsync. ``train_jaxsync.py`` is the same file ported.

    python examples/linen_port/train_gspmd.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
from model import PAD, Config, Decoder, batches  # noqa: E402


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


def decay_mask(params):
    """Weight decay on kernels and embeddings, not on norms and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in ("kernel", "embedding"), params
    )


def make_optimizer(c: Config):
    schedule = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup, c.steps)
    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=c.weight_decay, mask=decay_mask)
    return optax.MultiSteps(optax.chain(optax.clip_by_global_norm(c.clip), adamw), c.grad_accum)


def make_loss(c: Config):
    model = Decoder(c)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        targets, weights = batch[:, 1:], batch[:, 1:] != PAD
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        ntokens = weights.sum()
        correct = jnp.sum((logits.argmax(-1) == targets) & weights)
        return jnp.sum(losses * weights) / ntokens, {"ntokens": ntokens, "correct": correct}

    return loss_fn


def train(c: Config, mesh: jax.sharding.Mesh, log=print):
    """Trains ``c.steps`` updates on ``mesh`` (axes ``data`` and ``model``); returns the
    params and each call's ``(loss, aux)``."""
    tx, loss_fn = make_optimizer(c), make_loss(c)
    boxed = Decoder(c).init(jax.random.PRNGKey(0), jnp.ones((1, c.seq_len), jnp.int32))["params"]
    params = jax.device_put(nn.unbox(boxed), nn.get_sharding(boxed, mesh))
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), (loss, aux)

    data = batches(c, c.batch_size // c.grad_accum)
    history = []
    for i in range(c.steps * c.grad_accum):
        batch = jax.device_put(next(data), NamedSharding(mesh, P("data")))
        state, (loss, aux) = train_step(state, batch)
        history.append((float(loss), jax.tree.map(int, aux)))
        log(f"step {i}: loss {loss:.4f}, {aux['ntokens']} tokens")
    params = state.params
    n = sum(x.size for x in jax.tree.leaves(params))
    log(f"{n:,} params")
    return params, history


def make_mesh(data: int, model: int) -> jax.sharding.Mesh:
    """A (data, model) mesh whose axes the compiler partitions (GSPMD's Auto axes)."""
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


if __name__ == "__main__":
    n = jax.device_count()
    train(Config(), make_mesh(n // 2, 2) if n > 1 else make_mesh(1, 1))

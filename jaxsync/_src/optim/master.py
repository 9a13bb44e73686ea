"""DDP's fp32 master weights: the replicated optimizer runs on fp32 copies of
low-precision params, as ZeRO's distributed optimizer runs on its fp32 shards.

Plain data parallelism used to update bf16 or fp16 params in their own dtype:
each update rounded to bf16 (2.2e-2 away from fp32 training after a few hundred
steps of a small model, 9x ZeRO's distance), and fp16 params under Adam went to
Inf on the first finite step. Megatron keeps fp32 main params in plain data
parallelism too. :func:`with_fp32_master` wraps the user's optax optimizer: its
state holds the fp32 master beside the inner state, the inner optimizer reads and
updates the master (weight decay included), and the updates it returns land the
params on the master's rounding (``p + (m - p)`` in fp32, then cast), which is
optax.apply_updates' arithmetic and ZeRO's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class MasterState(NamedTuple):
    """A DDP optimizer state over fp32 master weights.

    Attributes:
      master: the params in fp32 (replicated, shaped like the params).
      inner_state: the wrapped optimizer's state, built over ``master``.
    """

    master: PyTree
    inner_state: Any


def needs_master(params: PyTree) -> bool:
    """Whether any float param is narrower than fp32 (bf16, fp16)."""
    return any(
        jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4
        for x in jax.tree.leaves(params)
    )


def _fp32(x: Any) -> Any:
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def with_fp32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` run on fp32 copies of the params; its updates land the params on them.

    ``update(grads, state, params)`` takes gradients of any float dtype (cast to fp32)
    and the params (bf16/fp16/fp32) and returns fp32 updates: the new master minus
    the params, so ``optax.apply_updates`` gives the master rounded to each param's
    dtype.
    """

    def init(params: PyTree) -> MasterState:
        master = jax.tree.map(_fp32, params)
        return MasterState(master, inner.init(master))

    def update(grads: PyTree, state: MasterState, params: PyTree = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("with_fp32_master needs the params in update().")
        return master_update(inner, grads, state, params)[:2]

    return optax.GradientTransformation(init, update)


def master_update(
    inner: optax.GradientTransformation, grads: PyTree, state: MasterState, params: PyTree
) -> tuple[PyTree, MasterState, PyTree]:
    """:func:`with_fp32_master`'s update, and ``inner``'s own updates (the ones a
    trainer's update norm measures: :mod:`jaxsync._src.optim.logged`)."""
    updates, inner_state = inner.update(jax.tree.map(_fp32, grads), state.inner_state,
                                        state.master)  # fmt: skip
    master = optax.apply_updates(state.master, updates)
    out = jax.tree.map(lambda m, p: m - _fp32(p), master, params)
    return out, MasterState(master, inner_state), updates

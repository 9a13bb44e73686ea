"""Random numbers in the step: one key, one stream per piece of the global batch.

The loss runs on each device's rows, microbatch by microbatch (a *piece* each; in
deterministic mode a unit each). A key closed over by the loss, or passed in the
batch, is the same on every device: every piece would draw the same dropout masks.
So the step takes the key itself, ``step(state, batch, key=key)``, and hands each
piece its own: piece ``p``, the ``p``-th block of consecutive rows of the global batch
(device-major, then microbatch; a deterministic unit's index), gets
``jax.random.fold_in(key, p)`` as the loss's third argument. An NNX module's
``nnx.Rngs`` streams (``nnx.RngKey`` state) are folded the same way for each piece,
``fold_in(stream key, p)``, and keep their unfolded key in the state (their
``nnx.RngCount`` advances as one call advances it).

The piece index travels with the rows: the step adds a per-row leaf (the row's piece
index, its piece key's data) to the batch inside the step, so every path that cuts the
rows into microbatches or units (scans, loops, FSDP, 2-D bodies) cuts the keys with
them, and each piece reads its first row's.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

KEY_IN_BATCH = (
    "TrainStep: batch leaf {leaf} is a PRNG key ({what}). In the batch it would be split "
    "over devices like rows; closed over by the loss it would be the same on every device "
    "(every device's rows would draw the same dropout masks). Pass it to the step: "
    "`state, loss = step(state, batch, key=key)`; `loss_fn(params, batch, key)` then "
    "gets each piece's own key, `jax.random.fold_in(key, piece)`."
)
BAD_KEY = (
    "TrainStep: `key` must be one PRNG key (`jax.random.key(seed)`, or the uint32 data of "
    "`jax.random.PRNGKey(seed)`), got {got}. Split a new one for every step: "
    "`key, sub = jax.random.split(key)`; `step(state, batch, key=sub)`."
)
NO_KEY_ARG = (
    "TrainStep: `step(state, batch, key=...)` passes each piece's key to `loss_fn` as "
    "its third argument, `loss_fn(params, batch, key)`, but {name} takes {got}. Add the "
    "`key` argument (and use it: `rngs={{'dropout': key}}` for flax linen, `key=key` for "
    "equinox), or call the step without `key`."
)


@dataclasses.dataclass(frozen=True)
class KeyKind:
    """What the step was given: the key's implementation, and whether the loss gets a
    typed key or its raw uint32 data (as it was given)."""

    impl: str
    raw: bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Keyed:
    """This device's rows with each row's piece index and piece key (per-row leaves,
    cut into pieces with the rows); ``None`` where not needed."""

    batch: Any
    ids: Any = None  # int32 [rows]: the global piece index of each row
    keys: Any = None  # uint32 [rows, *key data]: fold_in(key, piece) of each row
    kind: KeyKind | None = dataclasses.field(default=None, metadata={"static": True})


def user_batch(batch: Any) -> Any:
    return batch.batch if isinstance(batch, Keyed) else batch


def check_key(key: Any, loss_fn: Any) -> tuple[jax.Array, KeyKind]:
    """``(key data, KeyKind)`` of the key given to ``step(..., key=)``, checked."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(BAD_KEY.format(got=f"a key array of shape {key.shape}"))
        kind = KeyKind(str(jax.random.key_impl(key)), raw=False)
        data = jax.random.key_data(key)
    elif dtype is not None and np.dtype(dtype) == np.uint32 and np.shape(key) == (2,):
        kind, data = KeyKind("threefry2x32", raw=True), key
    else:
        got = f"{type(key).__name__} of shape {np.shape(key)} and dtype {dtype}"
        raise ValueError(BAD_KEY.format(got=got))
    _check_arity(loss_fn)
    return data, kind


def _check_arity(loss_fn: Any) -> None:
    fn = getattr(loss_fn, "sum_fn", loss_fn)  # a weighted_loss: its sum_fn gets the key
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None, None)
    except TypeError:
        n = sum(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in sig.parameters.values()
        )
        name = f"`{getattr(fn, '__name__', 'loss_fn')}`"
        raise TypeError(NO_KEY_ARG.format(name=name, got=f"{n} positional argument(s)")) from None


def check_batch_keys(batch: Any) -> None:
    """A PRNG key in the batch is refused, saying to pass it as ``key=``: a typed key,
    or a raw ``uint32[2]`` one where the other leaves have other rows (the rows check
    would say to take it out of the batch, and closed over it is every device's)."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    rows = {np.shape(x)[0] for _, x in leaves if np.ndim(x)}
    for path, x in leaves:
        dtype = getattr(x, "dtype", None)
        typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
        raw = (
            dtype is not None and not typed and np.dtype(dtype) == np.uint32
            and np.shape(x) == (2,) and rows != {2}
        )  # fmt: skip
        if typed or raw:
            what = f"shape {tuple(np.shape(x))}, {dtype}"
            leaf = jax.tree_util.keystr(path) or "(the batch)"
            raise ValueError(KEY_IN_BATCH.format(leaf=leaf, what=what))


def rng_key_paths(model: Any) -> tuple[tuple[Any, ...], ...]:
    """The paths of an NNX module's ``nnx.RngKey`` state (its ``nnx.Rngs`` streams)."""
    if model is None:
        return ()
    from flax import nnx

    return tuple(tuple(p) for p, v in nnx.to_flat_state(model.rest) if isinstance(v, nnx.RngKey))


def pieces_per_device(cfg: Any) -> int:
    """How many loss calls (pieces) each device's rows are cut into."""
    from ..modes import deterministic_of

    det = deterministic_of(cfg.mode)
    if det is not None:
        from ...deterministic.units import units_per_device

        return units_per_device(det, cfg.axis_name, "jaxsync.train_step")
    return cfg.microbatches


def keyed(cfg: Any, plan: Any, batch: Any, key_data: Any, kind: KeyKind | None) -> Any:
    """Inside the step: ``batch`` (this device's rows) with each row's piece index (an
    NNX module with ``nnx.Rngs``) and piece key (``key`` given); unchanged otherwise."""
    nnx_rngs = bool(rng_key_paths(plan.model))
    if kind is None and not nnx_rngs:
        return batch
    rows = {x.shape[0] for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0)}
    if len(rows) != 1:
        raise ValueError(f"TrainStep: the batch's leaves disagree on their rows ({rows}).")
    (n_rows,) = rows
    k = pieces_per_device(cfg)
    device = jax.lax.axis_index(cfg.axis_name)
    pieces = device * k + jnp.arange(k, dtype=jnp.int32)  # this device's global pieces
    ids = jnp.repeat(pieces, n_rows // k, total_repeat_length=n_rows)
    keys = None
    if kind is not None:
        key = jax.random.wrap_key_data(key_data, impl=kind.impl)
        piece_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, pieces)
        data = jax.random.key_data(piece_keys)
        keys = jnp.repeat(data, n_rows // k, axis=0, total_repeat_length=n_rows)
    return Keyed(batch, ids if nnx_rngs else None, keys, kind)


def piece_args(piece: Any) -> tuple[Any, Any, tuple[Any, ...]]:
    """``(the piece's own rows, its global piece index or None, extra loss args)``."""
    if not isinstance(piece, Keyed):
        return piece, None, ()
    pid = None if piece.ids is None else piece.ids[0]
    kind = piece.kind
    if piece.keys is None or kind is None:
        return piece.batch, pid, ()
    data = piece.keys[0]
    key = data if kind.raw else jax.random.wrap_key_data(data, impl=kind.impl)
    return piece.batch, pid, (key,)


def fold_model_keys(model_state: PyTree, paths: tuple, pid: Any) -> PyTree:
    """``model_state`` (a pure dict) with each ``nnx.RngKey`` at ``paths`` folded with
    the piece index ``pid`` (stacked layers' keys each folded)."""

    def fold(key: jax.Array) -> jax.Array:
        flat = key.reshape(-1)
        out = jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat, pid)
        return out.reshape(key.shape)

    return _replace(model_state, paths, lambda path, x: fold(x))


def keep_model_keys(new: PyTree, old: PyTree, paths: tuple) -> PyTree:
    """``new`` with the ``nnx.RngKey`` leaves at ``paths`` put back to ``old``'s."""
    return _replace(new, paths, lambda path, x: _get(old, path))


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _replace(tree: PyTree, paths: tuple, fn: Any) -> PyTree:
    wanted = set(paths)

    def walk(node: Any, prefix: tuple) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, (*prefix, k)) for k, v in node.items()}
        return fn(prefix, node) if prefix in wanted else node

    return walk(tree, ())

"""flax linen's mutable collections (``batch_stats``...) as the step's model state.

A linen model keeps its state outside the params, in collections a call marks
``mutable`` and returns updated: ``model.apply({"params": p, "batch_stats": bs}, x,
mutable=["batch_stats"]) -> (y, {"batch_stats": new})``. The step takes the
collections at ``init(params, model_state={"batch_stats": bs})``, hands the loss the
whole variables dict and keeps what the loss returns, as flax's own examples write
it: ``loss_fn(variables, batch) -> (loss, new_collections)``, or with ``has_aux``
``(loss, (new_collections, aux))``. The state then follows the rules of
:mod:`jaxsync._src.step.pieces.meaning` (``batch_stats``: a mean over devices and
microbatches).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

PyTree = Any

#: Collections whose float leaves are statistics of the rows (a mean over pieces).
STATISTICS = ("batch_stats",)

RETURN = (
    "jaxsync.train_step: with linen collections given to `init(params, model_state=...)`, "
    "`loss_fn(variables, batch)` returns `(loss, new_collections)` (with `has_aux=True`: "
    "`(loss, (new_collections, aux))`), `new_collections` being what "
    "`model.apply(variables, x, mutable=[...])` returns beside its output; got {got}."
)


def check_collections(model_state: Any, fn: str) -> dict[str, PyTree]:
    """``model_state`` given to ``init`` for a pytree (linen) loss, checked."""
    if not isinstance(model_state, Mapping) or not model_state:
        raise TypeError(
            f"{fn}: `model_state` must be a non-empty mapping of linen collection name -> "
            f"its variables (e.g. {{'batch_stats': variables['batch_stats']}}), got "
            f"{type(model_state).__name__}."
        )
    if "params" in model_state:
        raise ValueError(
            f"{fn}: `model_state` holds a 'params' collection; pass the params as the first "
            "argument and only the other collections (batch_stats...) as `model_state`."
        )
    bad = [
        jax.tree_util.keystr(p)
        for p, x in jax.tree_util.tree_flatten_with_path(dict(model_state))[0]
        if not hasattr(x, "dtype")
    ]
    if bad:
        raise TypeError(f"{fn}: `model_state` leaves {bad[:4]} are not arrays.")
    return _plain(model_state)


def _plain(tree: Any) -> Any:
    """FrozenDicts as dicts, so the state's structure is the same before and after."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def call(
    fn: Any, params: Any, collections: dict, batch: Any, has_aux: bool, *extra: Any
) -> tuple[Any, Any]:
    """``fn({"params": params, **collections}, batch, *extra)`` (``extra``: the piece's
    key, when the step is given one) as ``(loss or (loss, aux), the collections after
    the call)``; a collection the call did not return is kept."""
    out = fn({"params": params, **collections}, batch, *extra)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(RETURN.format(got=type(out).__name__))
    loss, rest = out
    user = None
    if has_aux:
        if not (isinstance(rest, tuple) and len(rest) == 2):
            raise ValueError(RETURN.format(got=f"(loss, {type(rest).__name__})"))
        rest, user = rest
    if not isinstance(rest, Mapping) or not set(rest) <= set(collections):
        got = sorted(rest) if isinstance(rest, Mapping) else type(rest).__name__
        raise ValueError(RETURN.format(got=f"new collections {got} for {sorted(collections)}"))
    new = {**collections, **_plain(rest)}
    if jax.tree.structure(new) != jax.tree.structure(collections):
        raise ValueError(
            "jaxsync.train_step: the collections `loss_fn` returns do not have the structure "
            "of those given to `init` (a variable added or dropped); create every variable "
            "at `model.init` and pass all of them."
        )
    return ((loss, user) if has_aux else loss), new


def collection_rule(name: str, dtype: Any) -> str | None:
    """The rule of a linen state leaf (dotted ``collection.path``) by its collection."""
    import jax.numpy as jnp

    if name.split(".")[0] in STATISTICS and jnp.issubdtype(dtype, jnp.floating):
        return "mean"
    if dtype == jnp.bool_:
        return "any"
    if jnp.issubdtype(dtype, jnp.integer):
        return "sum"
    return None

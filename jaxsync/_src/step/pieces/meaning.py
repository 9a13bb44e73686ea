"""One step, one meaning: the aux and model state a step returns, as on one device.

The loss runs on each device's rows, microbatch by microbatch (a *piece* each; in
deterministic mode a unit each). Everything it returns besides the gradient is
combined over all pieces of the global batch by a rule stated per leaf, so that it
means what the same loss means on one device on the whole global batch:

- aux: a leaf whose leading axis is the piece's rows is per-row and comes back as
  the global rows in the global batch's order; otherwise floats are means (weighted
  by each piece's token weight for a :func:`jaxsync.weighted_loss`), integers sums,
  bools ``any``. ``train_step(aux_reduce={name: rule})`` declares another rule.
- model state: every piece starts from the step's old state. ``nnx.BatchStat``
  takes the mean of the pieces' new values, ``nnx.RngCount`` their maximum (every
  piece advanced it once, as one call does), integer state the sum of the pieces'
  changes (counters); ``train_step(state_reduce={name: rule})`` declares another.
  A float state that differs between devices with no rule is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core.axes import to_varying, varying_axes
from ...core.names import group_of, param_name

PyTree = Any

#: What ``aux_reduce`` and ``state_reduce`` accept for a leaf.
AUX_RULES = ("mean", "sum", "max", "min", "any", "all", "rows")
STATE_RULES = ("mean", "sum", "max", "min", "any", "all")

NOT_COMBINABLE = (
    "jaxsync.train_step: aux leaf `{name}` is {what}, which cannot be combined over devices "
    "and microbatches into its one-device value. Return arrays or Python numbers only: "
    "{fix}"
)
UNDECLARED_STATE = (
    "jaxsync.train_step: the model state `{name}` ({kind}, {dtype}) differs between devices "
    "after the step (it varies over {axes}), and jaxsync cannot know what its one-device "
    "value is. Declare it: `train_step(..., state_reduce={{{name!r}: rule}})` with rule "
    "'mean' (statistics such as BatchNorm's; or make it an nnx.BatchStat), 'max'/'min' "
    "(running maxima such as an fp8 amax) or 'sum' (counters: old + the sum of every "
    "piece's change)."
)


def check_rules(rules: Any, arg: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """``rules`` (None or a mapping of dotted name -> rule), checked at ``train_step``."""
    if rules is None:
        return {}
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"`{arg}` must be a mapping of dotted leaf name -> rule (one of {allowed}), "
            f"e.g. {{'ntokens': 'sum'}}; got {type(rules).__name__}."
        )
    for k, v in rules.items():
        if not isinstance(k, str) or v not in allowed:
            raise ValueError(
                f"`{arg}` maps dotted leaf names to one of {allowed}; got {k!r}: {v!r}."
            )
    return dict(rules)


def _declared(name: str, rules: Mapping[str, str]) -> str | None:
    hit = group_of(name, tuple(rules))
    return None if hit is None else rules[hit]


def _unused(names: list[str], rules: Mapping[str, str], arg: str, what: str) -> None:
    unused = [k for k in rules if not any(group_of(n, (k,)) for n in names)]
    if unused:
        raise ValueError(
            f"jaxsync.train_step: `{arg}` names {unused}, which match no {what} leaf; the "
            f"leaves are {names[:12]} (dotted paths; a prefix covers the leaves below it)."
        )


# ------------------------------------------------------------------------ aux
def check_aux(aux: PyTree) -> PyTree:
    """The user's aux with Python numbers as arrays; what cannot be combined refused
    (at trace time, inside the loss, before JAX rejects it without a name)."""

    def one(path: Any, x: Any) -> Any:
        name = param_name(path)
        if isinstance(x, (bool, int, float, np.number, np.bool_)) or (
            isinstance(x, np.ndarray) and x.dtype != np.dtype(object)
        ):
            return jnp.asarray(x)
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            fix = (
                "a key has no mean or sum; return `jax.random.key_data(key)` with a declared "
                f"rule (`aux_reduce={{{name!r}: 'max'}}`), or keep the key outside the loss."
            )
            raise TypeError(NOT_COMBINABLE.format(name=name, what="a PRNG key", fix=fix))
        if dtype is None or not hasattr(x, "shape") or np.dtype(dtype) == np.dtype(object):
            fix = "return it from your own code outside the step, or as a number."
            what = f"a {type(x).__name__}"
            raise TypeError(NOT_COMBINABLE.format(name=name, what=what, fix=fix))
        return x

    return jax.tree_util.tree_map_with_path(one, aux)


def aux_rule(name: str, x: Any, rows: set[int], rules: Mapping[str, str]) -> str:
    """The rule of one aux leaf ``x`` (stacked ``[pieces, ...]``)."""
    rule = _declared(name, rules)
    if rule is not None:
        if rule == "rows" and x.ndim < 2:
            raise ValueError(
                f"jaxsync.train_step: aux leaf `{name}` is declared 'rows' but is a scalar "
                "on each device; a per-row leaf has the rows as its leading axis."
            )
        return rule
    if x.ndim >= 2 and x.shape[1] in rows:
        return "rows"
    if x.dtype == jnp.bool_:
        return "any"
    if jnp.issubdtype(x.dtype, jnp.integer):
        return "sum"
    return "mean"


def reduce_aux(
    aux: PyTree, weight: Any, rows: set[int], axes: tuple[str, ...], rules: Mapping[str, str]
) -> PyTree:
    """``aux`` (each leaf ``[pieces, ...]``) combined over pieces and devices by rule.

    ``weight``: each piece's token weight ``[pieces]`` (a weighted loss) or None;
    ``rows``: the leading sizes of a piece's batch leaves (what makes a leaf per-row).
    """
    leaves = jax.tree_util.tree_flatten_with_path(aux)[0]
    _unused([param_name(p) for p, _ in leaves], rules, "aux_reduce", "aux")

    def one(path: Any, x: Any) -> Any:
        return combine(x, aux_rule(param_name(path), x, rows, rules), weight, axes)

    return jax.tree_util.tree_map_with_path(one, aux)


def combine(x: jax.Array, rule: str, weight: Any, axes: tuple[str, ...]) -> jax.Array:
    """One leaf ``[pieces, ...]`` combined over pieces and the data ``axes``.

    A value the same on every device (not device-varying: a constant, an RNG counter)
    needs no collective for a mean, max, min, any or all, and a sum of it is a product:
    only the axes it varies over are reduced (no collectives a step did not have)."""
    vary = tuple(a for a in axes if a in varying_axes(x))
    if rule == "rows":  # device-major, then piece, then row: the global batch's order
        flat = to_varying(x, axes).reshape(-1, *x.shape[2:])
        return jax.lax.all_gather(flat, axes, axis=0, tiled=True, to="invarying")
    if rule == "sum":
        dtype = jnp.int32 if x.dtype == jnp.bool_ else x.dtype
        same = [a for a in axes if a not in vary]  # each device holds its own copy
        total = jnp.sum(x, axis=0, dtype=dtype) * (jax.lax.axis_size(tuple(same)) if same else 1)
        return jax.lax.psum(total, vary) if vary else total
    if rule == "mean":
        xf = x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)
        plain = jnp.mean(xf, axis=0)
        plain = jax.lax.pmean(plain, vary) if vary else plain
        if weight is None:
            return plain
        x = to_varying(x, axes)
        w = to_varying(weight.astype(xf.dtype), axes).reshape(-1, *(1,) * (x.ndim - 1))
        num = jax.lax.psum(jnp.sum(w * xf, axis=0), axes)
        den = jax.lax.psum(jnp.sum(w), axes)
        return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), plain)
    if rule in ("max", "min"):
        as_int = x.dtype == jnp.bool_
        y = x.astype(jnp.int32) if as_int else x
        y = jnp.max(y, axis=0) if rule == "max" else jnp.min(y, axis=0)
        if vary:
            y = jax.lax.pmax(y, vary) if rule == "max" else jax.lax.pmin(y, vary)
        return y.astype(jnp.bool_) if as_int else y
    # "any" / "all"
    b = (x != 0).astype(jnp.int32)
    b = jnp.max(b, axis=0) if rule == "any" else jnp.min(b, axis=0)
    if vary:
        b = jax.lax.pmax(b, vary) if rule == "any" else jax.lax.pmin(b, vary)
    return b > 0


# ---------------------------------------------------------------- model state
def state_rules(
    model: Any, rules: Mapping[str, str], model_state: PyTree = None
) -> dict[str, str | None]:
    """Per dotted model-state name: the declared rule, else the one its Variable
    type (an NNX module) or its collection (linen: ``batch_stats``) implies (None:
    keep only if it is the same on every device)."""
    if model is None:
        from ..models.collections import collection_rule

        leaves = jax.tree_util.tree_flatten_with_path(model_state or {})[0]
        names = [(param_name(p), x.dtype) for p, x in leaves]
        out = {n: _declared(n, rules) or collection_rule(n, d) for n, d in names}
        _unused(list(out), rules, "state_reduce", "model state")
        return out
    from flax import nnx

    out: dict[str, str | None] = {}
    for path, var in nnx.to_flat_state(model.rest):
        name = ".".join(str(k) for k in path)
        rule = _declared(name, rules)
        if rule is not None and _is_key(var):
            raise ValueError(
                f"jaxsync.train_step: `state_reduce` gives the PRNG key state `{name}` the "
                f"rule {rule!r}; keys are never combined (each piece keeps the step's key, "
                "and its RngCount advances): drop it from `state_reduce`."
            )
        if rule is None:
            dtype = jnp.dtype(var.dtype) if not _is_key(var) else None
            if isinstance(var, nnx.BatchStat):
                rule = "mean"
            elif isinstance(var, nnx.RngCount):
                rule = "max"  # every piece advanced it once, as one call does
            elif dtype is not None and dtype == jnp.bool_:
                rule = "any"
            elif dtype is not None and jnp.issubdtype(dtype, jnp.integer):
                rule = "sum"
        out[name] = rule
    _unused(list(out), rules, "state_reduce", "model state")
    return out


def _is_key(var: Any) -> bool:
    return jax.dtypes.issubdtype(var.dtype, jax.dtypes.prng_key)


def _kind(model: Any, name: str) -> str:
    if model is None:
        return f"in linen collection {name.split('.')[0]!r}"
    from flax import nnx

    for path, var in nnx.to_flat_state(model.rest):
        if ".".join(str(k) for k in path) == name:
            return type(var).__name__
    return "state"


def reduce_state(
    new: PyTree,
    old: PyTree,
    finite: jax.Array,
    axes: tuple[str, ...],
    rules: Mapping[str, str | None],
    model: Any = None,
) -> PyTree:
    """The model state after the step: ``new`` (each leaf ``[pieces, ...]``, every
    piece started from ``old``) combined by rule. On a skipped step float state
    stays as it was, so NaNs never reach it."""

    def one(path: Any, x: Any, before: Any) -> Any:
        name = param_name(path)
        rule = rules.get(name)
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        if rule is None:
            vary = tuple(sorted(varying_axes(x) & set(axes)))
            if vary:
                raise ValueError(
                    UNDECLARED_STATE.format(
                        name=name, kind=_kind(model, name), dtype=x.dtype, axes=vary
                    )
                )
            y = x[0]  # the same on every device, and so in every piece
        elif rule == "sum":
            delta = (x - before[None]).astype(x.dtype)
            y = (before + combine(delta, "sum", None, axes)).astype(x.dtype)
        else:
            y = combine(x, rule, None, axes).astype(x.dtype)
        return jnp.where(finite, y, before) if floating else y

    return jax.tree_util.tree_map_with_path(one, new, old)


def stack_one(tree: PyTree) -> PyTree:
    """A single piece's outputs as ``[1, ...]`` pieces."""
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def piece_rows(batch: PyTree, pieces: int) -> set[int]:
    """The leading sizes of one piece's batch leaves (this device's rows / pieces)."""
    return {x.shape[0] // pieces for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0)}

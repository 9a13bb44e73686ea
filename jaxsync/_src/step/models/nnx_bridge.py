"""flax NNX models in and out of jaxsync's pure-pytree world.

jaxsync's sync, optimizer and FSDP work on a pytree of arrays. An NNX user has a
module. The bridge splits it once into a static ``graphdef``, its ``nnx.Param``
values (the params jaxsync trains, as a pure dict) and the rest of its state,
and merges a module back inside the step so that ``loss_fn(model, batch)`` sees
an ordinary module. Without it every trainer writes the same split, copy,
``replace_by_pure_dict`` and merge by hand (as ``examples/train_gpt.py`` does).

Scanned (``nnx.vmap``-stacked) layers need one more thing: under in-loop sync the
stacked group reaches the model as jaxsync's view (a :class:`jaxsync.LayerStack`,
or FSDP's sharded layers), which only :func:`jaxsync.tap` turns into params.
:func:`scan_layers` runs a stacked module's layers with ``lax.scan`` and taps each one,
so the model code is the same in and out of the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from ...sync.views import TRACE_VIEWS, is_view, tap

PyTree = Any

MERGE_FIX = (
    "Pass `params` as `nnx.to_pure_dict` of the nnx.Param state from the same `nnx.split` "
    "as `graphdef` (`graphdef, state = nnx.split(model, nnx.Param)`), with every nnx.Param "
    "and nothing else; under `jaxsync.value_and_grad(..., sync=tx)` pass the params the "
    "loss function receives, as they are."
)
SCAN_FIX = (
    "The stacked group's params reach the layer loop as the params (or jaxsync's view of "
    "them) given to the step: they must be the nnx.Param state of this stacked module, "
    "as `nnx.to_pure_dict(nnx.state(model, nnx.Param))` gives it (merge the module with "
    "`jaxsync.merge_module`, or train with `jaxsync.train_step`)."
)
NOTRACE_VIEWS_SCOPE = (
    "jaxsync.merge_module: `params` holds jaxsync's view(s) of the stacked group(s) {groups}, "
    "which only exist inside the loss function that `jaxsync.value_and_grad(..., sync=...)`, "
    "`jaxsync.accumulate_grads(..., sync=...)` or `FullyShard.value_and_grad` differentiates: "
    "merge there. To evaluate, merge the plain params (`fs.unshard(shards)`, "
    "`step.params(state)`) instead."
)


STEP_FIX = (
    "The step's state must come from this step's `init` / `abstract_state` (or a restore "
    "of a checkpoint of the same model): `state.params` and `state.model_state` keep the "
    "structure of the module `init` was given."
)


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in path)


def _flat(tree: Mapping, prefix: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], Any]:
    """A nested dict's leaves by key path; views are leaves, empty dicts vanish (as in flax)."""
    out: dict[tuple[Any, ...], Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def _nest(flat: Mapping[tuple[Any, ...], Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def _names(names: list[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + "]" + more


def check_keys(want: list[str], pure: Any, fn: str, what: str, fix: str) -> None:
    """``pure`` (a nested dict) has exactly the leaves ``want`` (dotted names), or a
    ValueError naming the missing and unexpected ones, before flax merges it."""
    if not isinstance(pure, Mapping):
        raise TypeError(
            f"{fn}: `{what}` must be a nested dict of arrays (`nnx.to_pure_dict` of a state), "
            f"got {type(pure).__name__}. {fix}"
        )
    got = [_dotted(p) for p in _flat(pure)]
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)} (in the module, not in `{what}`)")
        if extra:
            parts.append(f"unexpected {_names(extra)} (in `{what}`, not in the module)")
        raise ValueError(
            f"{fn}: `{what}` does not match the module's state: {'; '.join(parts)}. {fix}"
        )


def _fill(template: Any, pure: Any, fn: str, what: str, fix: str) -> Any:
    """A copy of the state ``template`` holding the values of ``pure``, keys checked."""
    check_keys([_dotted(p) for p, _ in nnx.to_flat_state(template)], pure, fn, what, fix)
    state = jax.tree.map(lambda v: v, template)
    nnx.replace_by_pure_dict(state, pure)
    return state


def _register(model: Any, views: dict[str, Any], fn: str) -> None:
    """Hands each view to the :func:`scan_layers` call on its submodule."""
    if not views:
        return
    registry = TRACE_VIEWS.get()
    if registry is None:
        raise ValueError(NOTRACE_VIEWS_SCOPE.format(groups=sorted(views)))
    for name, view in views.items():
        try:
            node = _submodule(model, name)
        except (AttributeError, IndexError, KeyError, TypeError):
            node = None
        if not isinstance(node, nnx.Module):
            raise ValueError(
                f"{fn}: the stacked group {name!r} is not a submodule of the merged module; "
                "`stacked=` must name the nnx.vmap-stacked module that `jaxsync.scan_layers` runs."
            )
        registry[id(node)] = view


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """What it takes to rebuild a module from params: static, no arrays.

    Attributes:
      graphdef: the module's ``nnx.GraphDef``.
      params: the ``nnx.Param`` state, with ``ShapeDtypeStruct`` leaves (a template).
      rest: the rest of the module's state (batch stats, RNG counters...), abstract.
    """

    graphdef: Any
    params: Any
    rest: Any

    def merge(self, params: PyTree, rest: PyTree, views: dict[str, Any] | None = None) -> Any:
        """The module with ``params`` (a pure dict) and ``rest`` (a pure dict).

        ``views``: per stacked group (dotted name), the view that :func:`scan_layers`
        hands to the layer loop instead of the group's params; the merged module
        holds ``ShapeDtypeStruct`` placeholders or the view's plain arrays there.
        """
        fn, fix = "jaxsync.train_step", STEP_FIX
        pst = _fill(self.params, params, fn, "params", fix)
        rst = _fill(self.rest, rest, fn, "model_state", fix)
        model = nnx.merge(self.graphdef, pst, rst)
        _register(model, views or {}, fn)
        return model


def merge_module(graphdef: Any, *states: Any, params: PyTree) -> Any:
    """``nnx.merge`` for the params jaxsync hands a loss function.

    The explicit path's merge for a flax NNX model: inside a loss function
    differentiated by :func:`jaxsync.value_and_grad` (``sync=`` with ``stacked=``),
    :func:`jaxsync.accumulate_grads` or ``FullyShard.value_and_grad``, each stacked
    group reaches the loss as jaxsync's view (a :class:`jaxsync.LayerStack`, or
    FSDP's sharded layers), which flax's ``nnx.replace_by_pure_dict`` cannot take.
    This puts the params in the module and hands each view to the
    :func:`jaxsync.scan_layers` call that runs that group, so its layers are tapped.
    Anywhere else it is ``replace_by_pure_dict`` then ``nnx.merge``, with the keys
    checked first.

    Args:
      graphdef: from ``nnx.split``.
      *states: the states from the same ``nnx.split`` (``nnx.State``; their values
        are only a template where ``params`` gives new ones; others, such as
        BatchNorm statistics, are kept).
      params: every ``nnx.Param`` of the module as a pure dict
        (``nnx.to_pure_dict``), or as the loss function received it.

    Returns:
      The module.

    Example:
      >>> graphdef, state = nnx.split(model, nnx.Param)
      >>> def loss_fn(params, batch):
      ...     model = jaxsync.merge_module(graphdef, state, params=params)
      ...     return jnp.mean((model(batch[0]) - batch[1]) ** 2)
    """
    fn = "jaxsync.merge_module"
    if (
        not isinstance(graphdef, nnx.GraphDef)
        or not states
        or not all(isinstance(s, nnx.State) for s in states)
    ):
        got = ", ".join(type(x).__name__ for x in (graphdef, *states))
        raise TypeError(
            f"{fn} takes `graphdef, *states` as `nnx.split` returns them (an nnx.GraphDef "
            f"and one or more nnx.State) and `params=`; got ({got})."
        )
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{fn}: `params` must be a nested dict (`nnx.to_pure_dict` of the nnx.Param state, "
            f"or the params the loss function received), got {type(params).__name__}."
        )
    flats = [dict(nnx.to_flat_state(s)) for s in states]
    wanted = {_dotted(p): v for flat in flats for p, v in flat.items() if isinstance(v, nnx.Param)}
    plain, views = {}, {}
    for path, leaf in _flat(params).items():
        name = _dotted(path)
        if not is_view(leaf):
            plain[path] = leaf
            continue
        views[name] = leaf
        if not leaf.holds_shards:
            sub = _flat(leaf.params) if isinstance(leaf.params, Mapping) else {(): leaf.params}
            plain.update({(*path, *p): x for p, x in sub.items()})
        else:  # FSDP's shards: placeholders, read only through scan_layers' tap
            under = {n: v for n, v in wanted.items() if n.startswith(name + ".")}
            if not under:  # the group is not in the module: named as unexpected below
                plain[path] = leaf
            for n, v in under.items():
                x = v.get_value() if hasattr(v, "get_value") else v.value
                plain[(*path, *n[len(name) + 1 :].split("."))] = jax.ShapeDtypeStruct(
                    x.shape, x.dtype
                )
    pure = _nest(plain)
    check_keys(sorted(wanted), pure, fn, "params", MERGE_FIX)
    filled = []
    by_name = {_dotted(p): x for p, x in _flat(pure).items()}
    for st, flat in zip(states, flats, strict=True):
        mine = {p: by_name[_dotted(p)] for p, v in flat.items() if isinstance(v, nnx.Param)}
        st = jax.tree.map(lambda v: v, st)
        if mine:
            nnx.replace_by_pure_dict(st, _nest(mine))
        filled.append(st)
    model = nnx.merge(graphdef, *filled)
    _register(model, views, fn)
    return model


def _submodule(model: Any, name: str) -> Any:
    node = model
    for part in name.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def is_module(x: Any) -> bool:
    return isinstance(x, nnx.Module)


def is_graphdef(x: Any) -> bool:
    return isinstance(x, nnx.GraphDef)


def merge_split(graphdef: Any, states: tuple[Any, ...]) -> Any:
    """The module from ``nnx.split``'s ``graphdef, *states``, or a clear error."""
    if not isinstance(graphdef, nnx.GraphDef) or not states:
        raise TypeError(
            "TrainStep.init takes a pytree of params, an nnx.Module, or `graphdef, *states` "
            f"as nnx.split returns them; got {type(graphdef).__name__} and {len(states)} "
            "more argument(s)."
        )
    return nnx.merge(graphdef, *states)


def split_model(model: Any) -> tuple[ModelDef, PyTree, PyTree]:
    """``(ModelDef, params as a pure dict, the rest of the state as a pure dict)``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return (
        ModelDef(graphdef, _abstract(params), _abstract(rest)),
        nnx.to_pure_dict(params),
        nnx.to_pure_dict(rest),
    )


def scan_layers(
    layers: nnx.Module,
    fn: Callable[[nnx.Module, Any], Any],
    carry: Any,
    *,
    remat: bool = True,
) -> Any:
    """Runs ``carry = fn(layer, carry)`` over the layers of an ``nnx.vmap``-stacked module.

    The layer loop of a scanned NNX model, written once: ``lax.scan`` over the
    stacked module's state, :func:`jaxsync.tap` on each layer's params (so that
    under :func:`jaxsync.train_step` with ``stacked=`` each layer's gradient is
    reduced inside the backward loop, and FSDP gathers one layer at a time), and
    the layer merged back into a module for ``fn``. Outside a jaxsync step the
    tap is the identity, so the same model trains, evaluates and runs on one
    device unchanged.

    Args:
      layers: a module whose ``nnx.Param`` leaves have a leading layer axis
        (built under ``nnx.vmap``).
      fn: ``fn(layer_module, carry) -> carry``.
      carry: the loop carry (activations).
      remat: run the body under ``jax.checkpoint`` (each layer recomputed in the
        backward; FSDP then gathers the layer again instead of keeping it).

    Example:
      >>> def __call__(self, x):
      ...     return jaxsync.scan_layers(self.blocks, lambda block, x: block(x), x)
    """
    if not isinstance(layers, nnx.Module):
        raise TypeError(
            f"jaxsync.scan_layers: `layers` must be an nnx.Module whose params are stacked on a "
            f"leading layer axis (built under nnx.vmap), got {type(layers).__name__}."
        )
    where = "jaxsync.scan_layers"
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    view = (TRACE_VIEWS.get() or {}).get(id(layers))
    xs = view if view is not None else nnx.to_pure_dict(params)
    rest_xs = nnx.to_pure_dict(rest)
    ptemplate = _abstract(params)
    rtemplate = _abstract(rest)

    def body(c: Any, x: tuple[Any, Any]) -> tuple[Any, Any]:
        layer_params, layer_rest = x
        layer_params = tap(layer_params)  # identity unless jaxsync syncs in the loop
        pst = _fill(ptemplate, layer_params, where, "params", SCAN_FIX)
        rst = _fill(rtemplate, layer_rest, where, "layer state", SCAN_FIX)
        layer = nnx.merge(graphdef, pst, rst)
        c = fn(layer, c)
        # The layer's own state after the call (RNG counters...), written back below.
        return c, nnx.to_pure_dict(nnx.split(layer, nnx.Param, ...)[2])

    if remat:
        body = jax.checkpoint(body)
    carry, new_rest = jax.lax.scan(body, carry, (xs, rest_xs))
    if jax.tree.leaves(new_rest):
        nnx.update(layers, _fill(rest, new_rest, where, "layer state", SCAN_FIX))
    return carry

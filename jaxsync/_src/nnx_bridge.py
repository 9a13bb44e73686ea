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

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from .scan_sync import tap

PyTree = Any

# The stacked-layer views of the module being merged inside a step, by the id of
# the submodule that holds the group. Set only while the user's loss function is
# traced (a context, like a trace-time argument), never between steps.
_VIEWS: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "jaxsync_views", default=None
)


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


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
        pst = jax.tree.map(lambda x: x, self.params)
        nnx.replace_by_pure_dict(pst, params)
        rst = jax.tree.map(lambda x: x, self.rest)
        nnx.replace_by_pure_dict(rst, rest)
        model = nnx.merge(self.graphdef, pst, rst)
        if views:
            registry = dict(_VIEWS.get() or {})
            for name, view in views.items():
                registry[id(_submodule(model, name))] = view
            _VIEWS.set(registry)
        return model


@contextlib.contextmanager
def trace_views() -> Iterator[None]:
    """Scopes the views registered by :meth:`ModelDef.merge` to one traced call."""
    token = _VIEWS.set({})
    try:
        yield
    finally:
        _VIEWS.reset(token)


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
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    view = (_VIEWS.get() or {}).get(id(layers))
    xs = view if view is not None else nnx.to_pure_dict(params)
    rest_xs = nnx.to_pure_dict(rest)
    ptemplate = _abstract(params)
    rtemplate = _abstract(rest)

    def body(c: Any, x: tuple[Any, Any]) -> tuple[Any, Any]:
        layer_params, layer_rest = x
        layer_params = tap(layer_params)  # identity unless jaxsync syncs in the loop
        pst = jax.tree.map(lambda v: v, ptemplate)
        nnx.replace_by_pure_dict(pst, layer_params)
        rst = jax.tree.map(lambda v: v, rtemplate)
        nnx.replace_by_pure_dict(rst, layer_rest)
        layer = nnx.merge(graphdef, pst, rst)
        c = fn(layer, c)
        # The layer's own state after the call (RNG counters...), written back below.
        return c, nnx.to_pure_dict(nnx.split(layer, nnx.Param, ...)[2])

    if remat:
        body = jax.checkpoint(body)
    carry, new_rest = jax.lax.scan(body, carry, (xs, rest_xs))
    if jax.tree.leaves(new_rest):
        nnx.replace_by_pure_dict(rest, new_rest)
        nnx.update(layers, rest)
    return carry

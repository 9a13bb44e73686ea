"""flax linen's scanned layers with in-loop gradient sync: ``nn.scan`` with a tap.

Under in-loop sync (:func:`jaxsync.train_step` with ``stacked=``) a stacked group
reaches the loss as jaxsync's view (a :class:`jaxsync.LayerStack`, FSDP's sharded
layers, a 2-D step's ``DimStack``), which only :func:`jaxsync.tap` turns into
params, one layer's slice at a time. A linen ``nn.scan`` slices the view like any
pytree (its leaves carry the layer axis first), but the Block's submodules then
read their params from the slice, untapped. :func:`linen_scan` is ``nn.scan`` of
the Block wrapped in ``nn.map_variables``, whose ``trans_in_fn`` taps every view
in the layer's ``params`` collection first thing in the scanned body, so each
layer's gradient is reduced (or, under FSDP, each layer gathered) inside the loop.

Around the scan, ``nn.map_variables`` would see the whole stack: a tap outside
the loop, which jaxsync refuses (the stack's shapes are not one layer's). And
``trans_in_fn=jaxsync.tap`` inside it receives the layer's *collections*
(``{"params": view}``), a dict, which ``tap`` returns as it is.

``nn.scan`` traces its body once more, outside the loop, to check its broadcast
values (``check_constancy_invariants``); that trace leaves an empty shell of the
tap (no operands, no results) in the loss's jaxpr, which the tap rules do not
count (:mod:`jaxsync._src.sync.tap_rules`), so microbatches work with the default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax.core.scope import in_filter

from ...sync.views import is_view, tap

PARAMS = "params"


def _tap_params(variables: Mapping[str, Any]) -> Mapping[str, Any]:
    """The layer's collections with each view in ``params`` tapped (plain params as they are)."""
    params = variables.get(PARAMS)
    if params is None or not any(is_view(x) for x in jax.tree.leaves(params, is_leaf=is_view)):
        return variables
    return {**variables, PARAMS: jax.tree.map(tap, params, is_leaf=is_view)}


def _params_axis(variable_axes: Mapping[Any, Any]) -> Any:
    for cols, axis in variable_axes.items():
        if in_filter(cols, PARAMS):
            return axis
    return None


def linen_scan(
    target: type[nn.Module],
    *,
    length: int | None = None,
    variable_axes: Mapping[Any, Any] | None = None,
    split_rngs: Mapping[Any, bool] | None = None,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    methods: Any = None,
    **scan_kwargs: Any,
) -> type[nn.Module]:
    """``nn.scan`` of a linen Block whose layers jaxsync syncs inside the loop.

    Use it where a linen model stacks its layers with ``nn.scan``: the returned
    class is built and called as ``nn.scan``'s is, and its params are
    ``nn.scan``'s (each leaf ``[length, ...]`` under the module's name), so
    ``model.init`` and ``model.apply`` are unchanged. Under
    :func:`jaxsync.train_step` with ``stacked=`` naming the module (or a subtree
    of it), each scanned iteration first passes the layer's params through
    :func:`jaxsync.tap`: the layer's gradient is reduce-scattered (ZeRO) or
    all-reduced (DDP) inside the backward loop, and FSDP gathers one layer at a
    time; microbatches accumulate exactly. Anywhere else the tap is the identity,
    so the numbers are those of plain ``nn.scan``.

    Args:
      target: the linen Module class of one layer; its ``__call__`` is
        ``(carry, x) -> (carry, y)``, as ``nn.scan`` wants it.
      length: the number of layers (``nn.scan``'s ``length``).
      variable_axes: as ``nn.scan``'s; default ``{"params": 0}``. The params must
        be stacked on axis 0 (jaxsync's stacked groups are ``[L, ...]``).
      split_rngs: as ``nn.scan``'s; default ``{"params": True}`` (each layer
        initialized from its own key).
      remat: run each layer under ``nn.remat``, the tap inside it (FSDP then
        gathers the layer again in the backward instead of keeping it).
      remat_policy: ``nn.remat``'s ``policy`` (with ``remat=True``).
      methods: as ``nn.scan``'s (the methods that are scanned; default
        ``__call__``).
      **scan_kwargs: passed to ``nn.scan`` (``in_axes``, ``out_axes``, ``unroll``,
        ``variable_broadcast``, ``metadata_params``...).

    Returns:
      A linen Module class, the scanned stack.

    Example:
      >>> class Model(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         Blocks = jaxsync.linen_scan(Block, length=4)  # was nn.scan(Block, ...)
      ...         x, _ = Blocks(name="blocks")(x, None)
      ...         return nn.Dense(1)(x)
      >>> step = jaxsync.train_step(loss_fn, tx, mesh, mode="zero", stacked="blocks")
    """
    if not (isinstance(target, type) and issubclass(target, nn.Module)):
        raise TypeError(
            "jaxsync.linen_scan: `target` must be a flax linen Module class (one layer, "
            f"`__call__(carry, x) -> (carry, y)`), got {target!r}. flax NNX: run the stacked "
            "module with `jaxsync.scan_layers`."
        )
    variable_axes = {PARAMS: 0} if variable_axes is None else dict(variable_axes)
    split_rngs = {PARAMS: True} if split_rngs is None else dict(split_rngs)
    axis = _params_axis(variable_axes)
    if axis != 0:
        raise ValueError(
            "jaxsync.linen_scan: the layers' params must be stacked on axis 0 "
            f"(`variable_axes={{'params': 0}}`), got {axis!r} for 'params' in "
            f"variable_axes={variable_axes!r}: jaxsync's stacked groups are `[L, ...]`."
        )
    # init=True: `model.init` creates the params as nn.scan would, then maps them
    # (the tap is the identity outside a step); mutable=False: the tapped params
    # are never written back.
    layer = nn.map_variables(
        target, PARAMS, trans_in_fn=_tap_params, init=True, mutable=False, methods=methods
    )
    if remat:
        layer = nn.remat(layer, prevent_cse=False, policy=remat_policy, methods=methods)
    return nn.scan(
        layer,
        variable_axes=variable_axes,
        split_rngs=split_rngs,
        length=length,
        methods=methods,
        **scan_kwargs,
    )

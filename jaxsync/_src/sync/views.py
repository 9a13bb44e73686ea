"""jaxsync's views of stacked-layer groups, as the model code meets them.

Under in-loop sync a stacked group reaches the loss as a view (a 1-D step's
:class:`~jaxsync.LayerStack`, FSDP's sharded layers, a 2-D step's ``DimStack``),
never as its params: :func:`tap` turns a layer's slice of it into the params. Kept
apart from the taps themselves, so that the rules that read taps from a jaxpr
(:mod:`tap_rules`) and the views share their messages without importing each other.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Any

from ..core.scoped import scoped

#: The name of every gathered layer (FSDP's, and ZeRO's gathered in the forward), so
#: a remat policy can keep them: ``save_only_these_names(GATHERED)``.
GATHERED = "jaxsync_gathered_layer"

#: Where the model frameworks' layer loops get their taps from jaxsync.
SCAN_HELPERS = (
    "flax linen: build the stack with `jaxsync.linen_scan(Block, length=L)` in place of "
    "`nn.scan(Block, ...)`; flax NNX: run it with `jaxsync.scan_layers`"
)
NOT_TAPPED = (
    "this is jaxsync's view of the stacked-layer group {group!r}, not its params: call "
    "`p = jaxsync.tap(p)` on the layer's slice first thing in the scanned layer body "
    "(it returns the layer's params and syncs their gradient inside the backward loop; "
    + SCAN_HELPERS
    + ")."
)


NEVER_TAPPED = (
    "the stacked-layer group(s) {groups} reached the loss function as jaxsync's view, but "
    "no scanned layer body passed its layer through `jaxsync.tap`, so their gradients would "
    "be lost. Call `p = jaxsync.tap(p)` on each layer's slice in the scanned body (flax "
    "NNX: run the stacked module with `jaxsync.scan_layers`; flax linen: build it with "
    "`jaxsync.linen_scan`), or drop them from `stacked=`."
)


HAND_MERGE = (
    "jaxsync: the stacked-layer group(s) {groups} reach the loss function as jaxsync's views "
    "({kind}), not as dicts of params, so a hand-written `nnx.replace_by_pure_dict` / "
    "`nnx.merge` cannot take them. Merge the module with "
    "`jaxsync.merge_module(graphdef, *states, params=params)`, which hands each view to "
    "`jaxsync.scan_layers`, or train with `jaxsync.train_step`, which merges for you."
)

# The stacked-layer views of modules merged while a loss function is traced, by the
# id of the submodule that holds the group (see jaxsync.merge_module). Set only for
# the duration of one traced call (a context, like a trace-time argument), so no
# view outlives its trace and no id is ever read for another object.
TRACE_VIEWS: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "jaxsync_views", default=None
)


def trace_views() -> contextlib.AbstractContextManager[None]:
    """Scopes the views that module merges register to one traced loss call."""
    return scoped(TRACE_VIEWS, {})


def call_with_views(
    fun: Callable[..., Any], groups: Sequence[str], kind: str
) -> Callable[..., Any]:
    """``fun`` run in a views scope; a flax pure-dict error gets a note on what to do.

    A loss that merges an NNX module by hand from params holding views fails inside
    flax (``key in pure_dict not available in state: ('blocks',)``); the note names
    the groups and the jaxsync call that merges them.
    """

    def scoped(*args: Any) -> Any:
        with trace_views():
            try:
                return fun(*args)
            except ValueError as e:
                if groups and "pure_dict" in str(e):
                    e.add_note(HAND_MERGE.format(groups=sorted(groups), kind=kind))
                raise

    return scoped


def tap(layer: Any) -> Any:
    """Returns a scanned layer's params; its gradient is synced in the backward loop.

    Call it on the layer's slice at the top of the scanned layer body. Under
    :func:`jaxsync.value_and_grad` with ``sync=`` (or ``FullyShard.value_and_grad``),
    the layer's gradient is reduced (reduce-scattered for the distributed
    optimizer, all-reduced for :class:`DataParallel`; for FSDP the layer's shard
    is also all-gathered here) inside the iteration of the backward scan that
    computes it. Anywhere else (plain ``jax.grad``, evaluation) it returns
    ``layer`` unchanged, so the same model code runs everywhere.

    Rules (checked when the step is traced, see :mod:`jaxsync._src.sync.tap_rules`):
    every stacked group is tapped; the tap is not inside a ``lax.cond``/
    ``lax.switch`` branch whose predicate depends on the data (its collective
    would run on some devices only and deadlock: tap first, outside the branch,
    and pass the tapped params into the branches; FSDP, whose forward gather
    is a collective too, is checked the same way);
    with microbatches each layer is tapped once per step (one tap per scanned
    body, one scan over the stack, not nested in another loop).

    flax models need not call it: :func:`jaxsync.scan_layers` (NNX) and
    :func:`jaxsync.linen_scan` (linen, in place of ``nn.scan``) tap each layer.

    Example:
      >>> def body(x, p):
      ...     p = jaxsync.tap(p)
      ...     return block(p, x), None
      >>> x, _ = jax.lax.scan(body, x, params["blocks"])
    """
    # Every jaxsync view of a stacked group (LayerStack here, FSDP's ShardedLayers,
    # a 2-D step's DimStack) taps itself; anything else is the layer's own params.
    own = getattr(type(layer), "jaxsync_tap", None)
    return layer if own is None else own(layer)


def is_view(x: Any) -> bool:
    """jaxsync's stand-in for a stacked group (LayerStack, FSDP's sharded layers, a
    2-D step's DimStack): each taps itself. The type is asked, not the view, whose
    ``__getattr__`` refuses every name to catch a model reading it untapped."""
    return hasattr(type(x), "jaxsync_tap")

"""Where :func:`jaxsync.tap` may sit, read from the traced loss (its jaxpr).

A tap is an identity whose backward reduces its layer's gradient over the
data axes. Some placements go wrong, and the old check that looked at Python side
effects during tracing could not see them reliably (JAX reuses the jaxpr of a
scan body it traced before, so a second step with the same body never runs
``tap`` in Python). So the check reads the jaxpr of the loss instead, which
holds every tap whatever was cached:

- a group that is never tapped would lose its gradients;
- with microbatches, the earlier microbatches' gradients ride on the taps, so
  each layer must be tapped exactly once per step: more than one tap per layer
  (a body tapping twice, two scans over the same stack, a scan nested in
  another loop, or several taps outside any scan, where the trace cannot tell
  layers apart) is refused. Without microbatches any number of taps is exact:
  the reduction is linear.
- a tap inside a ``lax.cond``/``switch`` branch whose predicate differs between
  devices puts a collective where only some devices go: a deadlock. FSDP's unit
  gathers are checked the same way (:func:`check_no_gather_under_cond`).

A tap with no operands and no results is not counted: partial evaluation leaves
such an empty shell of a custom_vjp call behind in the enclosing trace (flax
linen's ``nn.scan`` traces its body once more outside the loop, to check that its
broadcast values are loop invariants); no value goes in or out, so no gradient
rides on it.

A tap of a whole stack, outside its loop, is refused by the tap itself (the
stack's shapes are not one layer's), with :data:`WHOLE_STACK`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend import core as jcore

from .views import NEVER_TAPPED, SCAN_HELPERS

#: The name every tap's custom_vjp carries in a jaxpr, per stacked group.
TAP_NAME = "jaxsync_tap[{group}]"

NOT_SCANNED = (
    "the stacked-layer group {group!r} is tapped {count} times outside any `lax.scan` (its "
    "layers run one by one in Python), with microbatches: jaxsync cannot tell from the "
    "trace whether each tap is another layer, and a layer tapped twice would add the "
    "earlier microbatches' gradients twice. Run the stack with `lax.scan` over the "
    "stacked params with `jaxsync.tap` first in the scanned body (" + SCAN_HELPERS + "), "
    "or drop the group from `stacked=` (its gradients are then synced after the backward "
    "pass), or use microbatches=1."
)
#: NOT_SCANNED's case of one tap: the whole stack tapped once, outside the layer loop
#: (``nn.map_variables(..., trans_in_fn=...)`` around a linen ``nn.scan``). The tap
#: itself raises it, whatever the microbatches: no tap can take a whole stack.
WHOLE_STACK = (
    "`jaxsync.tap` got the whole stacked-layer group {group!r} ({what}), tapped once "
    "outside the layer loop (as `nn.map_variables` around a linen `nn.scan` does): a tap "
    "takes one layer's slice, first thing in the scanned layer body, where the layer's "
    "gradient is synced as the backward loop computes it. " + SCAN_HELPERS + "; plain JAX: "
    "`p = jaxsync.tap(p)` first in the body that `lax.scan` runs over the stacked params."
)
NESTED = (
    "`jaxsync.tap` of the stacked-layer group {group!r} sits in a scan nested inside "
    "another loop ({depth} loops deep), so each layer would be tapped once per outer "
    "iteration{why}. Scan the stack in one `lax.scan` at the loss's top level (an inner "
    "loop may run inside the layer body, after the tap), or drop the group from `stacked=`."
)
TWICE = (
    "the stacked-layer group {group!r} is tapped {count} times per step (a scanned body "
    "calling `jaxsync.tap` more than once on its layer, several scans over the same "
    "stack, or an inner loop), with microbatches: each tap would add the earlier "
    "microbatches' accumulated gradients again, and the update would be off by whole "
    "microbatches. Tap each layer once per step (tap once and reuse the returned "
    "params; for weights shared between two scans, scan once over both uses), or use "
    "microbatches=1, or mode='fsdp', which accumulates exactly for any number of taps."
)
UNDER_COND = (
    "`jaxsync.tap` of the stacked-layer group {group!r} sits inside a `lax.cond`/"
    "`lax.switch` branch whose predicate differs between devices (it varies over "
    "{axes}): the tap's collective would run on some devices and not on others, which "
    "deadlocks. Call `p = jaxsync.tap(p)` first in the scanned body, outside the "
    "branch, and pass the tapped params into both branches (or use `jnp.where`)."
)


@dataclasses.dataclass
class TapUse:
    """How one group is tapped in a traced loss."""

    count: int = 0  # taps per step (loops count once, cond branches: the most)
    outside: bool = False  # a tap outside any loop
    depth: int = 0  # the deepest loop nesting of a tap


def subjaxprs(eqn: Any) -> Iterator[Any]:
    """The programs ``eqn`` calls (a scan's body, a remat's, a branch's...)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jcore.Jaxpr):
                yield v


def _varying(aval: Any) -> frozenset[str]:
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def custom_name(eqn: Any) -> str:
    """The function name of a ``custom_vjp`` call equation ("" for anything else)."""
    if eqn.primitive.name != "custom_vjp_call":
        return ""
    call = eqn.params.get("call_jaxpr")
    info = getattr(getattr(call, "jaxpr", call), "debug_info", None)
    return str(getattr(info, "func_name", ""))


def tap_group(eqn: Any) -> str | None:
    """The stacked group a jaxpr equation taps, or None (not a tap, or an empty shell)."""
    name = custom_name(eqn)
    if not name or not (eqn.invars or eqn.outvars):  # no name, or an empty shell
        return None
    prefix = TAP_NAME.split("{", 1)[0]
    return name[len(prefix) : -1] if name.startswith(prefix) and name.endswith("]") else None


def _walk(jaxpr: Any, axes: Sequence[str], loops: int) -> dict[str, TapUse]:
    uses: dict[str, TapUse] = {}

    def add(group: str, use: TapUse) -> None:
        mine = uses.setdefault(group, TapUse())
        mine.count += use.count
        mine.outside |= use.outside
        mine.depth = max(mine.depth, use.depth)

    for eqn in jaxpr.eqns:
        group = tap_group(eqn)
        if group is not None:
            add(group, TapUse(1, loops == 0, loops))
            continue
        name = eqn.primitive.name
        if name == "cond":
            branches = [_walk(b.jaxpr, axes, loops) for b in eqn.params["branches"]]
            varying = sorted(_varying(eqn.invars[0].aval) & set(axes))
            for g in {g for b in branches for g in b}:
                if varying:
                    raise ValueError(UNDER_COND.format(group=g, axes=varying))
                per = [b[g] for b in branches if g in b]
                best = max(per, key=lambda u: u.count)
                add(g, TapUse(best.count, any(u.outside for u in per), max(u.depth for u in per)))
            continue
        inner = loops + 1 if name in ("scan", "while") else loops
        for sub in subjaxprs(eqn):
            for g, use in _walk(sub, axes, inner).items():
                add(g, use)
    return uses


def check_taps(jaxpr: Any, groups: Sequence[str], axes: Sequence[str], accumulating: bool) -> None:
    """Raises for a placement of taps that would deadlock, lose or miscount gradients.

    Args:
      jaxpr: the traced loss (``jax.make_jaxpr``), stacked groups passed as views.
      groups: the stacked groups that must be tapped.
      axes: the data axes (a branch predicate varying over them deadlocks).
      accumulating: earlier microbatches' gradients ride on the taps.
    """

    uses = _walk(jaxpr, tuple(axes), 0)
    missed = sorted(g for g in groups if g not in uses)
    if missed:
        raise ValueError(NEVER_TAPPED.format(groups=missed))
    for g in groups:
        use = uses[g]
        if not accumulating:
            continue  # the reduction is linear: any number of taps sums exactly
        if use.outside and use.count > 1:
            raise ValueError(NOT_SCANNED.format(group=g, count=use.count))
        if use.depth > 1:
            why = " and add the earlier microbatches' gradients that many times"
            raise ValueError(NESTED.format(group=g, depth=use.depth, why=why))
        if use.count > 1:
            raise ValueError(TWICE.format(group=g, count=use.count))


FSDP_GATHER = "gather_pieces"  # fsdp.gather.gather_pieces's custom_vjp

GATHER_UNDER_COND = (
    "FSDP gathers a unit inside a `lax.cond`/`lax.switch` branch whose predicate differs "
    "between devices (it varies over {axes}): the all-gather would run on some devices "
    "and not on others, which deadlocks. Read the unit's params (FSDP: `jaxsync.tap` "
    "for a stacked layer, `fs.view(shards)[...]` otherwise) outside the branch and pass "
    "them into both branches (or use `jnp.where`)."
)


def _gathers(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if custom_name(eqn) == FSDP_GATHER and (eqn.invars or eqn.outvars):
            return True
        if any(_gathers(sub) for sub in subjaxprs(eqn)):
            return True
    return False


def check_no_gather_under_cond(jaxpr: Any, axes: Sequence[str]) -> None:
    """FSDP: no unit gather inside a branch whose predicate varies over ``axes``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            varying = sorted(_varying(eqn.invars[0].aval) & set(axes))
            if varying and any(_gathers(b.jaxpr) for b in eqn.params["branches"]):
                raise ValueError(GATHER_UNDER_COND.format(axes=varying))
        for sub in subjaxprs(eqn):
            check_no_gather_under_cond(sub, axes)

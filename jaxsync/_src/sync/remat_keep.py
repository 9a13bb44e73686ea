"""ZeRO can keep each layer it gathered in the forward for the backward, whatever the remat.

A 1-D ``"zero"`` step gathers its stacked layers in the forward (see
:mod:`jaxsync._src.step.held`). A scanned layer body is usually rematerialised
(``jax.checkpoint``), and its policy rarely saves the gathered params, so the
backward gathers each layer again: ``jaxsync.ZeRO()``'s default, as FSDP's. With
``reshard_after_forward=False`` every ``jax.checkpoint`` around a held group's tap
saves the tap's output too (``GATHERED``, added to its policy), so the step gathers
each layer once and holds the gathered params from the forward to the backward: the
memory of the params whole, as Megatron-Core's param buffer. It was the default
while the backward's gathers ran exposed (1.1B on 8 x H100 152.4 -> 148.7 ms on XLA's
timeline, 7.2B on 64 x H100 500.8 -> 425.6 ms); since the gradient program lets XLA
issue them a layer ahead (:mod:`jaxsync._src.program.loop_remat`), keeping saves no
time. FSDP's ``reshard_after_forward=False`` keeps its gathered units the same way
(:func:`keep_fsdp_gathered`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import jax
from jax.extend import core as jcore

from ..core.jaxpr_compat import REMAT, rewrite_programs
from .tap_rules import FSDP_GATHER, custom_name, tap_group
from .views import GATHERED


def keep_gathered(closed: Any, groups: Collection[str]) -> Any:
    """``closed`` (a traced loss) with ``GATHERED`` saved by every remat around a tap
    of ``groups``."""
    held = frozenset(groups)
    return keep_around(closed, lambda eqn: tap_group(eqn) in held)


def keep_fsdp_gathered(closed: Any) -> Any:
    """The same for FSDP's gathers (``FullyShard(reshard_after_forward=False)``):
    every remat around a unit's gather keeps the gathered params."""
    return keep_around(closed, lambda eqn: custom_name(eqn) == FSDP_GATHER)


def keep_around(closed: Any, gathers: Callable[[Any], bool]) -> Any:
    """``closed`` with ``GATHERED`` added to the policy of every remat whose body
    holds an equation ``gathers`` picks (those equations are not entered)."""
    jaxpr, found = _keep(closed.jaxpr, gathers)
    return jcore.ClosedJaxpr(jaxpr, closed.consts) if found else closed


def _keep(jaxpr: Any, gathers: Callable[[Any], bool]) -> tuple[Any, bool]:
    eqns, found = [], False
    for eqn in jaxpr.eqns:
        if gathers(eqn):
            eqns.append(eqn)
            found = True
            continue
        params, inner = rewrite_programs(eqn, lambda j: _keep(j, gathers))
        if inner and eqn.primitive.name in REMAT:
            params["policy"] = keeping(params.get("policy"))
        eqns.append(eqn.replace(params=params) if inner else eqn)
        found |= inner
    return (jaxpr.replace(eqns=eqns) if found else jaxpr), found


def keeping(policy: Any) -> Any:
    """``policy`` that also saves the gathered layers (None: save nothing else)."""
    keep = jax.checkpoint_policies.save_only_these_names(GATHERED)
    return keep if policy is None else jax.checkpoint_policies.save_from_both_policies(policy, keep)

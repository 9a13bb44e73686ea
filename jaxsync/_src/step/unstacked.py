"""Saying when a step runs a stack of layers it was not told about.

A model written the way large JAX models are, its layers stacked ``[L, ...]`` and run
by ``lax.scan``, trains correctly without ``stacked=``, but the step then reduces the
stack's gradient after the backward loop (nothing is left for the collectives to
overlap) and ZeRO and FSDP gather and hold the whole stack at once. On 8 x H100
(``benchmarks/bench_gpu.py``'s Llama-style 1.1B, compile-only) that is 21297 / 9925 /
8988 MiB per GPU for DDP / ZeRO / FSDP against 17203 / 5783 / 5704 with
``stacked="blocks"``. The step reads its traced loss once per compile
(:func:`scanned_inputs`) and warns with the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from ..core.jaxpr_compat import scan_num_carry, scan_num_consts
from ..core.names import in_group, param_name
from ..fsdp.grad import split_microbatches
from ..program.sink import RETYPES
from ..sync.views import SCAN_HELPERS
from .modes import deterministic_of
from .parts import Plan, loss_of

UNSTACKED = (
    "jaxsync.train_step: {what} run through `lax.scan` as a stack of {layers} layers, but "
    "`stacked=` does not name {them}, so their gradients are reduced after the backward "
    "loop, where no compute is left to overlap the collectives, and ZeRO and FSDP gather "
    "and hold the whole stack at once. Pass `stacked={groups!r}` and call "
    "`p = jaxsync.tap(p)` on the layer's slice first in the scanned body ({helpers}). If "
    "the scan is not a loop over layers, silence jaxsync.UnstackedScanWarning."
)


class UnstackedScanWarning(UserWarning):
    """A step's loss scans over a stack of params that ``stacked=`` does not name."""


def warn_unstacked(cfg: Any, plan: Plan, state: Any, batch: Any) -> None:
    """Warn (at trace time) if the loss scans over params that ``cfg.stacked`` does not
    name; reads one piece of the batch (a microbatch) through the loss once more."""
    if cfg.stacked or deterministic_of(cfg.mode) is not None:  # that mode refuses `stacked`
        return
    loss = loss_of(cfg, plan, state, batch)
    piece = batch
    if cfg.microbatches > 1:
        piece = jax.tree.map(lambda x: x[0], split_microbatches(cfg.microbatches, batch))
    template = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), plan.template)
    closed = jax.make_jaxpr(lambda p: loss(p, piece))(template)
    found = scanned_inputs(closed)
    if not found:
        return
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
    groups = stack_groups(names, set(found))
    if not groups:
        return
    layers = sorted({found[i] for i in found})
    what = (
        f"the params under {groups[0]!r} are"
        if len(groups) == 1
        else f"the params under {', '.join(repr(g) for g in groups)} are"
    )
    warnings.warn(
        UNSTACKED.format(
            what=what,
            layers=" / ".join(str(n) for n in layers),
            them="it" if len(groups) == 1 else "them",
            groups=groups[0] if len(groups) == 1 else groups,
            helpers=SCAN_HELPERS,
        ),
        UnstackedScanWarning,
        stacklevel=2,
    )


def stack_groups(names: Sequence[str], scanned: set[int]) -> list[str]:
    """The shortest dotted prefixes whose every param is scanned: the groups to name in
    ``stacked=`` (a prefix that also holds an unscanned param is no group)."""
    groups: list[str] = []
    for i in sorted(scanned):
        parts = names[i].split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            members = [j for j, n in enumerate(names) if in_group(n, prefix)]
            if all(j in scanned for j in members):
                if prefix not in groups and not any(in_group(prefix, g) for g in groups):
                    groups.append(prefix)
                break
    return groups


#: Equations that call a program on their operands as they are (the program's inputs
#: bind the operands in order): jits, remats, custom derivatives.
_CALLS = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
    }
)


def scanned_inputs(closed: Any) -> dict[int, int]:
    """``{input index: scan length}`` for each input of ``closed`` (a ``ClosedJaxpr``)
    that a ``lax.scan`` takes as a per-iteration operand (``xs``), as it is or only
    converted: scans at the program's top level or inside the jits, remats and custom
    derivatives it calls, not inside another loop or a branch."""
    found: dict[int, int] = {}
    _walk(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars)}, found)
    return found


def _walk(jaxpr: Any, origin: dict[Any, int], found: dict[int, int]) -> None:
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name == "scan":
            length = int(e.params.get("length", 0))
            for v in e.invars[scan_num_consts(e) + scan_num_carry(e) :]:
                if _known(v, origin):
                    found[origin[v]] = length
        elif name in RETYPES and len(e.invars) == 1 and _known(e.invars[0], origin):
            # a stack cast to the compute dtype before the scan is still the stack
            origin[e.outvars[0]] = origin[e.invars[0]]
        elif name in _CALLS:
            inner = _callee(e)
            if inner is None or len(inner.invars) != len(e.invars):
                continue
            pairs = zip(inner.invars, e.invars, strict=True)
            sub = {b: origin[v] for b, v in pairs if _known(v, origin)}
            if sub:
                _walk(inner, sub, found)


def _known(v: Any, origin: dict[Any, int]) -> bool:
    return isinstance(v, jcore.Var) and v in origin


def _callee(e: Any) -> Any:
    """The open jaxpr a call-like equation runs on its operands, or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = e.params.get(key)
        if isinstance(inner, jcore.ClosedJaxpr):
            return inner.jaxpr
        if isinstance(inner, jcore.Jaxpr):
            return inner
    return None

"""The pricing twin: the same program, with every loop body made schedulable.

XLA's latency-hiding scheduler only orders (and so only prices) computations that
hold something asynchronous. A forward layer loop with no collective in it, or a
whole one-GPU program, is left unscheduled, and a reader would have to price it
some other way. The twin is a copy of the lowered module in which the body of
every ``while`` and the entry function also run a *probe*: a scalar all-reduce of
the partition ids, kept alive by an outfeed (a side effect XLA may not delete).
The probe reads and writes nothing the program uses, so XLA compiles the same
kernels, and the scheduler now prices every one of them with its own cost model.
The reader then drops the probe's own instructions (they carry :data:`PROBE` in
their ``op_name``) and its collective's waits.

Where the probe cannot be placed (a loop inside a region that is manual over
some mesh axes only) the loop is left as it was; the report says how much of the
step was priced without XLA.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from jax._src.lib.mlir import ir

PROBE = "jaxsync_pricing_probe"
_AXES = re.compile(r'"(\w+)"\s*=\s*(\d+)')


def pricing_twin(lowered: Any) -> tuple[Any, int, int] | None:
    """A copy of ``lowered`` with a probe in every loop body and the entry function.

    Returns ``(twin, probed, skipped)``: the twin (a ``jax.stages.Lowered``), and
    how many loops got a probe and how many could not; ``None`` where the program
    runs on one device (a probe needs two) or the lowering is not a mesh program.
    """
    computation = getattr(lowered, "_lowering", None)
    module = getattr(computation, "_hlo", None)
    if module is None:
        return None
    with module.context, ir.Location.unknown():
        twin_module = ir.Module.parse(module.operation.get_asm(enable_debug_info=True))
        mesh = _mesh(twin_module)
        if mesh is None:
            return None
        mesh_op, axes, size = mesh
        probes = ir.Module.parse(_probe_source(mesh_op, axes, size))  # kept alive while cloned
        for func in _funcs(probes).values():
            twin_module.body.append(func.operation.clone())
        funcs = _funcs(twin_module)
        counts = {"probed": 0, "skipped": 0}
        seen: set[tuple[str, str]] = set()
        _visit(funcs["main"], "auto", set(axes), funcs, seen, counts)
        _call_probe(_terminator(funcs["main"].operation.regions[0].blocks[0]), "auto")
        twin_module.operation.verify()
    twin_computation = copy.copy(computation)
    twin_computation._hlo = twin_module
    twin_computation._executable = None
    twin = copy.copy(lowered)
    twin._lowering = twin_computation
    return twin, counts["probed"], counts["skipped"]


def _mesh(module: Any) -> tuple[Any, list[str], int] | None:
    meshes = [op for op in module.body.operations if op.operation.name == "sdy.mesh"]
    if not meshes:
        return None
    axes = _AXES.findall(str(meshes[0]))
    size = 1
    for _, n in axes:
        size *= int(n)
    return (meshes[0], [a for a, _ in axes], size) if size > 1 else None


def _funcs(module: Any) -> dict[str, Any]:
    return {
        ir.StringAttr(op.operation.attributes["sym_name"]).value: op
        for op in module.body.operations
        if op.operation.name == "func.func"
    }


def _terminator(block: Any) -> Any:
    return list(block.operations)[-1]


def _call_probe(before: Any, context: str) -> None:
    with ir.InsertionPoint(before), ir.Location.name(PROBE):
        ir.Operation.create(
            "func.call", attributes={"callee": ir.FlatSymbolRefAttr.get(f"{PROBE}_{context}")}
        )


def _visit(op: Any, context: str, axes: set[str], funcs, seen, counts) -> None:
    """Probes every ``while`` body under ``op``; ``context`` says whether the code
    there is partitioned by XLA ("auto"), manual over every axis ("manual") or over
    some ("partial": no probe fits)."""
    for region in op.operation.regions:
        for block in region.blocks:
            for inner in list(block.operations):
                name = inner.operation.name
                here = context
                if name == "sdy.manual_computation":
                    manual = set(
                        re.findall(r'"(\w+)"', str(inner.operation.attributes["manual_axes"]))
                    )
                    here = "manual" if manual >= axes else ("partial" if manual else context)
                elif name == "stablehlo.while":
                    if here == "partial":
                        counts["skipped"] += 1
                    else:  # the condition runs once more than the body: probe both
                        for loop_region in inner.operation.regions:
                            _call_probe(_terminator(loop_region.blocks[0]), here)
                        counts["probed"] += 1
                elif name == "func.call":
                    callee = ir.FlatSymbolRefAttr(inner.operation.attributes["callee"]).value
                    if (
                        callee in funcs
                        and (callee, here) not in seen
                        and not callee.startswith(PROBE)
                    ):
                        seen.add((callee, here))
                        _visit(funcs[callee], here, axes, funcs, seen, counts)
                _visit(inner, here, axes, funcs, seen, counts)


def _probe_source(mesh_op: Any, axes: list[str], size: int) -> str:
    """Two private functions: the probe where XLA partitions the code (it opens a
    region manual over every axis, where partition ids mean something) and inside
    such a region."""
    loc = f'loc("{PROBE}")'
    groups = ", ".join(str(i) for i in range(size))
    names = ", ".join(f'"{a}"' for a in axes)
    body = f"""
      %p = stablehlo.partition_id : tensor<ui32> {loc}
      %q = stablehlo.convert %p : (tensor<ui32>) -> tensor<i32> {loc}
      %r = "stablehlo.all_reduce"(%q) <{{
          channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>,
          replica_groups = dense<[[{groups}]]> : tensor<1x{size}xi64>, use_global_device_ids}}> ({{
        ^bb0(%a: tensor<i32>, %b: tensor<i32>):
          %s = stablehlo.add %a, %b : tensor<i32>
          stablehlo.return %s : tensor<i32>
      }}) : (tensor<i32>) -> tensor<i32> {loc}
      %t = stablehlo.after_all : !stablehlo.token {loc}
      %o = "stablehlo.outfeed"(%r, %t)
          : (tensor<i32>, !stablehlo.token) -> !stablehlo.token {loc}"""
    mesh_name = ir.StringAttr(mesh_op.operation.attributes["sym_name"]).value
    return f"""module {{
  {mesh_op}
  func.func private @{PROBE}_manual() {{{body}
    return
  }}
  func.func private @{PROBE}_auto() {{
    %m = sdy.manual_computation() in_shardings=[] out_shardings=[<@{mesh_name}, []>]
        manual_axes={{{names}}} () {{{body}
      sdy.return %r : tensor<i32>
    }} : () -> tensor<i32> {loc}
    return
  }}
}}"""

"""XLA options a training step is compiled with, and why.

XLA's GPU pipeline can move a collective inside a loop into the neighbouring
iteration ("pipelined" reduce-scatter, on by default; all-gather, off) so it
overlaps that layer's compute. XLA's scheduler statistics credit the overlap only
when the loop is also double-buffered (unrolled twice: the moved collective then
starts and completes inside one body); its timeline credits it either way.

- 1-D steps are double-buffered; 1-D FSDP and ZeRO also pipeline their per-layer
  all-gathers (ZeRO gathers its stacked layers in the forward), 1-D FSDP keeps its
  units' reduce-scatters apart (:data:`REDUCE_SCATTER_COMBINE`) and combines a
  layer's all-gathers (:data:`ALL_GATHER_COMBINE`); DDP's in-loop reduce-scatters are
  pipelined by XLA's default (the figures are at :data:`DOUBLE_BUFFERING` and
  :func:`step_compiler_options`).
- 2-D steps (a layer loop that waits on the compiler's tensor-parallel
  collectives) keep the pipelined reduce-scatter off: it holds one more layer in
  flight and more kernel bytes for 1-2% of XLA's timeline. On 64 x H100 as data=8 x
  model=8 (bench_gpu's GPT, args + temps and timeline, off -> on): 1B ZeRO 1469 ->
  1501 MiB, 102.4 -> 101.1 ms; 1B FSDP 1272 -> 1408 MiB, 119.5 -> 117.5 ms; 6.7B ZeRO
  4760 -> 4824 MiB, 350.6 -> 345.1 ms, 158.3 -> 164.4 GB; 6.7B FSDP 3383 -> 3479 MiB,
  453.0 -> 447.8 ms, 146.1 -> 151.1 GB.

A choice made in ``XLA_FLAGS`` or passed to ``.compile(compiler_options=...)``
wins.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh

from ..core.xla_names import pipelined, set_by_user
from ..gpu.target import GPUS, gpu_kind

#: XLA unrolls a loop twice so that a collective it pipelines across iterations
#: starts and completes inside one unrolled body. For 1-D steps (1.1B and 7.2B
#: Llama-style models, bench_gpu, XLA defaults otherwise, statistics / timeline):
#: ZeRO on 8 x H100 165.75 / 153.81 -> 160.24 / 153.52 ms and temporaries 5793 ->
#: 4975 MiB; ZeRO on 64 x H100 683.5 / 508.9 -> 663.3 / 508.4 ms, 5986 -> 5541 MiB;
#: DDP unchanged to 0.2 ms. Not measured on 2-D steps, which keep XLA's default.
DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"

#: A DDP step whose state (replicated params and optimizer state) takes more than this
#: share of its GPU's memory, and whose backward loop writes a whole gradient stack (no
#: ``stacked`` groups: the user's scan under ``jax.grad``), is not double-buffered. XLA
#: rematerializes when its estimate of a program's peak, made before the scheduler runs,
#: passes 80% of the GPU's memory; the unrolled body's second iteration puts a large DDP
#: step there, and what it then recomputes is the backward loop's writes of the
#: gradients. Measured when the stacked groups' loop still all-reduced into the whole
#: reduced stack: Llama-3.2-3B's shape on 8 x H100 (state 50% of the GPU), 592.3 -> 549.1
#: GB of kernel traffic per step without the unrolling (the replicated step's 566.7),
#: memory and XLA's timeline the same to 0.1%. Below the line the unrolling saves
#: traffic: 1.1B Llama-style 402.2 -> 391.7 GB, 1.2B GPT 306.3 -> 299.2 (states 16% and
#: 13%). The same shape with fewer layers crossed it between 47.7% (26 layers: unrolled,
#: 491.3 GB, nothing recomputed) and 50%; the share is set below that for steps with more
#: activations per GPU, and between it and the line a step pays the unrolling's saving
#: (24 layers, 44.8%: 458.1 -> 479.0 GB, still under the replicated step's 493.4). The
#: stacked groups' loop now keeps 1/N of the reduced stack (``DataParallel.shard_grads``)
#: and stays unrolled at any share: the same shape at 28, 34 and 40 layers (50-67% of the
#: GPU) moves 551.3 / 657.4 / 763.4 GB not unrolled, 537.6 / 640.7 / 743.7 unrolled, the
#: memory the same to the MiB, nothing rematerialized at 28 and 34. A step without
#: ``stacked`` groups still needs the rule (measured again since): the same 3B shape (28
#: layers) moves 589.2 GB not unrolled and 608.7 unrolled (of which XLA rematerialized 3.7
#: and 39.0 GB), 67291 MiB and XLA's timeline (312.8 / 312.6 ms) either way.
DDP_TIGHT_SHARE = 0.4

#: XLA combines independent reduce-scatters up to this many bytes into one. FSDP's
#: units are its buckets, each reduced when its gradient is ready; combined, the
#: earlier one (the LM head's, right after the loss) waits for the later one (the
#: embedding's, after the whole backward loop) and its fp32 gradient stays live across
#: the loop. 1-D FSDP steps combine none (1 byte): on 64 x H100 the Llama-style 7.2B
#: step held 7617 -> 7444 MiB and bench_gpu's 6.7B GPT 7122 -> 6930 MiB, their XLA
#: timelines unchanged (500.0 -> 499.9, 463.0 -> 463.0 ms); 8 x H100 (1.1B Llama-style,
#: 1.2B GPT) unchanged in both. The other modes reduce their non-stacked params in
#: jaxsync's own buckets, which XLA has nothing to combine with (ZeRO: same memory and
#: timeline at 8 and 64).
REDUCE_SCATTER_COMBINE = "xla_gpu_reduce_scatter_combine_threshold_bytes"

#: XLA combines independent all-gathers up to this many bytes into one. 1-D FSDP
#: gathers a stacked layer param by param (each straight into its own array); the
#: step sets the threshold to its largest gathered layer so that one layer's gathers
#: combine into one, as its one all-gather of the whole row did. 64 x H100 (7.2B
#: Llama-style, XLA's timeline): 539.6 ms uncombined (XLA's default threshold) ->
#: 488.9 ms combined, 7025 -> 7054 MiB; on 8 x H100 (1.1B) 146.9 -> 151.5 ms, 6745 ->
#: 6775 MiB. Either way below the one-row gather's 499.9 / 152.9 ms and 7444 / 6811 MiB.
ALL_GATHER_COMBINE = "xla_gpu_all_gather_combine_threshold_bytes"


def state_share(state: Any, mesh: Mesh) -> float:
    """The share of one GPU's memory that ``state`` (arrays or ``ShapeDtypeStruct``s
    with shardings) takes on each device; 0 where the GPU's memory is not known (a CPU
    mesh, a GPU outside :data:`jaxsync.GPUS` that this process cannot ask)."""
    memory = _device_memory(mesh)
    if not memory:
        return 0.0
    held = 0
    for x in jax.tree.leaves(state):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            continue  # a Python number in the state
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        held += math.prod(shape) * x.dtype.itemsize
    return held / memory


def _device_memory(mesh: Mesh) -> int:
    """Bytes of memory of one of ``mesh``'s GPUs: what this process's GPU reports, a
    compile-only GPU's figure in :data:`jaxsync.GPUS`; 0 if neither (a CPU mesh)."""
    device = mesh.devices.flat[0]
    if device.platform != "gpu":
        return 0
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    try:
        return int(local[0].memory_stats()["bytes_limit"])
    except (RuntimeError, IndexError, KeyError, TypeError):  # compile-only: no stats
        kind = gpu_kind(mesh)
        return GPUS[kind].memory_bytes if kind is not None else 0


def step_compiler_options(
    mode: str,
    two_d: bool,
    layer_bytes: int = 0,
    devices: int = 2,
    state: float = 0.0,
    stacked: bool = False,
) -> dict[str, Any]:
    """The ``jax.jit(compiler_options=...)`` of a step (ignored off GPU); a flag the
    user set in ``XLA_FLAGS`` is left to them. ``layer_bytes``: FSDP's largest
    gathered layer (:data:`ALL_GATHER_COMBINE`). ``state``: the share of a GPU's
    memory the step's state takes (:func:`state_share`; :data:`DDP_TIGHT_SHARE`, which
    ``stacked``, a step syncing stacked groups in its loop, is exempt from).
    ``devices``: of a 1-D step's data axes; with one there is no collective for any
    option to serve, and the step keeps XLA's defaults, as a ``jax.jit`` step gets
    them. On one H200 (jax 0.11.2, Llama-style 1.1B, command buffers off) each mode's
    kernels summed to plain ``jax.jit``'s (215.8-216.1 ms) but its step ran 0.4-1.2%
    longer; the one structural difference was the double-buffered loops (each body
    twice).

    1-D FSDP and DDP, double-buffered, also pipeline their per-layer collectives
    into the neighbouring layer (1.1B Llama-style model, 8 x H100, statistics /
    timeline):

    - FSDP: 171.49 / 170.30 ms with the pipelined reduce-scatter off, 165.96 /
      158.92 with it, 163.10 / 152.81 with the pipelined all-gather too, for 4836 ->
      5298 MiB of temporaries;
    - DDP, when its loop all-reduced: 185.90 / 185.54 ms -> 175.63 / 165.69 with the
      pipelined all-reduce, 7095 -> 7838 MiB. Its loop now reduce-scatters
      (``DataParallel.shard_grads``), which XLA pipelines by default; the all-reduce
      option then changed nothing (the same compiled program, 161.72 ms, 17203 MiB), and
      is no longer set;
    - ZeRO, its stacked layers gathered in the forward and again in the backward
      (``reshard_after_forward=True``): 165.77 / 158.45 ms -> 165.27 / 152.36 with
      the pipelined all-gather (the forward's gathers overlap the previous layer).
    """
    wanted: dict[str, Any] = {}
    if not two_d and devices == 1:
        return wanted
    if two_d:
        wanted |= pipelined("reduce_scatter", False)
    else:
        wanted[DOUBLE_BUFFERING] = not (mode == "ddp" and not stacked and state > DDP_TIGHT_SHARE)
        if mode in ("fsdp", "zero"):
            wanted |= pipelined("all_gather", True)
        if mode in ("fsdp", "zero") and layer_bytes:
            wanted[ALL_GATHER_COMBINE] = layer_bytes
        if mode == "fsdp":
            wanted[REDUCE_SCATTER_COMBINE] = 1
    return {k: v for k, v in wanted.items() if not set_by_user(k)}

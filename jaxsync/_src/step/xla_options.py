"""XLA options a training step is compiled with, and why.

XLA's GPU pipeline moves a reduce-scatter inside a loop one iteration later
("pipelined reduce-scatter", on by default) so it can overlap the next layer's
compute. For the steps below that holds one more layer's activations and
gradients live in the loop's peeled iteration and buys no time in XLA's
modeled H100 schedule (bench_gpu, one run each):

- FSDP on 8 x H100 (1B GPT): 134.4 ms either way, temporaries 5402 -> 4222 MiB;
- a 2-D step (64 x H100 as data=8 x model=8, 1B GPT), whose layer loop waits on
  the compiler's tensor-parallel collectives: ZeRO 85.3 ms either way,
  temporaries 1232 -> 1035 MiB; FSDP 102.8 -> 102.7 ms, 1328 -> 1227 MiB.

At 6.7B on that 2-D mesh the time is again the same either way (ZeRO 322.8 vs
323.6 ms, FSDP 427.4 vs 428.4) and ZeRO still saves (2004 -> 1940 MiB), but FSDP
holds 129 MiB more without it (2500 -> 2629): not a rule for every model.

ZeRO on a 1-D mesh keeps it. With every kernel priced by XLA (the pricing twin),
the 1.1B Llama-style model on 8 x H100 reads 165.75 ms with it and 165.79 ms
without in the scheduler's statistics, which do not credit the pipelining, and
153.8 against 165.4 ms on its timeline, which does; it costs 5793 - 4269 MiB of
temporaries. A choice made in ``XLA_FLAGS`` or passed to
``.compile(compiler_options=...)`` wins.
"""

from __future__ import annotations

import os
from typing import Any

PIPELINED_REDUCE_SCATTER = "xla_gpu_enable_pipelined_reduce_scatter"
#: XLA unrolls a loop twice so that a collective it pipelines across iterations
#: starts and completes inside one unrolled body. For 1-D steps (1.1B and 7.2B
#: Llama-style models, bench_gpu, XLA defaults otherwise, statistics / timeline):
#: ZeRO on 8 x H100 165.75 / 153.81 -> 160.24 / 153.52 ms and temporaries 5793 ->
#: 4975 MiB; ZeRO on 64 x H100 683.5 / 508.9 -> 663.3 / 508.4 ms, 5986 -> 5541 MiB;
#: DDP, FSDP and FSDP keeping its layers unchanged to 0.2 ms. Not measured on 2-D
#: steps, which keep XLA's default.
DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"


def step_compiler_options(mode: str, two_d: bool) -> dict[str, Any]:
    """The ``jax.jit(compiler_options=...)`` of a step (ignored off GPU); a flag the
    user set in ``XLA_FLAGS`` is left to them."""
    user = os.environ.get("XLA_FLAGS", "")
    options: dict[str, Any] = {}
    if not two_d and DOUBLE_BUFFERING not in user:
        options[DOUBLE_BUFFERING] = True
    if (mode == "fsdp" or two_d) and PIPELINED_REDUCE_SCATTER not in user:
        options[PIPELINED_REDUCE_SCATTER] = False
    return options

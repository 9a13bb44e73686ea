"""Steps compiled for a compile-only 8 x H100 mesh: what XLA's GPU pipeline makes of them.

These run without a GPU: `jaxsync.gpu_topology` gives compile-only CUDA devices
(needs jax-cuda12-plugin, which `make test` installs on Linux x86-64), and
`jaxsync.schedule_report` reads the latency-hiding scheduler's model of the program.
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.gpu.textproto import parse

needs_plugin = pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin and jax-cuda12-pjrt of the installed "
    "jaxlib's version (Linux x86-64); `make test` installs them",
)
H100 = jaxsync.GPUS["h100"]


# ------------------------------------------------------------------- text proto
def test_textproto_reads_nested_repeated_and_escaped_fields():
    text = """
    name: "a \\"quoted\\" name"  # a comment
    count: 3
    ratio: 1.5
    kind: ENUM_VALUE
    child { id: 1 tag: "x" }
    child { id: 2 inner { deep: -4 } }
    """
    m = parse(text)
    assert m.one("name") == 'a "quoted" name'
    assert m.one("count") == 3 and m.one("ratio") == 1.5 and m.one("kind") == "ENUM_VALUE"
    assert [c.one("id") for c in m.all("child")] == [1, 2]
    assert m.all("child")[1].one("inner").one("deep") == -4
    assert m.all("missing") == [] and m.one("missing", 7) == 7
    with pytest.raises(ValueError, match="unbalanced"):
        parse("a { b: 1")


# --------------------------------------------------------------------- topology
@needs_plugin
def test_gpu_topology_builds_host_major_compile_only_meshes():
    mesh = jaxsync.gpu_topology("h100", hosts=2, gpus_per_host=4, axes={"data": 2, "model": 4})
    assert mesh.shape == {"data": 2, "model": 4}
    devices = mesh.devices
    assert {d.device_kind for d in devices.flat} == {H100.name}
    # the minor axis stays inside a host; the major one crosses hosts
    assert [d.process_index for d in devices[0]] == [0] * 4
    assert [d.process_index for d in devices[1]] == [1] * 4
    with pytest.raises(ValueError, match="must multiply to the device count 8"):
        jaxsync.gpu_topology("h100", hosts=2, gpus_per_host=4, axes={"data": 3})
    with pytest.raises(ValueError, match="`kind` must be one of"):
        jaxsync.gpu_topology("h1000")


def test_gpu_specs_write_the_target_config_fields_xla_reads():
    config = parse(H100.target_config()).one("gpu_device_info")
    assert config.one("core_count") == 132
    assert config.one("memory_bandwidth") == int(3.35e12)
    assert config.one("cuda_compute_capability").one("major") == 9
    for spec in jaxsync.GPUS.values():
        assert spec.source and spec.bf16_dense_tflops > 0


# ------------------------------------------------------------- schedule_report
M, K, N = 8192, 4096, 4096  # per device: a matmul of 2*M*K*N = 275 GFLOP


def _matmul_and_allreduce(mesh, dependent: bool):
    """One matmul and one all-reduce of 32 MiB: of the matmul's result (cannot
    overlap) or of an independent input (can)."""

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P(), P("data")),
             out_specs=(P("data"), P()))  # fmt: skip
    def f(x, w, v):
        y = x @ w
        s = jax.lax.psum(y[: v.shape[0]] if dependent else v, "data")
        return y, s

    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    args = (
        jax.ShapeDtypeStruct((8 * M, K), jnp.bfloat16, sharding=sh(P("data"))),
        jax.ShapeDtypeStruct((K, N), jnp.bfloat16, sharding=sh(P())),
        jax.ShapeDtypeStruct((8 * 4096, N), jnp.bfloat16, sharding=sh(P("data"))),
    )
    return jaxsync.schedule_report(jax.jit(f).lower(*args))


@needs_plugin
def test_schedule_report_prices_a_matmul_and_an_all_reduce_by_hand():
    mesh = jaxsync.gpu_topology("h100")
    dep = _matmul_and_allreduce(mesh, dependent=True)
    ind = _matmul_and_allreduce(mesh, dependent=False)
    matmul_roofline_us = 2 * M * K * N / (H100.bf16_dense_tflops * 1e12) * 1e6  # 278 us
    for r, v_bytes in ((dep, 0), (ind, 4096 * N * 2)):  # `dep` never reads `v`
        (ar,) = [c for c in r.collectives if c.kind == "all-reduce"]
        assert ar.bytes == 4096 * N * 2 and ar.runs == 1 and not ar.is_sync
        (mm,) = [h for h in r.hotspots if h.us > 100]  # the matmul, XLA's price
        assert 0.8 * matmul_roofline_us < mm.us < 2.0 * matmul_roofline_us
        assert r.roofline_us == 0.0  # the entry is the only computation
        assert r.step_us == pytest.approx(sum(c.own_us * c.runs for c in r.computations))
        assert r.memory["arguments"] == (M * K + K * N) * 2 + v_bytes
    (ar_dep,) = [c for c in dep.collectives if c.kind == "all-reduce"]
    (ar_ind,) = [c for c in ind.collectives if c.kind == "all-reduce"]
    # dependent: nothing to overlap with, the step is matmul + all-reduce
    assert ar_dep.overlap_ops == 0
    assert dep.exposed_us["all-reduce"] == pytest.approx(ar_dep.modeled_us, rel=0.05)
    assert dep.step_us >= matmul_roofline_us * 0.8 + ar_dep.modeled_us
    # The scheduler's timeline reads the same chain: matmul, then the all-reduce.
    assert dep.makespan_us >= matmul_roofline_us * 0.8 + ar_dep.modeled_us
    assert dep.makespan_us == pytest.approx(dep.step_us, rel=0.25)
    # independent: the matmul runs while the all-reduce is in flight
    assert ar_ind.overlap_ops >= 1 and ar_ind.overlap_us > 0.5 * ar_ind.modeled_us
    assert ind.exposed_us.get("all-reduce", 0.0) < 0.5 * dep.exposed_us["all-reduce"]
    assert ind.step_us < dep.step_us
    assert ind.makespan_us < dep.makespan_us


@needs_plugin
def test_schedule_report_multiplies_loop_bodies_by_their_trip_count():
    mesh = jaxsync.gpu_topology("h100")

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    def f(x, w):
        def body(_, h):
            return jnp.tanh(h @ w) + jax.lax.psum(h[:8], "data").sum()

        return jax.lax.fori_loop(0, 6, body, x)

    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    args = (
        jax.ShapeDtypeStruct((8 * 2048, 2048), jnp.bfloat16, sharding=sh(P("data"))),
        jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=sh(P())),
    )
    r = jaxsync.schedule_report(jax.jit(f).lower(*args))
    body = max(r.computations, key=lambda c: c.own_us * c.runs)
    assert body.runs in (5, 6)  # 6 iterations, one of which XLA may peel into the entry
    loop_ar = [c for c in r.collectives if c.computation == body.name]
    assert loop_ar and all(c.runs == body.runs for c in loop_ar)
    assert r.step_us == pytest.approx(sum(c.own_us * c.runs for c in r.computations))
    assert r.step_us > 5 * body.own_us
    assert r.makespan_us == pytest.approx(sum(c.span_us * c.runs for c in r.computations))
    assert r.makespan_us > 5 * body.span_us > 0


@needs_plugin
def test_schedule_report_prices_a_skipped_loop_by_the_calibrated_roofline():
    """A loop with nothing asynchronous in it is not scheduled (nor dumped) by XLA:
    its matmuls are priced at 2*M*K*N FLOPs over the bf16 peak, times the factor XLA's
    model charges over that roofline for the matmul in the scheduled entry."""
    mesh = jaxsync.gpu_topology("h100")

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
    def f(x, w):
        y = jax.lax.fori_loop(0, 5, lambda _, h: h @ w, x)  # no collective in the body
        return x @ w, jax.lax.psum(y[:8], "data")

    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    args = (
        jax.ShapeDtypeStruct((8 * 4096, 4096), jnp.bfloat16, sharding=sh(P("data"))),
        jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=sh(P())),
    )
    r = jaxsync.schedule_report(jax.jit(f).lower(*args), twin=False)  # the fallback alone
    (loop,) = [c for c in r.computations if c.source == "roofline" and c.own_us > 1]
    assert loop.runs in (4, 5)  # XLA may peel an iteration into the entry
    matmul_us = 2 * 4096**3 / (H100.bf16_dense_tflops * 1e12) * 1e6  # 139 us at peak
    assert loop.own_us == pytest.approx(r.roofline_scale[0] * matmul_us, rel=0.02)
    assert r.roofline_us == pytest.approx(loop.own_us * loop.runs, rel=1e-6)
    assert 0.8 < r.roofline_scale[0] < 2.0  # XLA prices this matmul near the roofline
    assert r.step_us == pytest.approx(sum(c.own_us * c.runs for c in r.computations))


@needs_plugin
def test_schedule_report_names_an_unknown_xla_option():
    mesh = jaxsync.gpu_topology("h100")
    x = jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match="xla_gpu_no_such_flag"):
        jaxsync.schedule_report(jax.jit(jnp.sin).lower(x), options={"xla_gpu_no_such_flag": True})


def test_schedule_report_refuses_a_cpu_program():
    x = jax.ShapeDtypeStruct((64,), jnp.float32)
    with pytest.raises(RuntimeError, match="no latency-hiding schedule"):
        jaxsync.schedule_report(jax.jit(jnp.sin).lower(x))


# ---------------------------------------------------- a scanned ZeRO step on H100
LAYERS, D = 4, 512


def _stack_params(dtype=jnp.bfloat16):
    return {
        "embed": jax.ShapeDtypeStruct((D, D), dtype),
        "blocks": {
            "w1": jax.ShapeDtypeStruct((LAYERS, D, 4 * D), dtype),
            "w2": jax.ShapeDtypeStruct((LAYERS, 4 * D, D), dtype),
            "g": jax.ShapeDtypeStruct((LAYERS, D), dtype),
        },
    }


def _stack_loss(params, x):
    h = x.astype(jnp.bfloat16) @ params["embed"]

    def body(h, p):
        p = jaxsync.tap(p)
        u = jax.nn.gelu((h * p["g"]) @ p["w1"])
        return h + u @ p["w2"], None

    h, _ = jax.lax.scan(jax.checkpoint(body), h, params["blocks"])
    return jnp.mean(jnp.square(h.astype(jnp.float32)))


@pytest.fixture(scope="module")
def zero_report():
    if not jaxsync.gpu_target_available():
        pytest.skip("needs jax-cuda12-plugin")
    mesh = jaxsync.gpu_topology("h100")
    step = jaxsync.train_step(
        _stack_loss, optax.adamw(1e-3), mesh, mode="zero", stacked="blocks", clip_grad_norm=1.0
    )
    state = step.abstract_state(_stack_params())
    batch = jax.ShapeDtypeStruct((8 * 1024, D), jnp.float32)
    return step, state, jaxsync.schedule_report(step.lower(state, batch))


@needs_plugin
def test_zero_step_on_h100_reduces_each_layer_inside_the_backward_loop(zero_report):
    _, _, r = zero_report
    sites = jaxsync.overlap_report(r.hlo_text)
    in_loop = sites.in_loop("reduce-scatter", role="backward")
    assert in_loop, sites.summary()
    layer_shard = (D * 4 * D * 2 + D) * 4 // 8  # one layer's fp32 grads, 1/8 per device
    loop_bodies = {c.computation for c in in_loop}
    timed = [
        c for c in r.collectives if c.kind == "reduce-scatter" and c.computation in loop_bodies
    ]
    assert timed and all(not c.is_sync for c in timed)
    assert all(c.overlap_ops > 0 and c.overlap_us > 0 for c in timed)  # compute hides them
    # No collective on the stacked gradients after the loop: a reduce-scatter left
    # in the entry is at most one layer's (an iteration XLA peeled out of the loop).
    stacked_entry = [
        c for c in sites.in_entry("reduce-scatter") if c.bytes >= 2 * layer_shard
    ]  # fmt: skip
    assert not stacked_entry, [(c.name, c.shapes) for c in stacked_entry]


@needs_plugin
def test_zero_step_on_h100_never_transposes_optimizer_buffers(zero_report):
    step, state, r = zero_report
    shard = [x.shape for x in jax.tree.leaves(state.opt_state) if len(x.shape) == 2][0]
    local = (shard[0], shard[1] // 8)  # [L, shard] per device
    transposed = f"f32[{local[1]},{local[0]}]"
    assert f"f32[{local[0]},{local[1]}]" in r.hlo_text  # the buffers are there...
    assert transposed not in r.hlo_text  # ...and never laid out [shard, L]
    assert not [h for h in r.hotspots if "transpose" in h.name and h.computation.startswith("main")]


@needs_plugin
def test_zero_step_on_h100_holds_the_exact_zero_state_per_gpu(zero_report):
    step, state, r = zero_report
    n = 8
    # bf16 params whole but for the stacked group: it lives in the master shards
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    assert params == D * D * 2
    # fp32 master + two AdamW moments, 1/8 each: the buffers' padded shard sizes
    shards = [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 1 and x.size > n]
    opt = sum(x.size * x.dtype.itemsize for x in shards) // n
    elements = sum(x.size for x in jax.tree.leaves(_stack_params()))
    assert 3 * 4 * elements / n <= opt <= 3 * 4 * (elements / n + 2 * LAYERS * 8)
    scalars = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if x.size <= n)
    big = params + opt + 8 * 1024 * D * 4 // n  # + the batch's rows
    # exact but for a few scalar counters (XLA drops the ones the step never reads)
    assert big <= r.memory["arguments"] <= big + scalars


def test_abstract_state_matches_init(mesh8):
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), _stack_params(jnp.float32))
    for mode in ("ddp", "zero", "fsdp"):
        step = jaxsync.train_step(_stack_loss, optax.adam(1e-3), mesh8, mode=mode,
                                  stacked="blocks")  # fmt: skip
        real = step.init(params)
        abstract = step.abstract_state(jax.eval_shape(lambda p: p, params))
        spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))  # noqa: E731
        assert jax.tree.structure(real) == jax.tree.structure(abstract), mode
        for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(abstract), strict=True):
            assert (a.shape, a.dtype, spec(a)) == (b.shape, b.dtype, spec(b)), mode
        if mode == "zero":  # the abstract state lowers the step; no real batch is needed
            batch = jax.ShapeDtypeStruct((16, D), jnp.float32)
            assert "reduce_scatter" in step.lower(abstract, batch).as_text()
        np.testing.assert_array_equal(step.params(real)["embed"], params["embed"])


@needs_plugin
@pytest.mark.parametrize("mode,axes", [(m, {"data": 4, "model": 2}) for m in ("fsdp", "zero")])
def test_steps_that_gain_nothing_from_a_pipelined_reduce_scatter_do_not_pay_for_it(mode, axes):
    """2-D steps are compiled without XLA's pipelined reduce-scatter: it holds one
    more layer in flight for no modeled time (xla_options). Asking for it at compile
    time still works, and costs temporaries."""
    from jaxsync._src.core.xla_names import pipelined
    from jaxsync._src.step.xla_options import step_compiler_options

    mesh = jaxsync.gpu_topology("h100", axes=axes)
    step = jaxsync.train_step(_stack_loss, optax.adamw(1e-3), mesh, mode=mode, stacked="blocks")
    params = _stack_params()
    if axes:  # the MLP split over "model" (Megatron's column / row)
        specs = {"embed": P(), "blocks": {"w1": P(None, None, "model"),
                                          "w2": P(None, "model", None), "g": P()}}  # fmt: skip
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            params, specs,
        )  # fmt: skip
    state = step.abstract_state(params)
    lowered = step.lower(state, jax.ShapeDtypeStruct((8 * 1024, D), jnp.float32))
    ours = jaxsync.schedule_report(lowered)
    asked = jaxsync.schedule_report(lowered, options=pipelined("reduce_scatter", True))
    assert ours.memory["temps"] < asked.memory["temps"], (ours.memory, asked.memory)
    off = pipelined("reduce_scatter", False)
    assert off.items() <= step_compiler_options(mode, two_d=axes is not None).items()


def test_xla_flags_keep_the_users_pipelining_choice(monkeypatch):
    from jaxsync._src.core.xla_names import pipelined
    from jaxsync._src.step.xla_options import (
        ALL_GATHER_COMBINE,
        DOUBLE_BUFFERING,
        REDUCE_SCATTER_COMBINE,
        step_compiler_options,
    )

    monkeypatch.setenv("XLA_FLAGS", "")
    # 1-D steps keep the pipelined reduce-scatter, and their loops are double-buffered;
    # ZeRO and FSDP also pipeline the forward's per-layer all-gathers; FSDP keeps its
    # units' reduce-scatters apart; DDP's loop reduce-scatters too (shard_grads), under
    # XLA's default pipelining: it sets nothing beyond the unrolling
    gather = pipelined("all_gather", True)
    apart = {REDUCE_SCATTER_COMBINE: 1}
    assert step_compiler_options("zero", two_d=False) == {DOUBLE_BUFFERING: True, **gather}
    assert step_compiler_options("fsdp", two_d=False) == {DOUBLE_BUFFERING: True, **gather,
                                                           **apart}  # fmt: skip
    assert step_compiler_options("ddp", two_d=False) == {DOUBLE_BUFFERING: True}
    assert step_compiler_options("ddp", two_d=True) == pipelined("reduce_scatter", False)
    # ... but not a DDP step whose state fills its GPU (DDP_TIGHT_SHARE); the sharded
    # modes' states do not, and they keep the unrolling at any share
    assert step_compiler_options("ddp", two_d=False, state=0.5) == {DOUBLE_BUFFERING: False}
    assert step_compiler_options("ddp", two_d=False, state=0.3)[DOUBLE_BUFFERING]
    # (a DDP step syncing stacked groups keeps 1/N of their reduced stack in the loop)
    assert step_compiler_options("ddp", two_d=False, state=0.5, stacked=True)[DOUBLE_BUFFERING]
    assert step_compiler_options("zero", two_d=False, state=0.9)[DOUBLE_BUFFERING]
    # XLA_FLAGS takes the old boolean spelling on every jaxlib: it counts as a choice
    monkeypatch.setenv(
        "XLA_FLAGS",
        f"--xla_gpu_enable_pipelined_all_gather=false --{DOUBLE_BUFFERING}=false",
    )
    assert step_compiler_options("fsdp", two_d=False) == apart
    monkeypatch.setenv("XLA_FLAGS", f"--{REDUCE_SCATTER_COMBINE}=1048576")
    assert REDUCE_SCATTER_COMBINE not in step_compiler_options("fsdp", two_d=False)
    # FSDP and ZeRO combine a stacked layer's all-gathers up to their largest layer
    for mode in ("fsdp", "zero"):
        assert (
            step_compiler_options(mode, two_d=False, layer_bytes=5000)[ALL_GATHER_COMBINE] == 5000
        )
    assert ALL_GATHER_COMBINE not in step_compiler_options("ddp", two_d=False, layer_bytes=5000)
    assert ALL_GATHER_COMBINE not in step_compiler_options("zero", two_d=False)
    monkeypatch.setenv("XLA_FLAGS", f"--{ALL_GATHER_COMBINE}=1048576")
    assert ALL_GATHER_COMBINE not in step_compiler_options("fsdp", two_d=False, layer_bytes=5000)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pipelined_reduce_scatter")
    assert step_compiler_options("zero", two_d=True) == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pipelined_reduce_scatter_x=true")
    assert step_compiler_options("zero", two_d=True) == pipelined("reduce_scatter", False)


@needs_plugin
def test_fsdp_keeps_its_units_reduce_scatters_apart():
    """Two FSDP units whose gradients are ready at different times (the head's right
    after the loss, the embedding's last): XLA would combine their reduce-scatters
    into one, holding the head's gradient until the embedding's is ready; the step
    reduces each unit on its own (xla_options.REDUCE_SCATTER_COMBINE)."""
    from jaxsync._src.step.xla_options import REDUCE_SCATTER_COMBINE

    def loss(params, x):
        h = jnp.tanh(x.astype(jnp.bfloat16) @ params["embed"])
        for _ in range(3):
            h = jnp.tanh(h @ params["mid"])
        return jnp.mean((h @ params["head"]).astype(jnp.float32) ** 2)

    mesh = jaxsync.gpu_topology("h100")
    params = {k: jax.ShapeDtypeStruct((D, D), jnp.float32) for k in ("embed", "mid", "head")}
    step = jaxsync.train_step(loss, optax.adamw(1e-3), mesh, mode="fsdp")
    lowered = step.lower(step.abstract_state(params),
                         jax.ShapeDtypeStruct((8 * 256, D), jnp.float32))  # fmt: skip

    def operands(options):  # operands of each reduce-scatter the compiled step makes
        text = lowered.compile(compiler_options=options).as_text()
        starts = re.findall(r"= \(\(([^)]*)\).*? reduce-scatter-start\(", text)
        plain = re.findall(r"= \S+ reduce-scatter\(([^)]*)\)", text)
        return [len(s.split("},")) for s in starts] + [len(p.split(",")) for p in plain]

    ours, combined = operands({}), operands({REDUCE_SCATTER_COMBINE: 2**30})
    assert ours and max(ours) == 1, ours
    assert max(combined) > 1, combined  # what XLA does left to its threshold


@needs_plugin
@pytest.mark.parametrize("mode", ["fsdp", "zero"])
def test_a_layer_is_gathered_param_by_param_combined_into_one_all_gather(mode):
    """A stacked layer gathered in the forward (FSDP; ZeRO's held groups) is gathered
    param by param, each straight into its own array (no slice of a gathered row to
    copy out); the step sets XLA's all-gather combining to its largest layer
    (xla_options.ALL_GATHER_COMBINE), so one layer's gathers still run as one
    collective. Here the layer is 64 MiB in bf16, past a 30 MiB threshold, under which
    its params go apart."""
    from jaxsync._src.step.xla_options import ALL_GATHER_COMBINE

    d, bf = 2048, jnp.bfloat16
    params = {
        "embed": jax.ShapeDtypeStruct((d, d), bf),
        "blocks": {
            "w1": jax.ShapeDtypeStruct((2, d, 4 * d), bf),
            "w2": jax.ShapeDtypeStruct((2, 4 * d, d), bf),
            "g": jax.ShapeDtypeStruct((2, d), bf),
        },
    }
    mesh = jaxsync.gpu_topology("h100")
    step = jaxsync.train_step(_stack_loss, optax.adamw(1e-3), mesh, mode=mode, stacked="blocks")
    state = step.abstract_state(params)
    lowered = step.lower(state, jax.ShapeDtypeStruct((8 * 64, d), jnp.float32))
    assert step._layer_bytes(step._plan(state, "test")) == 2 * (2 * d * 4 * d + d)

    def gathers(options):  # the result shapes of each all-gather of a layer's params
        text = lowered.compile(compiler_options=options).as_text()
        sites = jaxsync.overlap_report(text).collectives
        big = f"bf16[{d * 4 * d}]"
        return [c.shapes for c in sites if c.kind == "all-gather" and big in c.shapes]

    layer = ("bf16[2048]", f"bf16[{d * 4 * d}]", f"bf16[{d * 4 * d}]")
    ours = gathers({})
    assert ours and all(sorted(s) == sorted(layer) for s in ours), ours
    apart = gathers({ALL_GATHER_COMBINE: 30 * 2**20})
    assert apart and all(len(s) == 1 for s in apart), apart


def test_every_compile_option_jaxsync_sets_is_one_this_xla_knows(monkeypatch):
    """XLA renames options between releases (jaxlib 0.11.1 turned the pipelining
    booleans into enums), and a compile option it does not know fails the compile
    on every platform: each option the steps and GPU_PERFORMANCE_OPTIONS set must
    compile here."""
    from jaxsync._src.step.xla_options import step_compiler_options

    monkeypatch.setenv("XLA_FLAGS", "")
    options = dict(jaxsync.GPU_PERFORMANCE_OPTIONS)
    for mode in ("zero", "ddp", "fsdp"):
        options |= step_compiler_options(mode, two_d=False) | step_compiler_options(mode, True)
    x = jax.device_put(jnp.ones(2), jax.devices("cpu")[0])
    jax.jit(lambda v: v + 1).lower(x).compile(compiler_options=options)


@needs_plugin
def test_a_1d_zero_step_is_double_buffered_and_both_readings_gain():
    """XLA's statistics do not credit a reduce-scatter pipelined across loop
    iterations; unrolled twice, it overlaps inside one body, which both readings
    see. The step compiles with it by default (xla_options)."""
    from jaxsync._src.step.xla_options import DOUBLE_BUFFERING

    mesh = jaxsync.gpu_topology("h100")
    step = jaxsync.train_step(_stack_loss, optax.adamw(1e-3), mesh, mode="zero", stacked="blocks")
    lowered = step.lower(
        step.abstract_state(_stack_params()), jax.ShapeDtypeStruct((8 * 1024, D), jnp.float32)
    )
    ours = jaxsync.schedule_report(lowered)
    plain = jaxsync.schedule_report(lowered, options={DOUBLE_BUFFERING: False})
    assert ours.step_us < plain.step_us
    assert ours.makespan_us <= plain.makespan_us * 1.01
    # the layer loop now runs half as many (unrolled) iterations
    assert max(c.runs for c in ours.computations) < max(c.runs for c in plain.computations)


@needs_plugin
@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_a_one_gpu_step_keeps_xla_defaults(mode, monkeypatch):
    """With one data-parallel device there is no collective for the step's options
    to serve: its loops compile as plain ``jax.jit``'s do (not unrolled twice), where
    two GPUs double-buffer them."""
    from jaxsync._src.step.xla_options import step_compiler_options

    monkeypatch.setenv("XLA_FLAGS", "")
    assert step_compiler_options(mode, two_d=False, layer_bytes=5000, devices=1) == {}
    for gpus, unrolled in ((1, False), (2, True)):
        mesh = jaxsync.gpu_topology("h100", gpus_per_host=gpus)
        step = jaxsync.train_step(_stack_loss, optax.sgd(0.1), mesh, mode=mode, stacked="blocks")
        batch = jax.ShapeDtypeStruct((gpus * 64, D), jnp.float32)
        hlo = step.lower(step.abstract_state(_stack_params()), batch).compile().as_text()
        assert ("double_buffer_clone" in hlo) is unrolled, gpus


@needs_plugin
def test_a_ddp_step_knows_the_share_of_its_gpu_its_state_takes(monkeypatch):
    """A DDP step whose replicated state takes over 40% of its GPU is compiled without
    double-buffered loops (xla_options.DDP_TIGHT_SHARE: XLA's rematerialization then
    rewrites the backward loop's gradient writes). The share the step passes is its
    state's bytes per device over the GPU's 80 GiB, counted here by hand."""
    from jaxsync._src.step import step as step_module
    from jaxsync._src.step.xla_options import DDP_TIGHT_SHARE

    seen = []
    real = step_module.step_compiler_options

    def spy(*args, **kwargs):
        seen.append(kwargs.get("state", 0.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "step_compiler_options", spy)
    mesh = jaxsync.gpu_topology("h100", hosts=1)
    loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)  # noqa: E731
    for gib in (2, 16):  # an fp32 param of `gib` GiB, and AdamW's two moments
        rows = gib * 2**30 // 4 // 1024
        params = {"w": jax.ShapeDtypeStruct((1024, rows), jnp.float32)}
        step = jaxsync.train_step(loss, optax.adamw(1e-3), mesh, mode="ddp")
        step.abstract_state(params)
        want = 3 * gib / 80
        assert seen[-1] == pytest.approx(want, rel=1e-6), (gib, seen[-1])
        assert (seen[-1] > DDP_TIGHT_SHARE) == (gib == 16)
    # a CPU mesh's memory is not asked: no share, the default options
    step = jaxsync.train_step(loss, optax.adamw(1e-3), jax.make_mesh((1,), ("data",)), mode="ddp")
    step.abstract_state({"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)})
    assert seen[-1] == 0.0

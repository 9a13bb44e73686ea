"""overlap_report: where each collective of a compiled step sits, and what overlaps it.

The scanned models run on 8 CPU devices. XLA:CPU's collectives are synchronous,
so overlap counts are checked on hand-written scheduled HLO with async pairs.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync

L, D, N = 4, 16, 8  # L >= 2: XLA removes a loop of trip count 1 (its collective goes to entry)


def _tap(reduce):
    """Identity on a layer's weight whose backward reduces that layer's gradient.

    The reduced gradient comes out as the cotangent of ``sink`` (shaped like the
    reduced result), so ``psum_scatter`` can change the shape.
    """

    @jax.custom_vjp
    def tap(w, sink):
        return w

    def fwd(w, sink):
        return w, None

    def bwd(_, g):
        zeros = lambda shape: jax.lax.pcast(jnp.zeros(shape, g.dtype), "data", to="varying")
        if reduce == "psum_scatter":
            return zeros(g.shape), jax.lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True)
        summed = jax.lax.pcast(jax.lax.psum(g, "data"), "data", to="varying")
        return summed, zeros((D // N, D))

    tap.defvjp(fwd, bwd)
    return tap


def _loss(ws, sinks, x, tap=None):
    def body(h, layer):
        w, sink = layer
        if tap is not None:
            w = tap(w, sink)
        return jnp.tanh(h @ w) + h, None

    h, _ = jax.lax.scan(body, x, (ws, sinks))
    return jnp.sum(h**2)


def _compile(step, mesh, ws_spec, x_shape, x_spec):
    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(ws_spec, x_spec), out_specs=P(None, "data"))
    )
    ws = jax.device_put(jnp.full((L, D, D), 0.01), NamedSharding(mesh, ws_spec))
    x = jax.device_put(jnp.ones(x_shape), NamedSharding(mesh, x_spec))
    return f.lower(ws, x).compile()


def _varying(ws):
    # Local (unreduced) grads: differentiate w.r.t. device-varying params (DESIGN.md).
    ws = jax.lax.pcast(ws, "data", to="varying")
    sinks = jax.lax.pcast(jnp.zeros((L, D // N, D)), "data", to="varying")
    return ws, sinks


def _while_line(compiled, name):
    return next(x for x in compiled.as_text().splitlines() if x.strip().startswith(f"%{name} ="))


@pytest.mark.parametrize(
    "reduce, kind, shape, nbytes",
    [("psum_scatter", "reduce-scatter", "f32[2,16]", 2 * 16 * 4),
     ("psum", "all-reduce", "f32[16,16]", 16 * 16 * 4)],
)  # fmt: skip
def test_tap_collective_sits_in_backward_loop(mesh8, reduce, kind, shape, nbytes):
    def step(ws, x):
        ws, sinks = _varying(ws)
        gw, gs = jax.grad(_loss, argnums=(0, 1))(ws, sinks, x, _tap(reduce))
        return gs if reduce == "psum_scatter" else gw[:, : D // N]

    compiled = _compile(step, mesh8, P(), (16, D), P("data"))
    report = jaxsync.overlap_report(compiled)

    assert report.scheduled
    assert len(report) == 1  # one per layer body, not one per layer: the loop stays
    (site,) = report.in_loop(kind, role="backward")
    assert report.in_entry() == [] and report.in_loop(role="forward") == []
    assert site.shapes == (shape,) and site.dtype == "f32" and site.bytes == nbytes
    assert site.loop_role == "backward" and len(site.loops) == 1 and site.where == site.loops[0]
    assert site.trip_count == L
    assert site.computation != "main" and not site.is_async
    assert site.overlap_ops is None and site.overlap_names is None  # CPU: synchronous
    assert "transpose(jvp())/while/body" in site.op_name
    # The named while really is the transposed scan (read independently of the report).
    assert 'op_name="jit(step)/shard_map/transpose(jvp())/while"' in _while_line(
        compiled, site.where
    )
    assert report.counts() == {(kind, site.where): 1}
    assert report.loop_fraction == 1.0 and report.overlapped_fraction == 0.0
    assert report.total_bytes == nbytes


def test_reduction_after_grad_is_in_entry(mesh8):
    def step(ws, x):
        ws, sinks = _varying(ws)
        g = jax.grad(_loss)(ws, sinks, x)
        return jax.lax.psum_scatter(g, "data", scatter_dimension=1, tiled=True)

    report = jaxsync.overlap_report(_compile(step, mesh8, P(), (16, D), P("data")))

    assert report.in_loop() == []
    (site,) = report.in_entry("reduce-scatter")
    assert site.where == "entry" and site.loops == () and site.loop_role is None
    assert site.trip_count == 1
    assert site.shapes == ("f32[4,2,16]",) and site.bytes == L * (D // N) * D * 4
    assert report.counts() == {("reduce-scatter", "entry"): 1}
    assert report.loop_fraction == 0.0


def test_fsdp_gather_in_forward_loop_scatter_in_backward_loop(mesh8):
    def step(shards, x):
        def loss(shards, x):
            def body(h, s):
                w = jax.lax.all_gather(s, "data", axis=0, tiled=True)
                return jnp.tanh(h @ w) + h, None

            h, _ = jax.lax.scan(body, x, shards)
            return jnp.sum(h**2)

        return jax.grad(loss)(shards, x)

    compiled = _compile(step, mesh8, P(None, "data"), (16, D), P("data"))
    report = jaxsync.overlap_report(compiled)

    (gather,) = report.in_loop("all-gather", role="forward")
    (scatter,) = report.in_loop("reduce-scatter", role="backward")
    assert len(report) == 2 and report.in_entry() == []
    assert gather.shapes == ("f32[16,16]",) and gather.bytes == D * D * 4
    assert scatter.shapes == ("f32[2,16]",) and scatter.bytes == (D // N) * D * 4
    assert gather.where != scatter.where
    assert 'op_name="jit(step)/shard_map/jvp()/while"' in _while_line(compiled, gather.where)
    assert "transpose(jvp())/while" in _while_line(compiled, scatter.where)
    assert report.in_loop(role="unknown") == []


def test_nested_loops_grad_accumulation(mesh8):
    def step(ws, xs):
        ws, sinks = _varying(ws)
        tap = _tap("psum_scatter")

        def microbatch(acc, x):
            return acc + jax.grad(_loss, argnums=1)(ws, sinks, x, tap), None

        return jax.lax.scan(microbatch, sinks, xs)[0]

    compiled = _compile(step, mesh8, P(), (3, 16, D), P(None, "data"))
    (site,) = jaxsync.overlap_report(compiled)

    outer, inner = site.loops
    assert site.where == f"{outer}/{inner}" and site.loop_role == "backward"
    assert site.trip_count == 3 * L  # 3 microbatches, L layers each
    assert 'op_name="jit(step)/shard_map/while"' in _while_line(compiled, outer)
    assert "/transpose(jvp())/while" in _while_line(compiled, inner)


# --- Hand-written scheduled HLO (async collectives, as on GPU) -----------------------------

_ASYNC = """\
HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%f (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %e = f32[1024]{0} exponential(%p)
}

ENTRY %main (a: f32[1024], b: f32[1024]) -> (f32[1024], f32[1024], f32[1024]) {
  %a = f32[1024]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  %ars = f32[1024]{0} all-reduce-start(%a), replica_groups={{0,1}}, to_apply=%add
  %one = f32[] constant(1)
  %fa = f32[1024]{0} fusion(%b), kind=kLoop, calls=%f
  %fb = f32[1024]{0} fusion(%fa), kind=kLoop, calls=%f
  %ard = f32[1024]{0} all-reduce-done(%ars)
  ROOT %t = (f32[1024]{0}, f32[1024]{0}, f32[1024]{0}) tuple(%ard, %fa, %fb)
}
"""


def test_async_overlap_counts_compute_between_start_and_done():
    (site,) = jaxsync.overlap_report(_ASYNC)
    assert site.name == "ars" and site.kind == "all-reduce" and site.is_async
    assert site.overlap_ops == 2 and site.overlap_names == ("fa", "fb")  # not the constant
    assert site.bytes == 4096 and site.where == "entry" and site.computation == "main"

    report = jaxsync.overlap_report(_ASYNC.replace(
        "  %ard = f32[1024]{0} all-reduce-done(%ars)\n", ""
    ).replace("  %one =", "  %ard = f32[1024]{0} all-reduce-done(%ars)\n  %one ="))  # fmt: skip
    (site,) = report
    assert site.overlap_ops == 0 and site.overlap_names == ()
    assert report.overlapped_fraction == 0.0


def test_async_bytes_come_from_the_done_shape():
    text = """\
HloModule m, is_scheduled=true

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

%wrapped_rs (q: bf16[64,16]) -> bf16[8,16] {
  %q = bf16[64,16]{1,0} parameter(0)
  ROOT %rs = bf16[8,16]{1,0} reduce-scatter(bf16[64,16]{1,0} %q), dimensions={0}, to_apply=%add
}

ENTRY %main (a: bf16[8,16], b: bf16[64,16], c: f32[4], d: f32[3]) -> bf16[64,16] {
  %a = bf16[8,16]{1,0} parameter(0)
  %b = bf16[64,16]{1,0} parameter(1)
  %c = f32[4]{0} parameter(2)
  %d = f32[3]{0} parameter(3)
  %ags = (bf16[8,16]{1,0}, bf16[64,16]{1,0}) all-gather-start(%a), dimensions={0}
  %rss = ((bf16[64,16]{1,0}), bf16[8,16]{1,0}, u32[]) async-start(%b), calls=%wrapped_rs
  %n = bf16[64,16]{1,0} negate(%b)
  %rsu = ((bf16[64,16]{1,0}), bf16[8,16]{1,0}, u32[]) async-update(%rss), calls=%wrapped_rs
  %m = bf16[64,16]{1,0} multiply(%n, %n)
  %rsd = bf16[8,16]{1,0} async-done(((bf16[64,16]{1,0}), bf16[8,16]{1,0}, u32[]) %rsu)
  %agd = bf16[64,16]{1,0} all-gather-done(%ags)
  %ar2s = (f32[4]{0}, f32[3]{0}) all-reduce-start(%c, %d), to_apply=%add
  %ar2d = (f32[4]{0}, f32[3]{0}) all-reduce-done(%ar2s)
  ROOT %r = bf16[64,16]{1,0} add(%agd, %m)
}
"""
    report = jaxsync.overlap_report(text)
    ag, rs, ar = report
    assert (ag.kind, ag.shapes, ag.dtype) == ("all-gather", ("bf16[64,16]",), "bf16")
    assert ag.bytes == 64 * 16 * 2
    assert ag.overlap_names == ("n", "m")  # the async pair in between is not compute
    assert (rs.name, rs.kind, rs.bytes) == ("rss", "reduce-scatter", 8 * 16 * 2)
    assert rs.overlap_names == ("n", "m") and rs.computation == "main"  # not the wrapper
    assert (ar.shapes, ar.bytes, ar.overlap_ops) == (("f32[4]", "f32[3]"), 28, 0)
    assert report.total_bytes == 2048 + 256 + 28
    assert report.overlapped_fraction == pytest.approx((2048 + 256) / (2048 + 256 + 28))
    # Same figure as hlo.collective_stats for the ops whose starts it reads right.
    stats = jaxsync.collective_stats(text)
    assert stats["all-gather"].bytes == ag.bytes


_CALLS = """\
HloModule calls, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%layer (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add
}

%body (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[8]{0} get-tuple-element(%s), index=1
  %r = f32[8]{0} call(%v), to_apply=%layer
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]{0}) tuple(%j, %r)
}

%cond (s: (s32[], f32[8])) -> pred[] {
  %s = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %four), direction=LT
}

%branch_a (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}
}

%branch_b (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}

ENTRY %main (x: f32[8], k: s32[]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %k = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %y = f32[8]{0} get-tuple-element(%loop), index=1
  ROOT %z = f32[8]{0} conditional(%k, %y, %y), branch_computations={%branch_a, %branch_b}
}
"""


def test_call_graph_through_call_and_conditional():
    ar, cp = jaxsync.overlap_report(_CALLS)
    assert (ar.kind, ar.computation, ar.bytes) == ("all-reduce", "layer", 32)
    assert ar.where == "loop" and ar.loops == ("loop",)  # called from the body: inside the loop
    assert ar.loop_role == "unknown"  # no JAX metadata anywhere
    assert ar.trip_count is None  # no known_trip_count in the backend_config
    assert (cp.kind, cp.computation, cp.bytes) == ("collective-permute", "branch_a", 32)
    assert cp.where == "entry" and cp.loop_role is None  # a conditional is no loop

    loop = "condition=%cond, body=%body"
    for op_name, role in [("f/transpose(jvp())/while", "backward"), ("f/jvp()/while", "forward")]:
        text = _CALLS.replace(loop, f'{loop}, metadata={{op_name="{op_name}"}}')
        report = jaxsync.overlap_report(text)
        assert [c.loop_role for c in report.in_loop()] == [role]
    # Without metadata on the while op, the body's op_names decide.
    add = "%j = s32[] add(%i, %one)"
    body_meta = _CALLS.replace(add, f'{add}, metadata={{op_name="transpose(jvp())/while/body"}}')
    assert jaxsync.overlap_report(body_meta).in_loop("all-reduce", role="backward")


def test_summary_table():
    text = str(jaxsync.overlap_report(_CALLS))
    header, rule, first, second, total = text.splitlines()
    assert header.split() == ["name", "kind", "result", "bytes", "where", "role", "overlap"]
    assert set(rule.replace(" ", "")) == {"-"}
    assert first.split() == ["ar", "all-reduce", "f32[8]", "32", "loop", "unknown", "sync"]
    assert second.split() == ["cp", "collective-permute", "f32[8]", "32", "entry", "-", "sync"]
    assert re.match(r"2 collectives, 64 bytes; in loop bodies 50%, overlapped by compute 0%", total)


def test_errors_name_the_argument(mesh8):
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
    with pytest.raises(ValueError, match=r"compiled HLO.*\.compile\(\)"):
        jaxsync.overlap_report(lowered.as_text())
    report = jaxsync.overlap_report(_CALLS)
    with pytest.raises(ValueError, match="`kind` must be None or one of"):
        report.in_loop("allreduce")
    with pytest.raises(ValueError, match="`role` must be None or one of"):
        report.in_loop(role="bwd")
    with pytest.raises(ValueError, match="got 'module @jit"):
        jaxsync.overlap_report(lowered)  # has .as_text(), but StableHLO
    with pytest.raises(TypeError, match="got 'dict'"):
        jaxsync.overlap_report({"text": _CALLS})

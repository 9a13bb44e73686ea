"""hbm_bytes: each kernel's reads and writes per step, loop trip counts included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxsync

F32 = 4


def _scan(collect: bool):
    def f(x, ws):
        def body(c, w):
            h = jnp.tanh(c @ w)
            return h, (h if collect else None)

        h, ys = jax.lax.scan(body, x, ws)
        return h.sum() + (ys.sum() if collect else 0.0)

    return jax.jit(f).lower(jnp.ones((64, 256)), jnp.ones((5, 256, 256))).compile()


def test_a_loop_body_s_kernels_are_counted_once_per_iteration():
    report = jaxsync.hbm_bytes(_scan(collect=False))
    (mm,) = [k for k in report.kernels if k.kind == "matmul"]
    # [64, 256] @ [256, 256]: both read, the [64, 256] product written, 5 times.
    assert mm.runs == 5
    assert mm.bytes == (64 * 256 + 256 * 256 + 64 * 256) * F32
    # The layer's weight is sliced out of the [5, 256, 256] stack: the slice is
    # read and written, not the whole stack.
    (ds,) = [k for k in report.kernels if k.op_name.endswith("dynamic_slice")]
    assert (ds.runs, ds.bytes) == (5, 2 * 256 * 256 * F32)
    assert report.total == sum(k.bytes * k.runs for k in report.kernels)
    assert report.by_kind()["matmul"] == 5 * mm.bytes
    assert report.kernels[0].total == max(k.total for k in report.kernels)


def test_an_in_place_update_of_a_stack_moves_the_update_only():
    report = jaxsync.hbm_bytes(_scan(collect=True))
    dus = [k for k in report.kernels if "dynamic_update_slice" in k.op_name]
    assert dus and all(k.runs == 5 for k in dus)
    # One [64, 256] row of the [5, 64, 256] stack read and written per iteration
    # (plus the scalar index), not the 320 KiB stack.
    assert all(2 * 64 * 256 * F32 <= k.bytes <= 2 * 64 * 256 * F32 + 64 for k in dus)


HLO = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: bf16[128,256], p1: bf16[256,512]) -> f32[128,512] {
  %p0 = bf16[128,256]{1,0} parameter(0)
  %p1 = bf16[256,512]{1,0} parameter(1)
  %gemm = (bf16[128,512]{1,0}, s8[1024]{0}) custom-call(%p0, %p1), \
custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/dot_general"}
  %gte = bf16[128,512]{1,0} get-tuple-element(%gemm), index=0
  %cvt = f32[128,512]{1,0} convert(%gte), metadata={op_name="jit(f)/convert_element_type"}
  ROOT %ar = f32[128,512]{1,0} all-reduce(%cvt), replica_groups={}, to_apply=%add
}
"""


def test_library_matmuls_are_matmuls_and_collectives_are_left_out():
    report = jaxsync.hbm_bytes(HLO)
    by = {k.name: k for k in report.kernels}
    assert set(by) == {"gemm", "cvt"}
    assert by["gemm"].kind == "matmul"
    assert by["gemm"].bytes == (128 * 256 + 256 * 512 + 128 * 512) * 2 + 1024
    assert (by["cvt"].kind, by["cvt"].bytes) == ("other", 128 * 512 * (2 + 4))
    assert report.by_kind() == {
        "matmul": by["gemm"].bytes,
        "attention": 0,
        "other": by["cvt"].bytes,
    }


def test_bad_input_is_named():
    """The errors name `hbm_bytes` (they named `overlap_report`, whose check it shares)."""
    with pytest.raises(TypeError, match="^`hbm_bytes` needs compiled HLO"):
        jaxsync.hbm_bytes(42)
    with pytest.raises(ValueError, match="^`hbm_bytes` needs compiled HLO.*StableHLO"):
        jaxsync.hbm_bytes(jax.jit(lambda x: x).lower(1.0).as_text())
    with pytest.raises(TypeError, match="^`overlap_report` needs compiled HLO"):
        jaxsync.overlap_report(42)


def test_what_xla_rematerialized_is_counted_apart():
    """XLA's rematerialization names each kernel it clones ``<name>.remat<N>``: the
    bytes it spends recomputing because its memory estimate passed its limit."""
    text = HLO.replace("%cvt = f32", "%cvt.remat2 = f32").replace(
        "all-reduce(%cvt)", "all-reduce(%cvt.remat2)"
    )
    report = jaxsync.hbm_bytes(text)
    assert report.rematerialized == 128 * 512 * (2 + 4)
    assert "of which 0.00 GB XLA rematerialized" in report.table()
    assert jaxsync.hbm_bytes(HLO).rematerialized == 0
    assert "rematerialized" not in jaxsync.hbm_bytes(HLO).table()

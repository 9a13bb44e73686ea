import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsync
from jaxsync import BufferKey, build_layout


def test_hand_computed_offsets_and_padding():
    params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 5)), "c": jnp.zeros(100)}
    layout = build_layout(params, num_shards=4)
    # Reverse tree order: c, b, a; starts aligned to 64 elements.
    starts = {s.path: s.start for s in layout.slots}
    assert starts == {"['c']": 0, "['b']": 128, "['a']": 192}
    (buf,) = layout.buffers
    assert buf.used == 113
    # 195 elements padded to a multiple of lcm(4, 128) = 128.
    assert buf.size == 256
    assert layout.shard_size(0) == 64
    assert [s.path for s in (layout.slots[i] for i in buf.slots)] == ["['c']", "['b']", "['a']"]


def test_unsharded_layout_is_dense():
    params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 5)), "c": jnp.zeros(100)}
    layout = build_layout(params)
    assert [s.start for s in layout.slots] == [110, 100, 0]
    assert layout.buffers[0].size == 113


def test_buckets_close_at_bucket_size_and_keep_params_whole():
    params = [jnp.zeros(50), jnp.zeros(30), jnp.zeros(40), jnp.zeros(10)]
    layout = build_layout(params, bucket_size=60)
    buckets = layout.buffers[0].buckets
    # reverse order: 10, 40 (=50 < 60), 30 (=80 >= 60 -> close) | 50 (>= 60? no, end)
    assert [(b.start, b.end) for b in buckets] == [(0, 80), (80, 130)]
    assert [[layout.slots[i].leaf_index for i in b.slots] for b in buckets] == [[3, 2, 1], [0]]


def test_sharded_bucket_padding_and_rank_ranges():
    params = {"x": jnp.zeros(300), "y": jnp.zeros(70)}
    layout = build_layout(params, num_shards=2, bucket_size=200)
    # reverse order: y (0..70) -> close? 70 < 200 no; x at 128..428 -> 428 >= 200 close
    (buf,) = layout.buffers
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 512)]
    # rank 0 owns [0, 256), rank 1 owns [256, 512)
    r0 = layout.shard_ranges(0)
    r1 = layout.shard_ranges(1)
    y, x = 1, 0
    assert r0 == (
        jaxsync.PieceRange(y, 0, (0, 70), (0, 70), (0, 70)),
        jaxsync.PieceRange(x, 0, (128, 256), (128, 256), (0, 128)),
    )
    assert r1 == (jaxsync.PieceRange(x, 0, (256, 428), (0, 172), (128, 300)),)


def test_rank_ranges_cover_every_element_once():
    params = {"a": jnp.zeros((7, 13)), "b": jnp.zeros(1), "c": jnp.zeros(()), "d": jnp.zeros(999)}
    layout = build_layout(params, num_shards=8, bucket_size=300)
    seen = {i: np.zeros(s.size, int) for i, s in enumerate(layout.slots)}
    for r in range(8):
        for piece in layout.shard_ranges(r):
            lo, hi = piece.in_param
            seen[piece.slot][lo:hi] += 1
            assert piece.in_shard[1] <= layout.shard_size(0)
            assert piece.in_buffer[1] - piece.in_buffer[0] == hi - lo
    assert all((v == 1).all() for v in seen.values())
    for b in layout.buffers[0].buckets:
        assert b.size % 128 == 0  # lcm(8, 128)


def test_flatten_unflatten_round_trip_mixed_dtypes_odd_shapes():
    key = jax.random.PRNGKey(0)
    params = {
        "scalar": jnp.float32(3.5),
        "one": jnp.ones((1,), jnp.bfloat16),
        "odd": jax.random.normal(key, (3, 7, 5)),
        "half": jax.random.normal(key, (11,)).astype(jnp.float16),
        "bf": jax.random.normal(key, (9, 2)).astype(jnp.bfloat16),
    }
    for shards, bucket in [(1, None), (8, None), (8, 16), (3, 40)]:
        layout = build_layout(params, num_shards=shards, bucket_size=bucket)
        assert {b.key.dtype for b in layout.buffers} == {"float32", "bfloat16", "float16"}
        flat = jax.jit(layout.flatten)(params)
        for f, b in zip(flat, layout.buffers, strict=True):
            assert f.shape == (b.size,) and f.dtype == jnp.dtype(b.key.dtype)
        back = jax.jit(layout.unflatten)(flat)
        jax.tree.map(
            lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, back
        )
        jax.tree.map(lambda a, b: (a.dtype == b.dtype) or pytest.fail("dtype"), params, back)
        # padding is zero
        total = sum(float(jnp.sum(jnp.abs(f.astype(jnp.float32)))) for f in flat)
        expect = sum(
            float(jnp.sum(jnp.abs(p.astype(jnp.float32)))) for p in jax.tree.leaves(params)
        )
        assert total == pytest.approx(expect, rel=1e-6)


def test_shards_reassemble_to_buffer():
    params = {"a": jnp.arange(500.0), "b": jnp.arange(77.0)}
    layout = build_layout(params, num_shards=4, bucket_size=100)
    (flat,) = layout.flatten(params)
    shards = jnp.stack([layout.shard_of(0, flat, r) for r in range(4)])
    np.testing.assert_array_equal(layout.gather_shards(0, shards), flat)
    for r in range(4):
        for piece in layout.shard_ranges(r):
            slot = layout.slots[piece.slot]
            leaf = np.ravel(params["a" if slot.path == "['a']" else "b"])
            np.testing.assert_array_equal(
                shards[r][piece.in_shard[0] : piece.in_shard[1]],
                leaf[piece.in_param[0] : piece.in_param[1]],
            )


def test_layout_from_shape_dtype_structs_is_cached_and_hashable():
    params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16)}
    a = build_layout(params, num_shards=2)
    b = build_layout({"w": jnp.zeros((4, 4), jnp.bfloat16)}, num_shards=2)
    assert a is b
    assert hash(a) == hash(b)
    assert "bfloat16" in a.summary() and "padding" in a.summary()


def test_key_fn_separates_buffers():
    params = {"w": jnp.zeros(4), "b": jnp.zeros(2)}
    layout = build_layout(
        params,
        key_fn=lambda path, _: BufferKey(
            "float32", ("data",), "no_decay" if "b" in path else "decay"
        ),
    )
    assert [b.key.label for b in layout.buffers] == ["decay", "no_decay"]


@pytest.mark.parametrize(
    "params, bucket, err, match",
    [
        ({"step": jnp.zeros((), jnp.int32)}, None, TypeError, r"\['step'\].*int32"),
        ({}, None, ValueError, "no array leaves"),
        ({"w": jnp.zeros(3)}, 0, ValueError, "bucket_size"),
        ({"w": jnp.zeros(3)}, -5, ValueError, "bucket_size"),
    ],
)
def test_bad_input(params, bucket, err, match):
    with pytest.raises(err, match=match):
        build_layout(params, bucket_size=bucket)


def test_tree_mismatch_named():
    layout = build_layout({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4,\)"):
        layout.flatten({"w": jnp.zeros(4)})

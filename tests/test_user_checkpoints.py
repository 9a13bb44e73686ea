"""A trainer's own orbax checkpoints of a step's state (issue 41).

A user who saves ``state`` with plain orbax (``ocp.StandardCheckpointer``,
``ocp.PyTreeCheckpointer``) and restores it into a step on another data-parallel size
gets arrays of the right shapes: a ``"zero"``/``"fsdp"`` state's flat shards then hold
their elements in another order. Before, the run resumed silently wrong (FSDP with
labels: params 3.4 off, loss 20.2 for 31.0 one step later); now the state's layout tag
(``state.layout``, restored by orbax with the rest) makes the step refuse it by name, and
a ``"ddp"`` state (replicated, the same at any size) restores right. Both runs happen in
one process: 8 simulated devices, then a sub-mesh of 4 of them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh

import jaxsync

LABELS = {"l": {"w1": "a", "w2": "b", "b": "b"}}


def loss_fn(p, batch):
    x, y = batch
    p = p["l"]
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2)


def params():
    rng = np.random.default_rng(0)
    return {
        "l": {
            "w1": jnp.asarray(rng.normal(size=(6, 50)), jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(50, 3)), jnp.float32),
            "b": jnp.zeros((3,)),
        }
    }


def batch():
    rng = np.random.default_rng(1)
    return rng.normal(size=(32, 6)).astype(np.float32), rng.normal(size=(32, 3)).astype(np.float32)


def make(mode, n, labels):
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    if labels:
        tx = {"a": optax.adam(1e-2), "b": optax.sgd(1e-2)}
        return jaxsync.train_step(loss_fn, tx, mesh, mode, labels=LABELS)
    return jaxsync.train_step(loss_fn, optax.adam(1e-2), mesh, mode)


def trained(mode, labels, steps=3):
    step = make(mode, 8, labels)
    state = step.init(params())
    for _ in range(steps):
        state, _ = step(state, batch())
    return step, state


def save(state, path, checkpointer):
    ckpt = checkpointer()
    ckpt.save(path, state)
    if hasattr(ckpt, "wait_until_finished"):
        ckpt.wait_until_finished()
    return ckpt


@pytest.mark.parametrize(
    ("mode", "labels", "checkpointer"),
    [("fsdp", True, ocp.StandardCheckpointer), ("zero", False, ocp.PyTreeCheckpointer)],
)
def test_a_sharded_state_restored_at_another_dp_size_is_refused(mode, labels, checkpointer,
                                                                tmp_path):  # fmt: skip
    _, state = trained(mode, labels)
    ckpt = save(state, tmp_path / "c", checkpointer)
    step4 = make(mode, 4, labels)
    target = step4.abstract_state(params())
    if checkpointer is ocp.PyTreeCheckpointer:
        args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), target)
        restored = ckpt.restore(tmp_path / "c", item=target, restore_args=args)
    else:
        restored = ckpt.restore(tmp_path / "c", target)
    with pytest.raises(ValueError, match=r"cut for 8 data-parallel devices.*for 4 .*save_state"):
        step4(restored, batch())
    with pytest.raises(ValueError, match="restore_state"):
        step4.params(restored)


def test_the_same_dp_size_restores_and_trains_on(tmp_path):
    step8, state = trained("fsdp", True)
    ckpt = save(state, tmp_path / "c", ocp.StandardCheckpointer)
    again = make("fsdp", 8, True)  # a new process's step: the state is foreign to it
    restored = ckpt.restore(tmp_path / "c", again.abstract_state(params()))
    restored, got = again(restored, batch())
    state, want = step8(state, batch())
    assert float(got) == float(want)


def test_a_ddp_state_restores_right_at_another_dp_size(tmp_path):
    step8, state = trained("ddp", False)
    ckpt = save(state, tmp_path / "c", ocp.StandardCheckpointer)
    step4 = make("ddp", 4, False)
    restored = ckpt.restore(tmp_path / "c", step4.abstract_state(params()))
    restored, got = step4(restored, batch())
    state, want = step8(state, batch())
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(step4.params(restored)), jax.tree.leaves(step8.params(state)),
                    strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_jaxsync_save_state_moves_the_state_between_sizes(tmp_path):
    step8, state = trained("fsdp", True)
    with jaxsync.Checkpointer(tmp_path / "j") as ckpt:
        ckpt.save_state(step8, state)
    step4 = make("fsdp", 4, True)
    with jaxsync.Checkpointer(tmp_path / "j") as ckpt:
        restored = ckpt.restore_state(step4, step4.init(params())).state
    restored, got = step4(restored, batch())
    state, want = step8(state, batch())
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_a_checkpoint_without_the_tag_is_named(tmp_path):
    """A state saved before the tag existed restores with ``layout=None`` (orbax keeps
    the saved structure): named as such, with the ways forward."""
    step8, state = trained("fsdp", True, steps=1)
    ckpt = save(state._replace(layout=None), tmp_path / "c", ocp.StandardCheckpointer)
    restored = ckpt.restore(tmp_path / "c", step8.abstract_state(params()))
    with pytest.raises(ValueError, match=r"no shard layout tag.*restore_state"):
        step8(restored, batch())
    restored = restored._replace(layout=step8.init(params()).layout)  # saved at this layout
    step8(restored, batch())


@pytest.mark.parametrize("mode", ["fsdp", "zero"])
def test_a_stacked_state_cut_as_layer_rows_is_refused(mode):
    """Before 2026-11 a stacked FSDP unit's shard was a slice of each layer's flat row,
    and ZeRO's stacked group one buffer; now a piece of every param, and a buffer per
    param (each gathered straight into its array). A state saved then with plain orbax
    has the same shapes in another order: its tag, the old fingerprint of the same
    options, is refused by name."""
    import zlib

    from helpers import scanned_batches, scanned_loss, scanned_params
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxsync._src.step.shard_tag import _stable

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    step = jaxsync.train_step(scanned_loss, optax.sgd(0.1), mesh, mode, stacked="blocks")
    state = step.init(scanned_params(jax.random.key(0)))
    xs, ys = scanned_batches(jax.random.key(1), 1, 16)
    m = step.mode
    before = (m.name, step.axis_name, step.stacked, None, getattr(m, "bucket_size", None),
              getattr(m, "units", None))  # fmt: skip
    old = np.array([8, zlib.crc32(repr(_stable(before)).encode()) & 0x7FFFFFFF], np.int32)
    assert not np.array_equal(old, np.asarray(state.layout))
    stale = state._replace(layout=jax.device_put(old, NamedSharding(mesh, P())))
    with pytest.raises(ValueError, match=r"other layout options"):
        step(stale, (xs[0], ys[0]))
    step(state, (xs[0], ys[0]))  # its own tag trains on

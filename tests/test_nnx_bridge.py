"""flax NNX on the explicit path: merging a module from the params jaxsync hands a loss.

Issue #17 (item 5): a scanned NNX model on the explicit path (own ``shard_map``,
``jaxsync.value_and_grad(..., sync=tx)``) merged its module by hand with
``nnx.replace_by_pure_dict``; the stacked group reaches the loss as jaxsync's view,
not a dict, and flax failed with ``key in pure_dict not available in state:
('blocks',)`` and no hint. ``jaxsync.merge_module`` is the merge that takes views;
every jaxsync merge checks the keys first and names what is missing or extra.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.step.models.nnx_bridge import split_model
from tests.helpers import nnx_reference

ROWS, STEPS, LAYERS = 16, 2, 3


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class Net(nnx.Module):
    """Blocks stacked by nnx.vmap, run by jaxsync.scan_layers; a BatchNorm outside them."""

    def __init__(self, rngs: nnx.Rngs, batch_norm: bool = False):
        self.inp = nnx.Linear(6, 8, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(8, rngs)

        self.blocks = stack(rngs)
        self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=rngs) if batch_norm else None
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = jaxsync.scan_layers(self.blocks, lambda block, h: block(h), self.inp(x))
        return self.out(h if self.bn is None else self.bn(h))


def model_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def batches(steps: int = STEPS):
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal((ROWS, 6), np.float32), rng.standard_normal((ROWS, 3), np.float32))
        for _ in range(steps)
    ]


def zero_step(mesh, loss_fn, params):
    """The README's explicit ZeRO step with in-loop sync of the stacked blocks."""
    tx = jaxsync.distributed_optimizer(optax.adam(1e-2), axis_name="data", stacked="blocks")
    specs = tx.state_specs(params, mesh)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    def step(params, opt_state, batch):
        _, grads = jaxsync.value_and_grad(loss_fn, axis_name="data", sync=tx)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.sharded_init(params, mesh)


def test_hand_merge_of_the_view_says_what_to_do(mesh8):
    """The issue as reported: flax's error now carries a note naming the group and the fix."""
    graphdef, state = nnx.split(Net(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(state)
    sync = jaxsync.DataParallel("data", stacked="blocks")

    def loss_fn(params, batch):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, params)  # params["blocks"] is a jaxsync.LayerStack here
        return model_loss(nnx.merge(graphdef, st), batch)

    @partial(jax.shard_map, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P())
    def grads(params, batch):
        return jaxsync.value_and_grad(loss_fn, axis_name="data", sync=sync)(params, batch)[1]

    with pytest.raises(ValueError, match="pure_dict") as err:
        jax.eval_shape(grads, params, jaxsync.shard_batch(batches(1)[0], mesh8))  # traced only
    note = "\n".join(getattr(err.value, "__notes__", []))
    assert "['blocks']" in note and "jaxsync.merge_module" in note and "train_step" in note


def test_merge_module_trains_like_one_device_zero(mesh8):
    """The documented explicit path: merge_module takes the LayerStack view, scan_layers
    taps each layer (in-loop reduce-scatter), and the result is single-device Adam."""
    model = Net(nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)

    def loss_fn(params, batch):
        return model_loss(jaxsync.merge_module(graphdef, state, params=params), batch)

    step, opt_state = zero_step(mesh8, loss_fn, params)
    data = [jaxsync.shard_batch(b, mesh8) for b in batches()]
    step = step.lower(params, opt_state, data[0]).compile()
    # the in-loop sync is there: a reduce-scatter inside the backward loop
    sites = jaxsync.overlap_report(step).collectives
    assert any(s.kind == "reduce-scatter" and s.loop_role == "backward" for s in sites)
    for b in data:
        params, opt_state = step(params, opt_state, b)
    ref, _ = nnx_reference(Net(nnx.Rngs(0)), optax.adam(1e-2), model_loss, batches())
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, 3e-5, 3e-6), params, ref)


def test_merge_module_takes_fsdp_views(mesh8):
    """FSDP's sharded layers: merged inside FullyShard.value_and_grad, gathered per layer."""
    model = Net(nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    fs = jaxsync.fully_shard(
        params, axis_name="data", units=["inp", "out"], mesh=mesh8, stacked="blocks"
    )
    shards = fs.shard(params, mesh8)
    inner = optax.adam(1e-2)
    opt_state, opt_specs = fs.init_optimizer(inner, shards, mesh8)

    def loss_fn(shards, batch):
        return model_loss(jaxsync.merge_module(graphdef, state, params=fs.view(shards)), batch)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh8, in_specs=(fs.specs(), opt_specs, P("data")),
             out_specs=(fs.specs(), opt_specs))  # fmt: skip
    def step(shards, opt_state, batch):
        _, g = fs.value_and_grad(loss_fn, shards, batch)
        updates, opt_state = inner.update(g, opt_state, shards)
        return optax.apply_updates(shards, updates), opt_state

    data = batches()
    for b in data:
        shards, opt_state = step(shards, opt_state, jaxsync.shard_batch(b, mesh8))
    ref, _ = nnx_reference(Net(nnx.Rngs(0)), inner, model_loss, data)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, 3e-5, 3e-6), fs.unshard(shards), ref)


def test_merge_module_names_missing_and_extra_keys():
    """Caught before flax: both directions named, and the split to use."""
    model = Net(nnx.Rngs(0), batch_norm=True)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    everything = nnx.to_pure_dict(nnx.state(model))
    params = nnx.to_pure_dict(state)
    params["out"].pop("bias")
    params["head"] = {"kernel": jnp.zeros((8, 3))}
    with pytest.raises(ValueError) as err:
        jaxsync.merge_module(graphdef, state, rest, params=params)
    msg = str(err.value)
    assert "jaxsync.merge_module" in msg
    assert "missing [out.bias]" in msg and "unexpected [head.kernel]" in msg
    assert "nnx.split(model, nnx.Param)" in msg
    # the whole state (nnx.split(model) without a filter) passed as the params
    with pytest.raises(ValueError, match=r"state: unexpected \[bn.mean, bn.var\]"):
        jaxsync.merge_module(graphdef, state, rest, params=everything)
    with pytest.raises(TypeError, match="as `nnx.split` returns them"):
        jaxsync.merge_module(graphdef, nnx.to_pure_dict(state), params=params)


def test_merge_module_keeps_the_other_states():
    """Outside a step it is replace_by_pure_dict + nnx.merge: new params, the rest kept."""
    model = Net(nnx.Rngs(0), batch_norm=True)
    model.bn.mean[...] = jnp.full((8,), 2.0)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda x: x + 1.0, nnx.to_pure_dict(state))
    merged = jaxsync.merge_module(graphdef, state, rest, params=params)
    jax.tree.map(
        np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(merged, nnx.Param)), params
    )
    np.testing.assert_array_equal(merged.bn.mean[...], np.full((8,), 2.0))
    x = np.ones((4, 6), np.float32)
    np.testing.assert_allclose(merged(x), nnx.merge(graphdef, _replaced(state, params), rest)(x))


def _replaced(state, params):
    st = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(st, params)
    return st


def test_views_outside_a_step_are_refused():
    """A view merged outside the loss jaxsync differentiates has no scan to reach."""
    graphdef, state = nnx.split(Net(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(state)
    params["blocks"] = jaxsync.LayerStack(params["blocks"], None, None, None)
    with pytest.raises(ValueError, match=r"stacked group\(s\) \['blocks'\].*merge there"):
        jaxsync.merge_module(graphdef, state, params=params)


def test_train_step_merge_checks_keys():
    """The step's own merge (ModelDef.merge) names a mismatch instead of flax's error."""
    model_def, params, rest = split_model(Net(nnx.Rngs(0)))
    del params["inp"]
    with pytest.raises(ValueError, match=r"jaxsync.train_step: `params`.*missing \[inp.bias"):
        model_def.merge(params, rest)

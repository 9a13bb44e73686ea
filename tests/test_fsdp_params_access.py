"""``step.params(state)`` is the one accessor of an FSDP step's params (issue 41).

``state.params`` of a ``"fsdp"`` step holds each unit's flat, padded fp32 shard, and
units are named like the model's top-level params: ``"embed" in state.params``
answered True, ``state.params["embed"]`` gave a padded shard and a parameter count
read the padding too (84352 for 84288 in a ported trainer). It now answers no mapping
question, each naming ``step.params(state)``, and stays a pytree that ``jit``,
``jax.tree`` and a plain orbax save and restore take as before.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxsync

LR = 0.1


def params0():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "embed": jax.random.normal(k1, (13, 7)),
        "mlp": {"w": jax.random.normal(k2, (7, 5)), "b": jnp.zeros((5,))},
        "head": jax.random.normal(k3, (5, 3)),
    }


def loss_fn(p, batch):
    ids, y = batch
    h = jnp.tanh(p["embed"][ids] @ p["mlp"]["w"] + p["mlp"]["b"])
    return jnp.mean((h @ p["head"] - y) ** 2)


def batch(i):
    rng = np.random.default_rng(i)
    return rng.integers(0, 13, size=(16,)), rng.normal(size=(16, 3)).astype(np.float32)


@pytest.fixture
def fsdp(mesh8):
    step = jaxsync.train_step(loss_fn, optax.sgd(LR), mesh8, "fsdp")
    return step, step.init(params0())


def test_state_params_answers_no_mapping_question(fsdp):
    step, state = fsdp
    shards = state.params
    asks = {
        "'embed' in ...": lambda: "embed" in shards,
        "['embed']": lambda: shards["embed"],
        "keys()": lambda: shards.keys(),
        "items()": lambda: shards.items(),
        "values()": lambda: shards.values(),
        "get('embed')": lambda: shards.get("embed"),
        "iteration": lambda: list(shards),
        "len()": lambda: len(shards),
    }
    for what, ask in asks.items():
        with pytest.raises(TypeError, match=r"FsdpShards.*step\.params\(state\)") as e:
            ask()
        assert "embed" in str(e.value), what  # the units are listed
    # The one accessor: the params as the model wrote them, counted exactly.
    exact = sum(math.prod(x.shape) for x in jax.tree.leaves(params0()))
    got = step.params(state)
    assert "embed" in got and got["embed"].shape == (13, 7)
    assert sum(x.size for x in jax.tree.leaves(got)) == exact
    assert sum(x.size for x in jax.tree.leaves(shards)) > exact  # the shards hold padding
    assert set(shards.as_dict()) == set(shards.units) >= {"embed", "head"}


def test_jit_tree_and_plain_orbax_take_the_state(fsdp, tmp_path):
    """The state is a pytree as before: jit, tree_map, eval_shape, and a user's own
    orbax save and restore (at the same DP size) that the step trains on."""
    step, state = fsdp
    state, _ = step(state, batch(0))
    same = jax.jit(lambda s: jax.tree.map(lambda x: x, s))(state)
    assert jax.tree.structure(same) == jax.tree.structure(state)
    assert isinstance(jax.eval_shape(lambda s: s, state).params, jaxsync.FsdpShards)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "s", state)
    ckpt.wait_until_finished()
    like = step.init(params0())
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    restored = ckpt.restore(tmp_path / "s", target)
    assert isinstance(restored.params, jaxsync.FsdpShards)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    a, _ = step(restored, batch(1))
    b, _ = step(state, batch(1))
    jax.tree.map(np.testing.assert_array_equal, step.params(a), step.params(b))

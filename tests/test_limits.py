"""Documented limits are enforced: each case here trained silently wrong, or failed
deep inside optax or JAX, before it was checked. Every check names what is at fault
and says what to write instead."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from helpers import place_by_specs
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxsync


def stacked_params(key=0, layers=3, d=8):
    k = jax.random.split(jax.random.PRNGKey(key), 3)
    return {
        "inp": {"w": jax.random.normal(k[0], (4, d)) / 2},
        "blocks": {"w": jax.random.normal(k[1], (layers, d, d)) / 3, "g": jnp.ones((layers, d))},
        "head": {"w": jax.random.normal(k[2], (d, 2)) / 3},
    }


def stacked_loss(p, batch):
    x, y = batch
    h = x @ p["inp"]["w"]

    def body(h, layer):
        layer = jaxsync.tap(layer)
        return h + jnp.tanh(h @ layer["w"]) * layer["g"], None

    h, _ = jax.lax.scan(body, h, p["blocks"])
    return jnp.mean((h @ p["head"]["w"] - y) ** 2)


def batch(rows=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 4)).astype(np.float32), rng.normal(size=(rows, 2)).astype(
        np.float32
    )


MUON = {"muon": jaxsync.whole_matrices(optax.contrib.muon(0.02)), "adamw": optax.adamw(1e-3)}


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_muon_with_its_own_dimension_numbers_runs_as_written(mesh8, mode):
    """optax.contrib.muon as the user has it failed inside optax ("pytree structure
    error"), then was refused with a rewrite that trained another optimizer; now it
    runs as written (equal to one device: tests/test_muon_as_is.py)."""
    params = stacked_params()
    dims = jax.tree.map(
        lambda x: optax.contrib.MuonDimensionNumbers() if x.ndim == 2 else None, params
    )
    tx = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    step = jaxsync.train_step(stacked_loss, tx, mesh8, mode)
    state = step.init(params)
    state, loss = step(state, batch())
    assert np.isfinite(float(loss))


def test_global_norm_clipping_inside_whole_matrices_is_refused():
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(0.02))
    with pytest.raises(ValueError, match=r"optax.clip_by_global_norm.*clip_grad_norm="):
        jaxsync.whole_matrices(inner)
    jaxsync.whole_matrices(optax.chain(optax.clip(1.0), optax.contrib.muon(0.02)))  # per element


def test_muon_labels_refuses_a_stacked_typo():
    params = stacked_params()
    with pytest.raises(ValueError, match=r"`stacked` names \['block'\], which match no params"):
        jaxsync.muon_labels(params, stacked="block")
    assert jaxsync.muon_labels(params, stacked="blocks")["blocks"]["w"] == "muon"


def test_a_stack_owned_by_muon_needs_stacked(mesh8):
    """A [L, D, D] stack routed to Muon without `stacked=` ran Muon's Adam fallback."""
    params = stacked_params()
    labels = jax.tree_util.tree_map_with_path(
        lambda path, x: "muon" if "blocks" in jax.tree_util.keystr(path) and x.ndim == 3
        else "adamw", params,
    )  # fmt: skip

    def unscanned_loss(p, b):  # the same model, its stack read without taps
        x, y = b
        h = x @ p["inp"]["w"]
        for i in range(p["blocks"]["w"].shape[0]):
            h = h + jnp.tanh(h @ p["blocks"]["w"][i]) * p["blocks"]["g"][i]
        return jnp.mean((h @ p["head"]["w"] - y) ** 2)

    step = jaxsync.train_step(unscanned_loss, MUON, mesh8, labels=labels)
    with pytest.raises(ValueError, match=r"param blocks.w has shape \(3, 8, 8\).*pass `stacked=`"):
        step.init(params)
    step = jaxsync.train_step(stacked_loss, MUON, mesh8, labels=labels, stacked="blocks")
    state, _ = step(step.init(params), batch())  # with `stacked=` each layer is owned whole
    assert int(state.step) == 1


def _per_layer_muon_reference(params, labels, batches):
    """Single-device optax: Muon on each matrix, each layer of the stack on its own."""
    from jaxsync._src.optim.per_matrix import per_matrix

    tx = optax.multi_transform(
        {"muon": per_matrix(MUON["muon"].inner, ("blocks",)), "adamw": MUON["adamw"]}, labels
    )
    p, s = params, tx.init(params)
    for b in batches:
        u, s = tx.update(jax.grad(stacked_loss)(p, b), s, p)
        p = optax.apply_updates(p, u)
    return p


LABELS = {"inp": {"w": "adamw"}, "blocks": {"w": "muon", "g": "adamw"}, "head": {"w": "muon"}}


@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_whole_matrices_on_a_two_d_mesh_own_whole_matrices(mode):
    """On (data=4, model=2) the optimizer runs inside the data-manual step: Muon ran on
    each data rank's cut of a matrix (0.04 off), and on a stack as one 3-D array (its
    Adam fallback). Now each matrix is kept whole over the data axes (a model-split one
    whole by the compiler) and each layer of a stack is its own matrix."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = stacked_params()
    specs = jax.tree.map(lambda x: P(), params)
    specs["inp"]["w"], specs["head"]["w"] = P(None, "model"), P("model", None)
    step = jaxsync.train_step(stacked_loss, MUON, mesh, mode, labels=LABELS, stacked="blocks")
    state = step.init(place_by_specs(mesh, params, specs))
    batches = [batch()] * 3
    for b in batches:
        state, _ = step(state, b)
    want = _per_layer_muon_reference(params, LABELS, batches)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip


def test_ddp_runs_whole_matrices_layer_by_layer(mesh8):
    step = jaxsync.train_step(stacked_loss, MUON, mesh8, "ddp", labels=LABELS, stacked="blocks")
    state = step.init(stacked_params())
    batches = [batch()] * 3
    for b in batches:
        state, _ = step(state, b)
    want = _per_layer_muon_reference(stacked_params(), LABELS, batches)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip


def test_save_state_of_a_donated_state_names_the_donation(mesh8, tmp_path):
    step = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh8, stacked="blocks")
    state = step.init(stacked_params())
    new, _ = step(state, batch())  # `state` is donated here
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"donated to a training step"):
            ckpt.save_state(step, state)
        ckpt.save_state(step, new)


def test_restore_state_without_the_jaxsync_record_says_so(mesh8, tmp_path):
    import shutil

    step = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh8, "ddp", stacked="blocks")
    state = step.init(stacked_params())
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(step, state)
    shutil.rmtree(tmp_path / "0" / "jaxsync")
    with (
        jaxsync.Checkpointer(tmp_path) as ckpt,
        pytest.raises(jaxsync.CheckpointMismatchError, match=r"has no `jaxsync` item"),
    ):
        ckpt.restore_state(step, step.init(stacked_params()))


def test_an_empty_batch_is_not_a_step(mesh8):
    step = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh8, stacked="blocks")
    state = step.init(stacked_params())
    x, y = batch()
    with pytest.raises(ValueError, match=r"the batch has 0 rows"):
        step(state, (x[:0], y[:0]))


def test_two_d_step_on_an_explicit_mesh_says_to_use_auto():
    """jax.make_mesh's default axes are Explicit; a step the compiler partitions needs
    Auto ones (it failed inside a custom VJP's type check)."""
    require_devices(8)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = stacked_params()
    specs = jax.tree.map(lambda x: P(), params)
    specs["inp"]["w"] = P(None, "model")
    step = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh, stacked="blocks")
    with pytest.raises(ValueError, match=r"Explicit axes \['data', 'model'\].*AxisType.Auto"):
        step.init(place_by_specs(mesh, params, specs))


def _scale_by_name(key, factor):
    """A user's own transformation keyed by param names (nanodo's lr multipliers)."""

    def update(u, state, params=None):
        del params
        scaled = jax.tree_util.tree_map_with_path(
            lambda path, g: g * (factor if key in jax.tree_util.keystr(path) else 1.0), u
        )
        return scaled, state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize("mode", ["zero", "fsdp", "ddp"])
def test_a_name_keyed_transform_sees_names_or_is_refused(mesh8, mode):
    """Chained into a label's optimizer, a transform keyed by names never matched on
    the flat shards of zero and fsdp: it trained as if its multiplier were 1 (6e-2
    off). The probe now hands it the tree as optax does, so it is refused there; ddp,
    whose optimizer sees the real tree, trains equal to single-device optax."""
    from helpers import make_batches, mlp_loss, mlp_params, run_reference

    params = mlp_params(jax.random.PRNGKey(0))
    tx = {"a": optax.chain(_scale_by_name("['w']", 10.0), optax.sgd(0.1)), "b": optax.sgd(0.1)}
    labels = jax.tree.map(lambda x: "a" if x.ndim == 2 else "b", params)
    step = jaxsync.train_step(mlp_loss, tx, mesh8, mode, labels=labels)
    if mode != "ddp":
        with pytest.raises(ValueError, match=r"(?s)label 'a' is not elementwise.*keyed by param"):
            step.init(params)
        return
    batches = make_batches(jax.random.PRNGKey(1), steps=2, batch=16)
    state = step.init(params)
    for b in zip(*batches, strict=True):
        state, _ = step(state, b)
    want, _ = run_reference(optax.multi_transform(tx, labels), params, batches)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
        step.params(state), want,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "zero"])
def test_a_partial_save_of_a_step_state_warns(mesh8, mode, tmp_path):
    """Checkpointer.save(params=, opt_state=) of a DDP/FSDP step's state dropped its loss
    scale and skip counters without a word; ZeRO keeps them in its optimizer state."""
    import warnings

    step = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh8, mode, stacked="blocks")
    state, _ = step(step.init(stacked_params()), batch())
    kw = dict(params=state.params, opt_state=state.opt_state)
    with jaxsync.Checkpointer(tmp_path) as ckpt:
        if mode == "zero":
            # The stacked group is held in the optimizer's master shards: state.params
            # has no arrays for it, and saying so beats a layout error.
            with pytest.raises(TypeError, match=r"state.params\['blocks'\].*step.params\(state\)"):
                ckpt.save(1, **kw, tx=step.optimizer(state), mesh=mesh8)
            kw["params"] = step.params(state)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ckpt.save(1, **kw, tx=step.optimizer(state), mesh=mesh8)
            return
        with pytest.warns(jaxsync.PartialSaveWarning, match=r"(?s)state.guard.*save_state"):
            ckpt.save(1, **kw)


def test_a_constant_loss_scale_that_always_overflows_is_named_once(mesh8):
    import warnings

    step = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh8, "ddp", stacked="blocks",
                              loss_scale=1e38)  # fmt: skip
    state = step.init(stacked_params())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(12):
            state, _ = step(state, batch())
            jax.block_until_ready(state)  # the check reads a finished step's counter only
    named = [w for w in seen if issubclass(w.category, jaxsync.AlwaysSkippedWarning)]
    assert len(named) == 1 and "loss_scale=1e+38" in str(named[0].message)
    assert int(state.step) == 0 and int(state.metrics.skipped_steps) == 12
    # A scale that fits trains, and says nothing.
    fine = jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh8, "ddp", stacked="blocks",
                              loss_scale=1024.0)  # fmt: skip
    state = fine.init(stacked_params())
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsync.AlwaysSkippedWarning)
        for _ in range(10):
            state, _ = fine(state, batch())
            jax.block_until_ready(state)
    assert int(state.step) == 10


def test_multi_steps_inside_tx_points_to_microbatches(mesh8):
    """optax.MultiSteps works inside `tx` but syncs every microbatch: say so."""
    import warnings

    from jaxsync._src.step.builder import MultiStepsWarning

    for tx in (optax.MultiSteps(optax.sgd(0.1), 4), optax.MultiSteps(optax.sgd(0.1), 4)
               .gradient_transformation(), {"a": optax.MultiSteps(optax.sgd(0.1), 4)}):  # fmt: skip
        labels = None if not isinstance(tx, dict) else (lambda p: jax.tree.map(lambda _: "a", p))
        with pytest.warns(MultiStepsWarning, match=r"`microbatches=4`"):
            jaxsync.train_step(stacked_loss, tx, mesh8, "ddp", labels=labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultiStepsWarning)
        jaxsync.train_step(stacked_loss, optax.sgd(0.1), mesh8, microbatches=4)


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_a_mask_or_clip_inside_multi_steps_is_probed(mesh8, mode):
    """MultiSteps gives empty updates for k-1 steps, and a warmup from 0 empties the first
    inner step too: probed whole, a mask or a global-norm clip inside passed (the port of
    a real trainer ran in fsdp without its weight-decay mask). The probe looks inside."""
    import warnings

    lr = optax.linear_schedule(0.0, 1e-3, 4)
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    bad = (optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)), 2),
           optax.MultiSteps(optax.adamw(lr, mask=mask), 2))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxsync.MultiStepsWarning)
        for tx in bad:
            step = jaxsync.train_step(stacked_loss, tx, mesh8, mode)
            with pytest.raises(ValueError, match="not elementwise"):
                step.init(stacked_params())
        fine = jaxsync.train_step(stacked_loss, optax.MultiSteps(optax.adamw(lr), 2), mesh8, mode)
        fine.init(stacked_params())


def test_known_elementwise_optimizers_skip_the_probe():
    """The probe was most of init (3 of 3.4 s on the example GPT): an optimizer built only
    from optax's elementwise factories skips it; anything else is still probed."""
    from jaxsync._src.optim.elementwise import known_elementwise

    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    for tx in (optax.adamw(1e-3, weight_decay=0.1), optax.adamw(sched), optax.sgd(0.1, 0.9),
               optax.lion(1e-4), optax.rmsprop(1e-3), optax.adagrad(1e-2), optax.nadam(1e-3)):
        assert known_elementwise(tx)
    user = optax.GradientTransformation(lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s))
    for tx in (optax.adamw(1e-3, mask=lambda p: p), optax.chain(optax.clip_by_global_norm(1.0),
               optax.adam(1e-3)), optax.contrib.muon(0.02), optax.adafactor(1e-3),
               optax.lamb(1e-3), optax.MultiSteps(optax.adam(1e-3), 2), optax.noisy_sgd(0.1),
               optax.chain(user, optax.adam(1e-3)), _scale_by_name("w", 2.0)):  # fmt: skip
        assert not known_elementwise(tx)

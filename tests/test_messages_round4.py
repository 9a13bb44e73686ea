"""Messages that name the argument at fault and say what to do (#44, round 4).

Each case was a bare error of numpy, Python or JAX, or was accepted silently, before.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import mlp_loss

import jaxsync

needs_plugin = pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin and jax-cuda12-pjrt of the installed "
    "jaxlib's version (Linux x86-64); `make test` installs them",
)


# ------------------------------------------------------------ another mode's keyword
@pytest.mark.parametrize(
    ("mode", "key", "value", "owner"),
    [
        ("ddp", "reshard_after_forward", True, "jaxsync.FSDP or jaxsync.ZeRO"),
        ("ddp", "units", None, "jaxsync.FSDP"),
        ("fsdp", "bucket_size", None, "jaxsync.DDP or jaxsync.ZeRO"),
        ("fsdp", "deterministic", None, "jaxsync.DDP or jaxsync.ZeRO"),
        ("zero", "policy", None, "jaxsync.FSDP"),
    ],
)
def test_another_modes_keyword_at_its_default_is_refused(mesh8, mode, key, value, owner):
    # It was dropped silently although docs/train-step.md calls it an error.
    with pytest.raises(ValueError, match=rf"`{key}` is an option of {owner}, not of "
                       rf"mode='{mode}'\. Drop `{key}`"):  # fmt: skip
        jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, mode, **{key: value})


def test_own_modes_keyword_at_its_default_is_kept(mesh8):
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, "fsdp", reshard_after_forward=True)
    assert step.mode == jaxsync.FSDP()
    step = jaxsync.train_step(mlp_loss, optax.sgd(0.1), mesh8, "ddp", reduce_dtype=jnp.float32)
    assert step.mode == jaxsync.DDP()


# ------------------------------------------------------------------- gpu_topology
@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ({"": 8}, r"`axes` names must be non-empty strings.*got ''"),
        ({1: 8}, r"`axes` names must be non-empty strings.*got 1 in"),
        ({"data": -8}, r"`axes\['data'\]` must be a positive int .*got -8"),
        ({"data": 2.0, "model": 4}, r"`axes\['data'\]` must be a positive int .*got 2.0"),
        ({"data": True, "model": 8}, r"`axes\['data'\]` must be a positive int .*got True"),
    ],
)
def test_gpu_topology_names_a_bad_axis(axes, match):
    # '' and 1 were taken as axis names; a negative or float size got numpy's own error.
    with pytest.raises(ValueError, match=match):
        jaxsync.gpu_topology("h100", axes=axes)


def test_gpu_topology_names_a_bad_axes_or_count():
    with pytest.raises(TypeError, match=r"`axes` must be a mapping of mesh axis names"):
        jaxsync.gpu_topology("h100", axes=[("data", 8)])
    for arg, value in (("hosts", -1), ("hosts", 1.5), ("gpus_per_host", 0)):
        with pytest.raises(ValueError, match=rf"`{arg}` must be a positive int, got {value}"):
            jaxsync.gpu_topology("h100", **{arg: value})


# ---------------------------------------------------------------- schedule_report
class _NeverCompiled:
    """A lowered program whose compile fails the test: the checks come first."""

    def compile(self, *args, **kwargs):
        raise AssertionError("schedule_report compiled before checking its arguments")


def test_schedule_report_checks_its_arguments_before_compiling(tmp_path):
    lowered = _NeverCompiled()
    # 'no' was taken as True.
    with pytest.raises(TypeError, match=r"`twin` must be True or False, got 'no'"):
        jaxsync.schedule_report(lowered, twin="no")
    # A list was a bare TypeError from dict unpacking.
    with pytest.raises(TypeError, match=r"`options` must be a mapping of XLA option names"):
        jaxsync.schedule_report(lowered, options=["xla_gpu_enable_triton_gemm"])
    with pytest.raises(ValueError, match=r"`gpu` must be one of \['a100', 'h100', 'h200'\]"):
        jaxsync.schedule_report(lowered, gpu="b200")
    # An unwritable dump_dir was reported as "needs a GPU program".
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for where in (blocker, blocker / "dump"):
        with pytest.raises(ValueError, match=r"`dump_dir` .*a_file.* cannot be written"):
            jaxsync.schedule_report(lowered, dump_dir=str(where))


# ------------------------------------------------------------ communication_bound
def _tiny_loss(params, rows):
    return jnp.mean((rows @ params["w"]) ** 2)


TINY = {"w": jax.ShapeDtypeStruct((128, 256), jnp.float32)}
ROWS = jax.ShapeDtypeStruct((4, 128), jnp.float32)


@needs_plugin
def test_communication_bound_names_a_bad_axis_or_optimizer(monkeypatch):
    mesh = jaxsync.gpu_topology("h100", gpus_per_host=2)
    monkeypatch.setattr(jaxsync._src.gpu.bound, "schedule_report", _NeverCompiled().compile)
    bound = jaxsync.communication_bound
    # A bare KeyError('model').
    with pytest.raises(ValueError, match=r"`axis_name` must name the data axis of `mesh`, one "
                       r"of its axes \{'data': 2\}; got 'model'"):  # fmt: skip
        bound(_tiny_loss, TINY, ROWS, optax.sgd(0.1), mesh, axis_name="model")
    # An AttributeError from inside the pricing.
    with pytest.raises(TypeError, match=r"`optimizer` must be an optax.GradientTransformation"):
        bound(_tiny_loss, TINY, ROWS, None, mesh)
    # A factored optimizer was priced on one flat vector as if it were elementwise.
    with pytest.raises(
        ValueError, match=r"`optimizer` is not elementwise \(first seen for param \[.w.\]"
    ):
        bound(_tiny_loss, TINY, ROWS, optax.adafactor(1e-3), mesh)
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh"):
        bound(_tiny_loss, TINY, ROWS, optax.sgd(0.1), "h100")

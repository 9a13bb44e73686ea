"""Messages that name the argument at fault and say what to do (#44, round 4).

Each case was a bare error of numpy, Python or JAX, or was accepted silently, before.
"""


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

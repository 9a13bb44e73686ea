"""Test setup: 8 simulated CPU devices and shared helpers.

Strict dtype promotion is not turned on: optax itself mixes Python floats and
int32 counters (Adam's bias correction), which strict mode rejects.
"""

import os

# Must happen before jax is imported anywhere.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def require_devices(n: int) -> None:
    """Skips the calling test when fewer than ``n`` devices exist."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


@pytest.fixture
def mesh8():
    require_devices(8)
    return jax.make_mesh((8,), ("data",))

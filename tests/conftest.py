"""Test setup: 8 simulated CPU devices and shared helpers.

Strict dtype promotion is not turned on: optax itself mixes Python floats and
int32 counters (Adam's bias correction), which strict mode rejects.
"""

import os

# Must happen before jax is imported anywhere.
# The suite compiles hundreds of small programs per test (every eager op of a reference
# computation is one), and XLA:CPU's compile time dominates it: LLVM's optimisations
# and the MLIR fusion emitters cost more than the suite's programs ever win back at
# run time. Without them two of its longest tests take 63 s -> 37 s (no LLVM
# optimisations) -> 18.5 s (the older elemental emitters too), and the whole suite
# 24 -> 17.8 -> 11.9 min on 2 cores. Fast math stays off, but sums may round in another
# order: test_layerwise's Adafactor bound says where that showed, and tests of
# bitwise equality between programs of different shapes (deterministic mode at
# several DP sizes) run in a process of their own with XLA's defaults
# (``@pytest.mark.default_xla``): the elemental emitters round those 1 ulp apart
# (1.5e-8), the defaults do not. An XLA_FLAGS a user sets comes after ours and wins.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _jaxlib_before(major: int, minor: int) -> bool:
    from importlib.metadata import version

    return tuple(int(v) for v in version("jaxlib").split(".")[:2]) < (major, minor)


# XLA of jaxlib 0.11 dropped the elemental-emitter switch (an unknown flag aborts
# every process at its first jax call), so it is set only where XLA still reads it.
if _jaxlib_before(0, 11):
    _FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
#: Set in the process a ``default_xla`` test runs in.
_DEFAULT_XLA = "JAXSYNC_TESTS_DEFAULT_XLA"
# The user's own XLA_FLAGS, as the first pytest process found them: xdist's workers and
# the processes tests start inherit the XLA_FLAGS set below.
_USER_XLA_FLAGS = os.environ.setdefault(
    "JAXSYNC_TESTS_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
)
os.environ["XLA_FLAGS"] = (
    ("" if os.environ.get(_DEFAULT_XLA) else _FAST_COMPILE)
    + " --xla_force_host_platform_device_count=8 "
    + _USER_XLA_FLAGS
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit  # noqa: E402
import functools  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# The suite compiles the same small programs again and again (references rebuilt per
# test, the example trainer in every process it starts): one persistent compilation
# cache, fresh for each session, for this process and those it starts. Executables
# loaded from it keep their HLO text, which the collective-placement tests read.
_CACHE = tempfile.mkdtemp(prefix="jaxsync-tests-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
atexit.register(shutil.rmtree, _CACHE + "-default-xla", ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def require_devices(n: int) -> None:
    """Skips the calling test when fewer than ``n`` devices exist."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, have {jax.device_count()}")


@pytest.fixture
def mesh8():
    require_devices(8)
    return jax.make_mesh((8,), ("data",))


#: The longest files, longest first (`--durations` of a `make test` run): `make test`
#: gives each of its 2 xdist workers whole files (`--dist loadfile`) in collection
#: order, so these start first and the short files fill the end, not one long file
#: running alone on one core.
LONGEST_FIRST = (
    "test_layerwise.py", "test_multiprocess.py", "test_ready.py", "test_grad_rows.py",
    "test_faults.py",
    "test_unit_prints.py", "test_gpu_target.py", "test_sink.py", "test_muon_as_is.py",
    "test_step_metrics.py", "test_fsdp.py", "test_deterministic.py", "test_hang.py",
    "test_two_d_checkpoint.py", "test_rerun_devices.py", "test_two_d.py",
    "test_linen_port.py",
)  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    if not os.environ.get(_DEFAULT_XLA):
        for item in items:
            if item.get_closest_marker("default_xla"):
                item.runtest = functools.partial(_run_with_default_xla, item)


def _run_with_default_xla(item: pytest.Item) -> None:
    """Runs ``item`` alone in a new pytest process compiled with XLA's default options."""
    # A compilation cache of their own: the cache keys leave out some XLA flags, and an
    # executable the other processes compiled with the elemental emitters came back.
    env = {**os.environ, _DEFAULT_XLA: "1", "XLA_FLAGS": _USER_XLA_FLAGS,
           "JAX_COMPILATION_CACHE_DIR": _CACHE + "-default-xla"}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", item.nodeid]
    done = subprocess.run(
        cmd, cwd=item.config.rootpath, env=env, capture_output=True, text=True, timeout=1200
    )
    if done.returncode != 0:
        pytest.fail(
            f"{item.nodeid}, run in its own process with XLA's default options, failed:\n"
            f"{done.stdout[-8000:]}\n{done.stderr[-2000:]}",
            pytrace=False,
        )

"""Compile-only GPU meshes: see the program XLA builds for a GPU cluster, on a laptop.

jaxsync exists to overlap communication with compute on GPU meshes, and only the
GPU compiler shows whether it does: XLA:CPU runs collectives synchronously and
fuses differently. JAX can compile for a GPU topology without a GPU:
``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`` gives
compile-only devices from a *target config* (a ``GpuTargetConfigProto`` text:
what the compiler would otherwise read off the device), and
``jax.jit(f).lower(<ShapeDtypeStructs>).compile()`` then runs XLA's real GPU
pipeline (fusion, collective combiners and pipeliner, latency-hiding scheduler).
It needs ``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` of the installed jaxlib's
version (``pip install 'jaxsync[gpu-target]'``), no driver and no NVIDIA library.

The target configs are written here from each GPU's published figures (the
sources are in :data:`GPUS`), not copied from a device query; the fields the
compiler reads for fusion and cost decisions (SM count, clocks, memory size and
bandwidth, L2, shared memory, register file, compute capability) are the ones set.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = ["GPUS", "GpuSpec", "gpu_topology", "gpu_target_available"]


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler needs to know of one GPU model.

    Attributes:
      name: the CUDA device name (what ``nvidia-smi`` prints).
      compute_capability: ``(major, minor)``.
      sms: streaming multiprocessors.
      clock_ghz: boost clock of the SMs.
      memory_bytes: device memory usable by programs.
      memory_bandwidth: bytes per second of device memory.
      l2_bytes: L2 cache.
      shared_memory_per_sm: shared memory bytes per SM.
      shared_memory_per_block_optin: the most one block can opt into.
      nvlink_links: NVLink links per GPU (recorded; XLA's cost model does not read it).
      bf16_dense_tflops: published dense bf16 tensor-core peak (for reports only).
      source: where the numbers come from.
    """

    name: str
    compute_capability: tuple[int, int]
    sms: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float
    l2_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    nvlink_links: int
    bf16_dense_tflops: float
    source: str

    def target_config(self) -> str:
        """The ``GpuTargetConfigProto`` text for ``get_topology_desc(target_config=...)``."""
        major, minor = self.compute_capability
        return "\n".join([
            "gpu_device_info {",
            "  threads_per_block_limit: 1024",
            "  threads_per_warp: 32",
            "  shared_memory_per_block: 49152",
            f"  shared_memory_per_core: {self.shared_memory_per_sm}",
            "  threads_per_core_limit: 2048",
            f"  core_count: {self.sms}",
            "  fpus_per_core: 128" if major >= 9 else "  fpus_per_core: 64",
            "  block_dim_limit_x: 2147483647",
            "  block_dim_limit_y: 65535",
            "  block_dim_limit_z: 65535",
            f"  memory_bandwidth: {int(self.memory_bandwidth)}",
            f"  l2_cache_size: {self.l2_bytes}",
            f"  clock_rate_ghz: {self.clock_ghz}",
            f"  device_memory_size: {self.memory_bytes}",
            f"  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}",
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
            "  registers_per_core_limit: 65536",
            "  registers_per_block_limit: 65536",
            "}",
            'platform_name: "CUDA"',
            "dnn_version_info { major: 9 minor: 8 }",
            f'device_description_str: "{self.name}"',
        ])  # fmt: skip


_GIB = 2**30
# Per-SM limits of compute capability 8.0 and 9.0 (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"): 64K registers, 2048
# threads; shared memory 164 KB (8.0) / 228 KB (9.0) per SM, of which one block
# can opt into 163 KB / 227 KB.
GPUS: Mapping[str, GpuSpec] = {
    "h100": GpuSpec(
        name="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        sms=132,
        clock_ghz=1.98,
        memory_bytes=80 * _GIB,
        memory_bandwidth=3.35e12,
        l2_bytes=50 * 2**20,
        shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024,
        nvlink_links=18,
        bf16_dense_tflops=989.0,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 132 SMs, 1.98 GHz boost, 80 GB "
        "HBM3 at 3.35 TB/s, 50 MB L2, NVLink 4 x18 = 900 GB/s, 989 dense bf16 TFLOP/s)",
    ),
    "h200": GpuSpec(
        name="NVIDIA H200",
        compute_capability=(9, 0),
        sms=132,
        clock_ghz=1.98,
        memory_bytes=141 * 10**9,
        memory_bandwidth=4.8e12,
        l2_bytes=50 * 2**20,
        shared_memory_per_sm=228 * 1024,
        shared_memory_per_block_optin=227 * 1024,
        nvlink_links=18,
        bf16_dense_tflops=989.0,
        source="NVIDIA H200 datasheet (SXM: the H100's GH100 die and clocks, 141 GB HBM3e at "
        "4.8 TB/s, NVLink 900 GB/s, 989 dense bf16 TFLOP/s)",
    ),
    "a100": GpuSpec(
        name="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0),
        sms=108,
        clock_ghz=1.41,
        memory_bytes=80 * _GIB,
        memory_bandwidth=2.039e12,
        l2_bytes=40 * 2**20,
        shared_memory_per_sm=164 * 1024,
        shared_memory_per_block_optin=163 * 1024,
        nvlink_links=12,
        bf16_dense_tflops=312.0,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 108 SMs, 1.41 GHz boost, "
        "HBM2e at 2,039 GB/s, 40 MB L2, NVLink 3 x12 = 600 GB/s, 312 dense bf16 TFLOP/s)",
    ),
}

_NO_PLUGIN = (
    "compiling for a GPU without one needs the CUDA plugin of the installed jaxlib "
    "({version}): pip install 'jax-cuda12-plugin=={version}' 'jax-cuda12-pjrt=={version}' "
    "(or 'jaxsync[gpu-target]'; Linux x86-64 only). No driver or NVIDIA library is needed."
)


def gpu_target_available() -> bool:
    """Whether the CUDA plugin that compile-only GPU meshes need is installed."""
    try:  # jax[cuda12] or jax[cuda13]; no jax_plugins package at all raises
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
    except ModuleNotFoundError:
        return False


def gpu_kind(mesh: Mesh) -> str | None:
    """The key of :data:`jaxsync.GPUS` whose GPU ``mesh``'s devices are (by their
    ``device_kind``); None for another device."""
    return {s.name: key for key, s in GPUS.items()}.get(mesh.devices.flat[0].device_kind)


def gpu_topology(
    kind: str = "h100",
    *,
    hosts: int = 1,
    gpus_per_host: int = 8,
    axes: Mapping[str, int] | None = None,
) -> Mesh:
    """A compile-only mesh of ``hosts x gpus_per_host`` GPUs of one ``kind``.

    Lower and compile a step against it from ``jax.ShapeDtypeStruct``s to see the
    program XLA would run on that cluster: its schedule and modeled time
    (:func:`jaxsync.schedule_report`), its memory per GPU
    (``compiled.memory_analysis()``). Nothing can run on it. Set
    ``jax.config.update("jax_platforms", "cpu")`` (or ``JAX_PLATFORMS=cpu``) on a
    machine without a GPU so JAX does not try to start the CUDA client.

    Args:
      kind: a key of :data:`jaxsync.GPUS` (``"h100"``, ``"h200"``, ``"a100"``) or a
        :class:`GpuSpec`.
      hosts: number of hosts (processes); devices are ordered host by host.
      gpus_per_host: GPUs per host.
      axes: mesh axis names and sizes, major to minor, whose product is the device
        count; default ``{"data": hosts * gpus_per_host}``.

    Returns:
      A ``jax.sharding.Mesh`` of compile-only devices.

    Raises:
      ValueError: an unknown ``kind``; ``hosts`` or ``gpus_per_host`` not a positive
        int; an ``axes`` name that is not a non-empty str, a size that is not a
        positive int, or sizes whose product is not the device count.
      TypeError: ``axes`` is not a mapping.

    Example:
      >>> mesh = jaxsync.gpu_topology("h100", hosts=8, gpus_per_host=8)
      >>> step = jaxsync.train_step(loss_fn, optax.adamw(1e-4), mesh)
      >>> state = step.abstract_state(param_shapes)
      >>> report = jaxsync.schedule_report(step.lower(state, batch_shapes))
    """
    spec = kind if isinstance(kind, GpuSpec) else GPUS.get(kind)
    if spec is None:
        raise ValueError(
            f"`kind` must be one of {sorted(GPUS)} or a jaxsync.GpuSpec, got {kind!r}."
        )
    for arg, value in (("hosts", hosts), ("gpus_per_host", gpus_per_host)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"`{arg}` must be a positive int, got {value!r}.")
    hosts, gpus_per_host = int(hosts), int(gpus_per_host)
    total = hosts * gpus_per_host
    axes = _check_axes(axes) if axes is not None else {"data": total}
    if not axes or math.prod(axes.values()) != total:
        raise ValueError(
            f"`axes` {axes} must multiply to the device count {total} "
            f"(hosts={hosts} x gpus_per_host={gpus_per_host})."
        )
    devices = _devices(spec, hosts, gpus_per_host)
    return Mesh(np.asarray(devices).reshape(tuple(axes.values())), tuple(axes))


def _check_axes(axes: Any) -> dict[str, int]:
    """``axes`` as a dict, each name a non-empty str and each size a positive int."""
    example = "e.g. {'data': 8} or {'data': 2, 'model': 4}"
    if not isinstance(axes, Mapping):
        raise TypeError(
            f"`axes` must be a mapping of mesh axis names to sizes, {example}; "
            f"got {type(axes).__name__} {axes!r}."
        )
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"`axes` names must be non-empty strings (they become the mesh's axis names "
                f"that `axis_name=` refers to), got {name!r} in {axes!r}; {example}."
            )
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(
                f"`axes[{name!r}]` must be a positive int (the axis size), got {size!r}; {example}."
            )
    return {name: int(size) for name, size in axes.items()}


@functools.cache
def _devices(spec: GpuSpec, hosts: int, gpus_per_host: int) -> tuple:
    if not gpu_target_available():
        raise RuntimeError(_NO_PLUGIN.format(version=jax.__version__))
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=spec.target_config(), topology=f"1x{hosts}x{gpus_per_host}"
    )
    # Host-major, as jax.make_mesh orders real devices: the data axis then crosses
    # hosts last, and a minor axis of size gpus_per_host stays inside a host.
    return tuple(sorted(topology.devices, key=lambda d: (d.process_index, d.id)))

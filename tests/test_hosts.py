"""Which hosts a reduction spans, read from the devices of the mesh a step runs on.

A reduction in one host gets the choices that pay only over NVLink (the all-to-all
sum, FSDP's halves, FSDP's head gradient reduced before the backward loop); one that
leaves it (more ranks than a host holds, or ranks in more than one process) gets the
ring, whole. Eight ranks over two hosts of four are across hosts, though eight ranks
fit in one.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxsync
from jaxsync._src.core.hosts import ONE_HOST_RANKS, across_hosts, hosts_spanned

needs_plugin = pytest.mark.skipif(
    not jaxsync.gpu_target_available(),
    reason="compile-only GPU meshes need jax-cuda12-plugin (`make test` installs it)",
)


@needs_plugin
def test_the_hosts_an_axis_spans_come_from_its_devices_processes():
    one = jaxsync.gpu_topology("h100")
    two = jaxsync.gpu_topology("h100", hosts=2, gpus_per_host=4)
    assert (hosts_spanned(one, ("data",)), across_hosts(one, ("data",))) == (1, False)
    assert (hosts_spanned(two, ("data",)), across_hosts(two, ("data",))) == (2, True)
    # data outermost over two hosts of four: each data group spans both hosts, each
    # model group stays in one
    grid = jaxsync.gpu_topology("h100", hosts=2, gpus_per_host=4, axes={"data": 2, "model": 4})
    assert (hosts_spanned(grid, ("data",)), hosts_spanned(grid, ("model",))) == (2, 1)
    assert across_hosts(grid, ("data", "model")) and not across_hosts(grid, ("model",))
    # more ranks than one host holds are across hosts, whatever the processes say
    many = jaxsync.gpu_topology("h100", gpus_per_host=16)
    assert hosts_spanned(many, ("data",)) == 1 and ONE_HOST_RANKS < 16
    assert across_hosts(many, ("data",))


def _layer_loss(params, x):
    def body(h, w):
        w = jaxsync.tap(w)
        return h + jnp.tanh(h @ w["a"]) @ w["b"], None

    h, _ = jax.lax.scan(jax.checkpoint(body), x, params["blocks"])
    return jnp.mean(jnp.square(h))


def _reduce_scatters(mesh) -> int:
    d = 128
    shapes = {"blocks": {"a": jax.ShapeDtypeStruct((4, d, 2 * d), jnp.float32),
                         "b": jax.ShapeDtypeStruct((4, 2 * d, d), jnp.float32)}}  # fmt: skip
    step = jaxsync.train_step(_layer_loss, optax.sgd(0.1), mesh, "fsdp", stacked="blocks")
    batch = jax.ShapeDtypeStruct((64, d), jnp.float32)
    return step.lower(step.abstract_state(shapes), batch).as_text().count("reduce_scatter")


@needs_plugin
def test_fsdp_halves_a_layers_reduction_in_one_host_not_over_two_hosts_of_four():
    """Eight ranks either way; only the devices' processes differ. In one host the
    layer's gradient is reduced a half at a time (one more reduce-scatter per layer);
    over two hosts of four it is reduced whole."""
    one = _reduce_scatters(jaxsync.gpu_topology("h100"))
    two = _reduce_scatters(jaxsync.gpu_topology("h100", hosts=2, gpus_per_host=4))
    assert one == two + 1, (one, two)

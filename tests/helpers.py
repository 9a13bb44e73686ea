"""Small models and reference training loops shared by the tests."""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import jaxsync


def mlp_params(key, sizes=(12, 33, 17, 5), dtype=jnp.float32):
    """A small MLP with odd sizes, so params never divide evenly over ranks."""
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, k1, k2 = jax.random.split(key, 3)
        params[f"layer{i}"] = {
            "w": (jax.random.normal(k1, (a, b)) / np.sqrt(a)).astype(dtype),
            "b": (0.1 * jax.random.normal(k2, (b,))).astype(dtype),
        }
    params["scale"] = jnp.ones((), dtype)
    return params


def mlp_loss(params, batch):
    x, y = batch
    h = x.astype(jnp.float32)
    n = len([k for k in params if k.startswith("layer")])
    for i in range(n):
        layer = params[f"layer{i}"]
        h = h @ layer["w"].astype(jnp.float32) + layer["b"].astype(jnp.float32)
        if i < n - 1:
            h = jnp.tanh(h)
    h = h * params["scale"].astype(jnp.float32)
    return jnp.mean((h - y) ** 2)


def mlp_forward(params, x):
    """:func:`mlp_params`' three-layer model (as :func:`mlp_loss` runs it, in the
    params' dtype): its output rows."""
    h = x
    for i in range(3):
        h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
        h = jnp.tanh(h) if i < 2 else h
    return h * params["scale"]


def make_batches(key, steps, batch, sizes=(12, 33, 17, 5)):
    kx, ky = jax.random.split(key)
    xs = jax.random.normal(kx, (steps, batch, sizes[0]))
    ys = jax.random.normal(ky, (steps, batch, sizes[-1]))
    return xs, ys


def state_bytes_on_device(tree, device) -> int:
    """Bytes of ``tree``'s arrays resident on ``device`` (read from addressable shards)."""
    return sum(
        s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
        if s.device == device
    )  # fmt: skip


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Buffers communicated per collective kind in compiled HLO."""
    return {k: v.count for k, v in jaxsync.collective_stats(hlo_text).items()}


count_lowered_collectives = jaxsync.lowered_collective_counts


def sharded_step(mesh, tx, params, loss_fn=mlp_loss, axis="data", scale_loss=False, donate=False):
    """The jitted shard_map training step of a jaxsync sharded optimizer."""
    import optax
    from jax.sharding import PartitionSpec as P

    specs = tx.state_specs(params, mesh)

    @partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(axis)), out_specs=(P(), specs))
    def step(params, state, batch):
        def scaled(p, b):
            loss = loss_fn(p, b)
            return loss * state.loss_scale.scale.astype(loss.dtype) if scale_loss else loss

        _, grads = jaxsync.value_and_grad(scaled, axis_name=axis)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def run_sharded(mesh, tx, params, batches, loss_fn=mlp_loss, axis="data", scale_loss=False):
    """Trains with a jaxsync sharded optimizer inside shard_map; returns params, state."""
    state = tx.sharded_init(params, mesh)
    step = sharded_step(mesh, tx, params, loss_fn, axis, scale_loss)
    xs, ys = batches
    for i in range(xs.shape[0]):
        batch = jaxsync.shard_batch((xs[i], ys[i]), mesh, axis_name=axis)
        params, state = step(params, state, batch)
    return params, state


def run_reference(opt, params, batches, loss_fn=mlp_loss, master_dtype=None):
    """Plain optax on one device; with ``master_dtype`` an fp32 master copy is kept."""
    import optax

    master = (
        params if master_dtype is None else jax.tree.map(lambda p: p.astype(master_dtype), params)
    )
    state = opt.init(master)

    @jax.jit
    def step(master, state, batch):
        model = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
        grads = jax.grad(loss_fn)(model, batch)
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
        updates, state = opt.update(grads, state, master)
        return optax.apply_updates(master, updates), state

    xs, ys = batches
    for i in range(xs.shape[0]):
        master, state = step(master, state, (xs[i], ys[i]))
    return jax.tree.map(lambda m, p: m.astype(p.dtype), master, params), master


# --------------------------------------------------------------- scanned model
def scanned_params(key, layers=4, din=5, d=16, hidden=24, dout=3, dtype=jnp.float32):
    """Residual tanh-MLP blocks stacked ``[L, ...]`` (as lax.scan runs them)."""
    ks = jax.random.split(key, 6)
    params = {
        "inp": {"w": jax.random.normal(ks[0], (din, d)) / np.sqrt(din)},
        "blocks": {
            "w1": jax.random.normal(ks[1], (layers, d, hidden)) / np.sqrt(d),
            "b1": 0.1 * jax.random.normal(ks[2], (layers, hidden)),
            "w2": jax.random.normal(ks[3], (layers, hidden, d)) / np.sqrt(hidden),
            "g": 1.0 + 0.1 * jax.random.normal(ks[4], (layers, d)),
        },
        "head": {"w": jax.random.normal(ks[5], (d, dout)) / np.sqrt(d)},
    }
    return jax.tree.map(lambda p: p.astype(dtype), params)


def scanned_block(p, h):
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    return h + jnp.tanh(h @ f32(p["w1"]) + f32(p["b1"])) @ f32(p["w2"]) * f32(p["g"])


def scanned_loss(params, batch):
    """The model as large JAX models write it: scan over the stack, remat per layer."""
    x, y = batch
    h = x.astype(jnp.float32) @ params["inp"]["w"].astype(jnp.float32)

    def body(h, p):
        p = jaxsync.tap(p)  # identity outside jaxsync's in-loop sync
        return scanned_block(p, h), None

    h, _ = jax.lax.scan(jax.checkpoint(body), h, params["blocks"])
    out = h @ params["head"]["w"].astype(jnp.float32)
    return jnp.mean((out - y) ** 2)


def scanned_batches(key, steps, batch, din=5, dout=3):
    kx, ky = jax.random.split(key)
    return (
        jax.random.normal(kx, (steps, batch, din)),
        jax.random.normal(ky, (steps, batch, dout)),
    )


def nnx_reference(model, opt, loss_fn, batches):
    """``opt`` on one device over ``batches`` for a flax NNX ``model``, with
    ``loss_fn(model, batch)``: ``(params as a pure dict, last gradient norm)``."""
    import optax
    from flax import nnx

    graphdef, state = nnx.split(model, nnx.Param)

    def loss(params, batch):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, params)
        return loss_fn(nnx.merge(graphdef, st), batch)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    params = nnx.to_pure_dict(state)
    opt_state = opt.init(params)
    norm = None
    for b in batches:
        params, opt_state, norm = step(params, opt_state, b)
    return params, norm


def place_by_specs(mesh, params, specs):
    """``params`` put on ``mesh`` with their PartitionSpecs (a tree of P like params)."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )  # fmt: skip


def local_shapes(tree) -> dict[str, tuple[int, ...]]:
    """Each leaf's per-device shape, by dotted path."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        ".".join(str(k.key) for k in path): x.addressable_shards[0].data.shape for path, x in flat
    }


def launch(tmp_path, job: str, *args: str, timeout: float = 120):
    """``job`` (a script's text) run by ``python -m jaxsync.launch`` on 2 processes x 2
    CPU devices, given the tests folder (for ``helpers``) and ``args``: the
    ``subprocess.CompletedProcess``, output captured."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "job.py"
    script.write_text(job)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # fmt: skip
    for var in ("JAXSYNC_LAUNCH_DIR", "JAXSYNC_HANG_TIMEOUT", "JAXSYNC_FIRST_STEP_TIMEOUT"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "jaxsync.launch", "--nproc", "2", "--devices-per-proc", "2",
         str(script), os.path.join(root, "tests"), *args],
        cwd=root, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def lower_on_h100s(fn, *shapes, gpus=2):
    """``fn`` inside shard_map over ``gpus`` compile-only H100s (axis "data"), every
    input replicated: ``shapes`` are ``(shape, dtype)`` pairs. Returns the Lowered."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jaxsync.gpu_topology("h100", hosts=1, gpus_per_host=gpus)
    sh = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                      check_vma=False)  # fmt: skip
    return jax.jit(f).lower(*args)


def train_beside_optax(step, state, tx, ref, loss_fn, batches):
    """Runs ``step`` and plain ``tx`` on one device (from params ``ref``) on the same
    global batches, checking each step's loss against the one-device loss; returns
    ``(state, ref)`` after the last step."""
    import optax

    opt = tx.init(ref)
    for batch in batches:
        state, loss = step(state, batch)
        ref_loss, g = jax.value_and_grad(loss_fn)(ref, batch)
        upd, opt = tx.update(g, opt, ref)
        ref = optax.apply_updates(ref, upd)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    return state, ref


def lowered_llama_step(mesh, mode, *, param_dtype=None, size="quick"):
    """``benchmarks/llama.py``'s scanned model (bf16 compute, AdamW, ``stacked="blocks"``)
    as a ``mode`` step lowered for ``mesh`` (compile-only GPUs too) on abstract state and
    tokens: the programs the tests of the gradient program's rewrites compile.
    ``param_dtype``: the params' dtype (default: the model's fp32); ``size``: a name in
    ``llama.SIZES`` or a ``llama.Config``."""
    import os
    import sys

    import optax

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import llama

    cfg = llama.SIZES[size] if isinstance(size, str) else size
    loss = partial(llama.scanned_loss, heads=cfg.heads, kv_heads=cfg.kv_heads, dtype=jnp.bfloat16)
    step = jaxsync.train_step(loss, optax.adamw(1e-4), mesh, mode, stacked="blocks")
    shapes = jax.eval_shape(lambda: llama.device_params(cfg))
    if param_dtype is not None:
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, param_dtype), shapes)
    tokens = jax.ShapeDtypeStruct((mesh.size * cfg.batch_per_device, cfg.seq + 1), jnp.int32)
    return step.lower(step.abstract_state(shapes), tokens)


@contextlib.contextmanager
def backward_rows_seen():
    """Within it, a list that records, for each gradient the library takes, whether
    ``program/grad_rows.py`` rewrote its backward loop: then the loop runs ``L - 1``
    times and the backward's last layer is reduced after it; else ``L`` times."""
    from jaxsync._src.program import grad_program

    seen: list[bool] = []
    real = grad_program.grads_in_activation_rows

    def spy(closed):
        out = real(closed)
        seen.append(out is not closed)
        return out

    grad_program.grads_in_activation_rows = spy
    try:
        yield seen
    finally:
        grad_program.grads_in_activation_rows = real

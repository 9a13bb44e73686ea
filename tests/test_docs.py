"""Every Python block of README.md and of the docs pages (docs/**/*.md) runs, so
neither can rot.

Each page's blocks run in page order in one namespace of their own, as a reader
goes through the page: its first block's imports and ``mesh`` serve the later
ones; nothing carries over from one page to another. What a page leaves to the
reader (a model, a batch: "params, loss_fn and batch are your model and data")
comes from a *setup* named by an HTML comment right before the block,
``<!-- readme-test: NAME -->``; after the block, NAME's *check* asserts what the
block claims (the step ran, loss finite, params equal to the same optimizer on
one device, a restore gave back what was saved). NAMEs are unique over all pages.

Directives, each on the line right before a fence:

- ``<!-- readme-test: NAME -->``: run with ``SPECS[NAME]``'s setup and check.
- ``<!-- readme-test: raises ValueError -->`` (optionally after NAME): the block
  must raise this exception (a builtin or a ``jaxsync`` name).
- ``<!-- not run: REASON -->``: the block is skipped, and reported with REASON. A
  REASON that says ``same as PAGE.md`` promises a block of PAGE.md with the same
  code that runs; the test holds it to that.

A Python block without a directive runs too, with no setup. Running one block
alone (``pytest -k``) runs the blocks of its page before it first, since it
continues them.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib.util
import os
import re
import sys
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxsync
from jaxsync._src.multihost import distributed
from tests.helpers import mlp_loss, mlp_params, nnx_reference, scanned_loss, scanned_params

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: README.md, then every docs page (by path)
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
ROWS = 16  # global batch: 2 rows per simulated device

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*(readme-test|not run)\s*:\s*(.*?)\s*-->\s*$")


# ------------------------------------------------------------------- parsing
@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str  # path from the repository root: README.md, docs/fsdp.md
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    name: str | None = None  # SPECS key from `<!-- readme-test: NAME -->`
    raises: str | None = None  # `<!-- readme-test: raises Exc -->`
    not_run: str | None = None  # reason from `<!-- not run: REASON -->`

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}" + (f"-{self.name}" if self.name else "")

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def parse_page(text: str, page: str = "README.md") -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{start + 1}: code block never closed")
        # Line numbers of the code stay those of the page, for tracebacks.
        code = "\n" * (start + 1) + "\n".join(lines[start + 1 : end]) + "\n"
        kwargs: dict[str, Any] = {}
        d = _DIRECTIVE.match(lines[start - 1]) if start else None
        if d and d[1] == "not run":
            kwargs["not_run"] = d[2]
        elif d:
            words = d[2].split()
            if "raises" in words:
                k = words.index("raises")
                if k + 2 != len(words):
                    raise ValueError(f"{page}:{start}: write `raises ExceptionName` last")
                kwargs["raises"] = words[k + 1]
                words = words[:k]
            if len(words) > 1:
                raise ValueError(f"{page}:{start}: one name per directive, got {d[2]!r}")
            kwargs["name"] = words[0] if words else None
        blocks.append(Block(page, start + 1, m[1].lower(), code, **kwargs))
        i = end + 1
    return blocks


BLOCKS = {rel(p): parse_page(p.read_text(), rel(p)) for p in PAGES}
PYTHON = {
    page: [b for b in blocks if b.lang in ("python", "py")] for page, blocks in BLOCKS.items()
}
ALL_BLOCKS = [b for blocks in BLOCKS.values() for b in blocks]
ALL_PYTHON = [b for blocks in PYTHON.values() for b in blocks]


# --------------------------------------------------------------- the helpers
def close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def changed(a: Any, b: Any) -> bool:
    return any(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def one_step(opt: optax.GradientTransformation, loss_fn: Callable, params: Any, batch: Any) -> Any:
    """The reference: one step of ``opt`` on one device, on the whole batch."""

    @jax.jit
    def step(params, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates)

    return step(jax.device_get(params), batch)  # off the mesh the step's outputs are on


def normal(seed: int, *shape: int, scale: float = 1.0) -> jax.Array:
    """numpy randomness: jax.random would compile one XLA program per shape."""
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def random_like(init: Callable, seed: int) -> Any:
    """Random params shaped like the test helper ``init(key)`` builds them."""
    shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32))
    leaves, treedef = jax.tree.flatten(shapes)
    scaled = [normal(seed + i, *x.shape, scale=0.5) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, scaled)


def shard_fraction(x: jax.Array) -> float:
    """The part of ``x`` that one device holds."""
    return x.addressable_shards[0].data.size / x.size


# ------------------------------------------------------- setups and checks
# Each block's setup adds what the page's prose describes but does not spell
# out; its check asserts what the block claims. ``ctx`` keeps values between them
# (one ``ctx`` per page; ``ctx.blocks`` are the page's blocks).


def setup_quickstart(ns: dict, ctx: SimpleNamespace) -> None:
    # The block sets XLA_FLAGS for a fresh process; jax is imported here already
    # (with 8 devices): keep the suite's own flags for the processes it starts.
    ctx.xla_flags = os.environ.get("XLA_FLAGS")


def nnx_params(model: Any) -> Any:
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def check_quickstart(ns: dict, ctx: SimpleNamespace) -> None:
    from flax import nnx

    if ctx.xla_flags is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = ctx.xla_flags
    state, data = ns["state"], ns["data"]
    assert all(shard_fraction(m) == 1 / 8 for m in state.opt_state.master)  # ZeRO
    # the same model on one device, with optax.adamw(1e-2) on the same batches
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(8, 32, rngs=rngs), nnx.tanh, nnx.Linear(32, 1, rngs=rngs))
    batches = [(x, np.sin(x).sum(1, keepdims=True)) for x in data]
    first = float(ns["loss_fn"](model, batches[0]))
    ref, _ = nnx_reference(model, optax.adamw(1e-2), ns["loss_fn"], batches)
    close(nnx_params(ns["model"]), ref, rtol=1e-4, atol=1e-5)
    assert isinstance(ns["model"], nnx.Sequential) and float(ns["loss"]) < first / 2


def check_train_step(ns: dict, ctx: SimpleNamespace) -> None:
    np.testing.assert_allclose(ns["loss"], mlp_loss(ctx.params, ns["batch"]), rtol=1e-5)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-4))
    close(ns["params"], one_step(ref, mlp_loss, ctx.params, ns["batch"]))
    state = ns["state"]
    assert int(state.step) == 1 and float(state.metrics.grad_norm) > 0
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(ns["params"]))


def check_trainer_metrics(ns: dict, ctx: SimpleNamespace) -> None:
    # the page's settings (adamw with the schedule, clip 1.0), one step on one device
    params = jax.device_get(ctx.params)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(ns["schedule"]))
    grads = jax.grad(mlp_loss)(params, ns["batch"])
    updates, _ = tx.update(grads, tx.init(params), params)
    m = jax.device_get(ns["state"].metrics)
    np.testing.assert_allclose(m.update_norm, optax.tree.norm(updates), rtol=1e-5)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(m.param_norm, optax.tree.norm(new), rtol=1e-5)
    np.testing.assert_allclose(m.learning_rate, ns["schedule"](0), rtol=1e-6)


def setup_state_checkpoint(ns: dict, ctx: SimpleNamespace) -> None:
    # the training step page's run (its train_step block), 8 devices
    setup_ddp(ns, ctx)
    step = jaxsync.train_step(
        mlp_loss, optax.adam(3e-4), ns["mesh"], mode="ddp", microbatches=2, clip_grad_norm=1.0
    )
    state, _ = step(step.init(ns["params"]), ns["batch"])
    ns.update(step=step, state=state, params=step.params(state))


def check_state_checkpoint(ns: dict, ctx: SimpleNamespace) -> None:
    r, state, state4 = ns["restored"], ns["state"], ns["state4"]
    assert isinstance(r, jaxsync.RestoredState) and r.meta == {"data_position": 1}
    assert int(state4.step) == int(state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, ns["step4"].params(state4), ns["params"])
    jax.tree.map(np.testing.assert_array_equal, state4.opt_state, state.opt_state)
    jax.tree.map(np.testing.assert_array_equal, state4.guard, state.guard)
    assert all(x.sharding.mesh.devices.size == 4 for x in jax.tree.leaves(state4))
    state4, loss = ns["step4"](state4, ns["batch"])  # it trains on, on 4 devices
    assert int(state4.step) == 2 and np.isfinite(float(loss))


def nnx_mse(model: Any, batch: Any) -> jax.Array:
    """The quick start's ``loss_fn(model, batch)``."""
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def setup_nnx_scanned(ns: dict, ctx: SimpleNamespace) -> None:
    ns["loss_fn"] = nnx_mse
    ns["batch"] = (normal(104, ROWS, 8), normal(105, ROWS, 1))


def check_nnx_scanned(ns: dict, ctx: SimpleNamespace) -> None:
    from flax import nnx

    step, state, batch = ns["step"], ns["state"], ns["batch"]
    ref, _ = nnx_reference(ns["Net"](4, nnx.Rngs(1)), optax.adamw(1e-2), ns["loss_fn"], [batch])
    close(nnx_params(step.model(state)), ref)
    # FSDP: params, Adam state and the stacked unit [layers, shard] all 1/8 per device
    assert state.params.as_dict()["blocks"].addressable_shards[0].data.shape[0] == 4
    assert all(shard_fraction(x) == 1 / 8 for x in jax.tree.leaves(state.params))


def check_two_d(ns: dict, ctx: SimpleNamespace) -> None:
    step, state, host = ns["step2"], ns["state2"], ns["host"]
    local = lambda x: x.addressable_shards[0].data.shape  # noqa: E731
    assert local(state.params["up"]) == (8, 32) and local(state.params["down"]) == (32, 1)
    assert local(state.opt_state.master["up"]) == (2, 32)  # 1/4 over data, 1/2 over model
    # "down" [64, 1]: dim 0 is "model"'s, dim 1 too small to cut: kept whole per data rank
    assert local(state.opt_state.inner[0].mu["down"]) == (32, 1)
    x = ns["x"]
    batch = (x, np.sin(x).sum(1, keepdims=True))
    np.testing.assert_allclose(ns["loss2"], ns["mlp"](host, batch), rtol=1e-5)
    close(step.params(state), one_step(optax.adamw(1e-2), ns["mlp"], host, batch))


def setup_accumulate(ns: dict, ctx: SimpleNamespace) -> None:
    ns["opt_state"] = ns["tx"].sharded_init(ns["params"], ns["mesh"])  # a fresh run
    ctx.params = ns["params"]


def check_accumulate(ns: dict, ctx: SimpleNamespace) -> None:
    # two microbatches of a device's rows, synced once: the whole batch on one device
    np.testing.assert_allclose(ns["loss"], mlp_loss(ctx.params, ns["batch"]), rtol=1e-5)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-4))
    close(ns["params"], one_step(ref, mlp_loss, ctx.params, ns["batch"]))


def check_fsdp_step(ns: dict, ctx: SimpleNamespace) -> None:
    step, state = ns["step"], ns["state"]
    assert all(shard_fraction(s) == 1 / 8 for s in state.params.as_dict().values())
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ns["loss_fn"]))(ctx.params, ns["batch"])
    np.testing.assert_allclose(ns["loss"], ref_loss, rtol=2e-2)  # bf16 params in the step
    # FSDP's grad-norm metric: the global norm over all shards
    np.testing.assert_allclose(state.metrics.grad_norm, optax.tree.norm(ref_grads), rtol=3e-2)
    # Adam's first step moves each weight by about lr * sign(grad): bf16 gradients
    # change that only where a gradient is near zero (at most 2 * lr there)
    ref = one_step(optax.adam(1e-3), ns["loss_fn"], ctx.params, ns["batch"])
    diff = np.concatenate([np.abs(np.ravel(a) - np.ravel(b)) for a, b in zip(
        jax.tree.leaves(step.master(state)), jax.tree.leaves(ref), strict=True)])  # fmt: skip
    assert diff.max() <= 2.001e-3 and np.mean(diff > 2e-4) < 0.02, (diff.max(), diff.mean())
    assert isinstance(ns["fs"], jaxsync.FullyShard)


def _mlp_setup(ns: dict, ctx: SimpleNamespace, seed: int, batch_seed: int) -> None:
    """The MLP's params, loss and a batch, under the names the blocks use."""
    ns["params"] = random_like(mlp_params, seed)
    ns["loss_fn"] = mlp_loss
    ns["batch"] = (normal(batch_seed, ROWS, 12), normal(batch_seed + 1, ROWS, 5))
    ctx.params = ns["params"]


def setup_ddp(ns: dict, ctx: SimpleNamespace) -> None:
    _mlp_setup(ns, ctx, 0, 100)


def check_ddp(ns: dict, ctx: SimpleNamespace) -> None:
    # The pmean of local losses is the global batch's loss, and the step is the
    # README's optax optimizer on one device, on the whole batch.
    np.testing.assert_allclose(ns["loss"], mlp_loss(ctx.params, ns["batch"]), rtol=1e-5)
    close(ns["params"], one_step(ns["tx"], mlp_loss, ctx.params, ns["batch"]))
    assert changed(ns["params"], ctx.params)


def setup_zero(ns: dict, ctx: SimpleNamespace) -> None:
    ctx.params = ns["params"]


def check_zero(ns: dict, ctx: SimpleNamespace) -> None:
    state = ns["opt_state"]
    assert isinstance(state, jaxsync.DistributedOptimizerState)
    assert all(shard_fraction(m) == 1 / 8 for m in state.master)  # ZeRO: 1/N per device
    np.testing.assert_allclose(ns["loss"], mlp_loss(ctx.params, ns["batch"]), rtol=1e-5)
    # the README's settings: adam(3e-4), clip_grad_norm=1.0
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-4))
    close(ns["params"], one_step(ref, mlp_loss, ctx.params, ns["batch"]))
    assert changed(ns["params"], ctx.params)


LAYERS = 4


def setup_scanned(ns: dict, ctx: SimpleNamespace) -> None:
    ns["params"] = random_like(partial(scanned_params, layers=LAYERS), 10)
    ns["batch"] = (normal(102, ROWS, 5), normal(103, ROWS, 3))
    ctx.params = ns["params"]


def check_scanned(ns: dict, ctx: SimpleNamespace) -> None:
    loss_fn, batch, mesh = ns["loss_fn"], ns["batch"], ns["mesh"]
    # the README's settings: adamw(3e-4), clip_grad_norm=1.0; tap is the identity here
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))
    close(ns["params"], one_step(ref, loss_fn, ctx.params, batch))
    assert changed(ns["params"], ctx.params)
    # the stacked state is [L, shard] and each layer's gradient is reduce-scattered
    # inside the backward loop
    shapes = [m.addressable_shards[0].data.shape for m in ns["opt_state"].master]
    assert any(len(s) == 2 and s[0] == LAYERS for s in shapes), shapes
    compiled = ns["step"].lower(ns["params"], ns["opt_state"], jaxsync.shard_batch(batch, mesh))
    report = jaxsync.overlap_report(compiled.compile())
    in_loop = report.in_loop(kind="reduce-scatter", role="backward")
    assert in_loop and all(c.trip_count == LAYERS for c in in_loop), report
    # the README's sample of a report has the columns and rule line of the real one
    (sample,) = [
        b.code.strip().splitlines() for b in ctx.blocks if b.code.strip().startswith("name ")
    ]
    real = str(report).splitlines()
    assert sample[0].split() == real[0].split() and set(sample[1]) == set(real[1]) == {"-", " "}


def setup_layerwise(ns: dict, ctx: SimpleNamespace) -> None:
    setup_scanned(ns, ctx)
    ns["loss_fn"] = scanned_loss  # the scanned-layers page's loss_fn: jaxsync.tap in its body


def check_layerwise(ns: dict, ctx: SimpleNamespace) -> None:
    loss_fn, batch = ns["loss_fn"], ns["batch"]
    # the README's settings, on one device: Muon on each layer's matrix (optax's own
    # batched-matrix Muon over the layer axis), AdamW on the rest, clipped at 1.0
    dims = lambda p: jax.tree.map(  # noqa: E731
        lambda x: optax.contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1), p
    )
    muon = optax.contrib.muon(0.02, muon_weight_dimension_numbers=dims)
    labels = jaxsync.muon_labels(ctx.params, stacked="blocks")
    ref = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.multi_transform({"muon": muon, "adamw": optax.adamw(3e-4)}, labels),
    )
    close(ns["params"], one_step(ref, loss_fn, ctx.params, batch))
    assert changed(ns["params"], ctx.params)
    report = ns["report"]
    assert len(report.matrices) == 1 + 2 * LAYERS and len(report.loads) == 8  # inp + w1, w2
    assert {m.name for m in report.matrices} == {"inp.w", "blocks.w1", "blocks.w2"}
    assert report.imbalance >= 1.0 and "rank 0" in report.summary()


RULES_AXES = ("data", "expert", "pipe", "tensor")
RULES_SPECS = {
    "embed": P(),
    "stages": {"ln": {"scale": P()}},
    "experts": {"w": P("expert")},
    "shared": {"w": P()},
}


def rules_loss(params: Any, batch: Any) -> jax.Array:
    """A toy model with the README's param names: on each pipeline stage s, that
    stage's share of the loss (weighted by s + 1, so that stages differ)."""
    x, y = batch
    h = jnp.tanh((x * params["stages"]["ln"]["scale"]) @ params["shared"]["w"])
    h = h @ params["experts"]["w"][0]  # this rank's expert
    weight = 1.0 + jax.lax.axis_index("pipe")
    return weight * jnp.mean((h @ params["embed"].T - y) ** 2)


def run_rules(block: Block, ns: dict, ctx: SimpleNamespace) -> None:
    """The block is the inside of a step: run it inside jax.shard_map on a mesh with
    the axes its rules name (pipe=4, as its stage groups (0, 2), (1, 3) need)."""
    mesh = jax.make_mesh((1, 2, 4, 1), RULES_AXES)
    d, v = 4, 5
    params = {
        "embed": normal(20, v, d),
        "stages": {"ln": {"scale": 1.0 + normal(21, d, scale=0.1)}},
        "experts": {"w": normal(22, 2, d, d, scale=0.5)},
        "shared": {"w": normal(23, d, d, scale=0.5)},
    }
    batch = (normal(24, 8, d), normal(25, 8, v))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), RULES_SPECS)
    params = jax.device_put(params, shardings)
    batch = jax.device_put(batch, NamedSharding(mesh, P(("data", "expert"))))
    defined: dict[str, Any] = {}

    @jax.jit
    @jax.shard_map(
        mesh=mesh,
        in_specs=(RULES_SPECS, P(("data", "expert"))),
        out_specs=(P(), P(RULES_AXES)),
    )
    def body(params, batch):
        local = dict(ns, params=params, batch=batch, loss_fn=rules_loss)
        exec(compile(block.code, str(ROOT / block.page), "exec"), local)
        defined.update({k: v for k, v in local.items() if k in ("rules", "tx", "dp")})
        per_device = jax.tree.map(lambda g: g[None], local["grads"])
        return jax.lax.pmean(local["loss"], RULES_AXES), per_device

    loss, grads = jax.device_get(body(params, batch))
    ns.update(defined)
    assert np.isfinite(loss)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    pipe = np.arange(8) % 4  # the pipe index of each device (tensor has size 1)
    # Tied("pipe"): every stage has the gradient summed over all stages
    close(grads["embed"], np.broadcast_to(grads["embed"][:1], grads["embed"].shape))
    # Tied("pipe", groups=((0, 2), (1, 3))): summed within each group only
    g = grads["shared"]["w"]
    close(g[pipe == 0], g[pipe == 2])
    close(g[pipe == 1], g[pipe == 3])
    assert not np.allclose(g[pipe == 0], g[pipe == 1])
    # the distributed optimizer accepts the rules: one buffer per kind of reduction
    layout = ns["tx"].layout(params, mesh, RULES_SPECS)
    assert len({b.key for b in layout.buffers}) == 4, layout.buffers


D, V, T = 16, 13, 8


def setup_fsdp(ns: dict, ctx: SimpleNamespace) -> None:
    ns["params"] = {
        "embed": {"table": normal(30, V, D)},
        "blocks": {str(i): {"w": normal(31 + i, D, D, scale=D**-0.5)} for i in range(2)},
        "head": {"w": normal(33, D, V, scale=D**-0.5)},
    }

    # fs.apply hands each function its unit's params by dotted name
    def embed_fn(p, tokens):
        return p["embed.table"][tokens]

    def block_fn(i):
        return lambda p, x: x + jnp.tanh(x @ p[f"blocks.{i}.w"])

    def head_fn(p, x):
        return x @ p["head.w"]

    def xent(logits, targets):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    ns.update(embed_fn=embed_fn, block_fns=[block_fn(0), block_fn(1)], head_fn=head_fn, xent=xent)
    rng = np.random.default_rng(34)
    ns["batch"] = {
        "tokens": rng.integers(0, V, (ROWS, T)),
        "targets": rng.integers(0, V, (ROWS, T)),
    }
    ctx.params = ns["params"]


def check_fsdp(ns: dict, ctx: SimpleNamespace) -> None:
    fs, shards, mesh = ns["fs"], ns["shards"], ns["mesh"]
    assert all(shard_fraction(s) == 1 / 8 for s in shards.values())
    flat = {
        jaxsync.param_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(ctx.params)[0]
    }
    x = ns["embed_fn"](flat, ns["batch"]["tokens"])
    for fn in ns["block_fns"]:
        x = fn(flat, x)
    ref = ns["xent"](ns["head_fn"](flat, x), ns["batch"]["targets"])
    np.testing.assert_allclose(ns["loss"], ref, rtol=2e-2)  # bf16 params in the step
    new = fs.unshard(shards, mesh)
    assert jax.tree.map(jnp.shape, new) == jax.tree.map(jnp.shape, ctx.params)
    assert changed(new, ctx.params)


def setup_multihost(ns: dict, ctx: SimpleNamespace) -> None:
    rng = np.random.default_rng(40)
    x, y = rng.standard_normal((ROWS, 12)), rng.standard_normal((ROWS, 5))
    ns["local_rows"] = (x.astype(np.float32), y.astype(np.float32))


def check_multihost(ns: dict, ctx: SimpleNamespace) -> None:
    info = ns["info"]
    assert (info.how, info.num_processes, info.global_devices) == ("single process", 1, 8)
    for leaf, rows in zip(jax.tree.leaves(ns["batch"]), ns["local_rows"], strict=True):
        assert leaf.sharding.spec == P("data") and shard_fraction(leaf) == 1 / 8
        np.testing.assert_array_equal(leaf, rows)


def setup_checkpoint(ns: dict, ctx: SimpleNamespace) -> None:
    # the explicit path's distributed optimizer (its zero block): tx, step, params...
    setup_ddp(ns, ctx)
    mesh, loss_fn = ns["mesh"], ns["loss_fn"]
    tx = jaxsync.distributed_optimizer(
        optax.adam(3e-4), axis_name="data", clip_grad_norm=1.0, bucket_size=2**22
    )
    specs = tx.state_specs(ns["params"], mesh)

    @jax.jit
    @partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs, P())
    )
    def step(params, opt_state, batch):
        loss, grads = jaxsync.value_and_grad(loss_fn, axis_name="data")(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    ns.update(tx=tx, step=step, opt_state=tx.sharded_init(ns["params"], mesh))
    ns["start"], ns["steps"] = 0, 2
    ctx.params = ns["params"]


def check_checkpoint(ns: dict, ctx: SimpleNamespace) -> None:
    r = ns["r"]
    assert isinstance(r, jaxsync.Restored)
    assert r.step == ns["steps"] - 1 and r.meta == {"data_position": r.step}
    assert changed(ns["params"], ctx.params)  # the loop trained
    # the newest save comes back exactly, the optimizer state in its sharded form
    jax.tree.map(np.testing.assert_array_equal, r.params, ns["params"])
    assert isinstance(r.opt_state, jaxsync.DistributedOptimizerState)
    jax.tree.map(np.testing.assert_array_equal, r.opt_state, ns["opt_state"])
    assert [m.sharding for m in r.opt_state.master] == [m.sharding for m in ns["opt_state"].master]
    assert sorted(p.name for p in Path("runs/x/checkpoints").iterdir() if p.name.isdigit()) == [
        "0",
        "1",
    ]


def setup_deterministic(ns: dict, ctx: SimpleNamespace) -> None:
    _mlp_setup(ns, ctx, 7, 110)


def check_deterministic(ns: dict, ctx: SimpleNamespace) -> None:
    # the loss is the global batch's (summed exactly over the 8 units), and the
    # step is the README's optimizer on one device, on the whole batch
    np.testing.assert_allclose(ns["loss"], mlp_loss(ctx.params, ns["batch"]), rtol=1e-5)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))
    close(ns["params"], one_step(ref, mlp_loss, ctx.params, ns["batch"]))
    assert changed(ns["params"], ctx.params)
    assert ns["det"] == jaxsync.Deterministic(units=8)


def setup_gpu_target(ns: dict, ctx: SimpleNamespace) -> None:
    if not jaxsync.gpu_target_available():
        pytest.skip("compile-only GPU meshes need jax-cuda12-plugin (`make test` installs it)")


def check_gpu_target(ns: dict, ctx: SimpleNamespace) -> None:
    report, state = ns["report"], ns["state"]
    assert report.device == jaxsync.GPUS["h100"].name and report.step_us > 0
    # per layer, a reduce-scatter in the backward loop, async, with compute beside it
    sites = jaxsync.overlap_report(report.hlo_text)
    bwd = {c.computation for c in sites.in_loop("reduce-scatter", role="backward")}
    timed = [c for c in report.collectives
             if c.computation in bwd and c.kind == "reduce-scatter"]  # fmt: skip
    assert timed and all(c.overlap_ops > 0 and not c.is_sync for c in timed)
    # memory per GPU between steps: fp32 master and both AdamW moments 1/64, and no
    # bf16 params (the stacked group lives in the master shards, gathered per layer)
    n, elements = 64, sum(x.size for x in jax.tree.leaves(ns["shapes"]))
    opt = sum(x.size * 4 for x in jax.tree.leaves(state.opt_state) if x.size > n) // n
    assert 12 * elements / n <= opt <= 12 * (elements / n + 64)
    rows = ns["batch"].size * 4 // n
    assert 0 <= report.memory["arguments"] - (opt + rows) < 256


@dataclasses.dataclass(frozen=True)
class Spec:
    setup: Callable[[dict, SimpleNamespace], None] | None = None
    check: Callable[[dict, SimpleNamespace], None] | None = None
    run: Callable[[Block, dict, SimpleNamespace], None] | None = None  # instead of exec


SPECS = {
    "quickstart": Spec(setup_quickstart, check_quickstart),
    "train_step": Spec(setup_ddp, check_train_step),
    "trainer_metrics": Spec(setup_ddp, check_trainer_metrics),
    "nnx_scanned": Spec(setup_nnx_scanned, check_nnx_scanned),
    "two_d": Spec(check=check_two_d),
    "ddp": Spec(setup_ddp, check_ddp),
    "zero": Spec(setup_zero, check_zero),
    "accumulate": Spec(setup_accumulate, check_accumulate),
    "scanned": Spec(setup_scanned, check_scanned),
    "layerwise": Spec(setup_layerwise, check_layerwise),
    "rules": Spec(run=run_rules),
    "fsdp_step": Spec(setup_fsdp, check_fsdp_step),
    "fsdp": Spec(setup_fsdp, check_fsdp),
    "multihost": Spec(setup_multihost, check_multihost),
    "checkpoint": Spec(setup_checkpoint, check_checkpoint),
    "state_checkpoint": Spec(setup_state_checkpoint, check_state_checkpoint),
    "deterministic": Spec(setup_deterministic, check_deterministic),
    "gpu_target": Spec(setup_gpu_target, check_gpu_target),
}


# ------------------------------------------------------------------- running
def _exception(name: str) -> type[BaseException]:
    exc = getattr(builtins, name, None) or getattr(jaxsync, name, None)
    if not (isinstance(exc, type) and issubclass(exc, BaseException)):
        raise ValueError(f"`raises {name}`: not a builtin or jaxsync exception")
    return exc


class Runner:
    """Runs one page's ``blocks`` in order in one namespace, each at most once."""

    def __init__(self, blocks: list[Block], specs: dict[str, Spec], cwd: Path):
        self.blocks, self.specs = blocks, specs
        self.cwd = cwd  # relative paths in the page (runs/x/...) land here
        # A module of its own in sys.modules: a page's dataclasses (equinox modules)
        # look their module up there.
        module = types.ModuleType(f"docs_page_{id(self)}")
        sys.modules[module.__name__] = module
        self.ns: dict[str, Any] = module.__dict__
        page = blocks[0].page if blocks else "README.md"
        self.ctx = SimpleNamespace(blocks=BLOCKS.get(page, blocks))
        self.outcome: dict[int, str] = {}  # index -> "ok" | "not run" | "failed"

    def run_through(self, index: int) -> None:
        """Runs block ``index``, after any earlier block of its page not run yet."""
        for i in range(index):
            if i not in self.outcome:
                try:
                    self._run(i)
                except Exception as e:
                    pytest.fail(
                        f"{self.blocks[i].where}, run first since this block "
                        f"continues it, failed: {type(e).__name__}: {e}"
                    )
            if self.outcome[i] == "failed":
                pytest.skip(f"continues {self.blocks[i].where}, which failed")
        self._run(index)
        block = self.blocks[index]
        if block.not_run:
            pytest.skip(f"{block.where} is marked not run: {block.not_run}")

    def _run(self, index: int) -> None:
        block = self.blocks[index]
        self.outcome[index] = "failed"
        if block.not_run:
            self.outcome[index] = "not run"
            return
        spec = self.specs[block.name] if block.name else Spec()
        code = compile(block.code, str(ROOT / block.page), "exec")
        with contextlib.chdir(self.cwd), pytest.MonkeyPatch.context() as mp:
            # jaxsync.initialize() is a no-op alone, as the docs say: make sure no
            # launcher or cluster variable of the machine running the tests leaks in.
            for var in (distributed.ENV_COORDINATOR, *distributed._CLUSTER_HINTS):
                mp.delenv(var, raising=False)
            if spec.setup:
                try:
                    spec.setup(self.ns, self.ctx)
                except pytest.skip.Exception:
                    self.outcome[index] = "not run"  # later blocks still run
                    raise
            if spec.run:
                spec.run(block, self.ns, self.ctx)
            elif block.raises:
                with pytest.raises(_exception(block.raises)):
                    exec(code, self.ns)
            else:
                exec(code, self.ns)
            loss = self.ns.get("loss")
            if isinstance(loss, jax.Array):
                assert np.isfinite(loss).all(), f"{block.where}: loss {loss}"
            if spec.check:
                spec.check(self.ns, self.ctx)
        self.outcome[index] = "ok"


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    """One runner per page, made when the page's first block runs."""
    require_devices(8)  # the checks count shards of 1/8
    made: dict[str, Runner] = {}

    def get(page: str) -> Runner:
        if page not in made:
            cwd = tmp_path_factory.mktemp(page.replace("/", "-").removesuffix(".md"))
            made[page] = Runner(PYTHON[page], SPECS, cwd)
        return made[page]

    return get


@pytest.mark.parametrize(
    ("page", "index"),
    [(page, i) for page, blocks in PYTHON.items() for i in range(len(blocks))],
    ids=[b.id for b in ALL_PYTHON],
)
def test_python_block(runners, page, index):
    runners(page).run_through(index)


def test_runner_marks_and_failures(tmp_path):
    """The harness itself: a `not run` block is skipped with its reason and not
    executed, `raises` is enforced, and a failed block stops the blocks after it."""
    text = "\n".join([
        "```python", "x = 1", "```",
        "<!-- not run: needs a GPU -->", "```python", "x = 2", "```",
        "<!-- readme-test: raises ZeroDivisionError -->", "```python", "1 / 0", "```",
        "<!-- readme-test: raises ZeroDivisionError -->", "```python", "x = 3", "```",
        "```python", "assert x == 3", "```",
    ])  # fmt: skip
    blocks = parse_page(text, "docs/x.md")
    assert [(b.line, b.not_run, b.raises) for b in blocks] == [
        (1, None, None), (5, "needs a GPU", None), (9, None, "ZeroDivisionError"),
        (13, None, "ZeroDivisionError"), (16, None, None),
    ]  # fmt: skip
    r = Runner(blocks, SPECS, tmp_path)
    with pytest.raises(pytest.skip.Exception, match="marked not run: needs a GPU"):
        r.run_through(1)
    assert r.ns["x"] == 1
    r.run_through(2)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        r.run_through(3)
    with pytest.raises(pytest.skip.Exception, match="continues docs/x.md:13, which failed"):
        r.run_through(4)
    bad = parse_page(text.replace("x = 1", "assert 0"), "docs/x.md")
    with pytest.raises(pytest.fail.Exception, match=r"docs/x.md:1, run first.*AssertionError"):
        Runner(bad, SPECS, tmp_path).run_through(1)


def test_directives_name_known_specs():
    named = [b.name for b in ALL_PYTHON if b.name]
    unknown = [f"{b.where}: {b.name}" for b in ALL_PYTHON if b.name and b.name not in SPECS]
    assert not unknown, f"no setup/check in tests/test_docs.py SPECS for {unknown}"
    unused = sorted(set(SPECS) - set(named))
    assert not unused, f"SPECS {unused} name no block of README.md or docs/ (renamed or removed?)"
    assert len(named) == len(set(named)), f"a directive name is used twice: {named}"
    for b in ALL_BLOCKS:
        assert b.lang in ("python", "py") or not (b.name or b.raises or b.not_run), (
            f"{b.where}: a directive before a {b.lang or 'plain'} block does nothing"
        )
    for b in ALL_PYTHON:
        if b.raises:
            _exception(b.raises)


def test_not_run_copies_match_a_block_that_runs():
    """A block left out as "the same as PAGE.md's" is the code of a block of PAGE.md
    that runs, so the two copies cannot drift apart."""
    copies = [b for b in ALL_PYTHON if b.not_run and re.search(r"same\b.*?\S+\.md", b.not_run)]
    assert copies, "the docs' copy of the README's quick start is checked here"
    for b in copies:
        page = re.search(r"same\b.*?([\w./-]+\.md)", b.not_run)[1]
        assert page in PYTHON, f"{b.where}: not run as the same as {page}, which is no page"
        run = [o.code.strip() for o in PYTHON[page] if not o.not_run]
        assert b.code.strip() in run, f"{b.where} is not the same as any block {page} runs"


def _check_command(words: list[str], where: str) -> None:
    """``make X``: a Makefile target; ``python -m mod``, ``python a.py``, ``a.py``: the
    module or file exists, and each ``--flag`` is named in the program that gets it."""
    assert words, where
    if words[0] == "make":
        text = (ROOT / "Makefile").read_text()
        targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))
        missing = [w for w in words[1:] if "=" not in w and w not in targets]
        assert not missing, f"{where}: no Makefile target {missing}"
        return
    if words[0] in ("python", "python3"):
        words = words[1:]
    source = None
    while words:
        w, words = words[0], words[1:]
        if w == "-m" and words:
            spec = importlib.util.find_spec(words[0])
            assert spec and spec.origin, f"{where}: no module {words[0]}"
            source, words = Path(spec.origin).read_text(), words[1:]
        elif w.endswith(".py"):  # the program, or the script a launcher runs
            assert (ROOT / w).is_file(), f"{where}: no file {w}"
            source = (ROOT / w).read_text()
        elif w.startswith("--") and source is not None:
            flag = w.split("=")[0]
            assert f'"{flag}"' in source, f"{where}: {flag} is not an option"


@pytest.mark.parametrize(
    "block", [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell")], ids=lambda b: b.id
)
def test_shell_block_commands_exist(block):
    for line in block.code.splitlines():
        words = line.split("#")[0].split()
        if words:
            _check_command(words, f"{block.page}: `{line.strip()}`")


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_commands_and_paths_in_the_text_exist(page):
    """Inline commands (``make X``, ``python ...``, ``script.py --flag``) and the
    repository paths the text names (``dir/file.py``, ``.yaml``...)."""
    for span in re.findall(r"`([^`\n]+)`", page.read_text()):
        words = span.split()
        where = f"{rel(page)}: `{span}`"
        if words[0] in ("make", "python", "python3") or (words[0].endswith(".py") and words[1:]):
            _check_command(words, where)
        for word in words:
            if "/" in word and re.fullmatch(r"[\w./-]+\.(py|yaml|md|toml)", word):
                assert (ROOT / word).is_file(), f"{where} names {word}, which does not exist"
            elif re.fullmatch(r"(jaxsync|tests|examples|benchmarks|configs)/[\w./-]*/", word):
                assert (ROOT / word).is_dir(), f"{where} names folder {word}, which is gone"


def test_api_reference_names_every_public_name():
    """docs/api/ renders each name of ``jaxsync.__all__`` (``::: jaxsync.NAME``) once."""
    names = [
        m
        for page in sorted((ROOT / "docs" / "api").glob("*.md"))
        for m in re.findall(r"^::: jaxsync\.(\w+)\s*$", page.read_text(), re.M)
    ]
    assert sorted(names) == sorted(set(names)), "a name is rendered twice"
    assert set(names) == set(jaxsync.__all__), (
        f"missing: {sorted(set(jaxsync.__all__) - set(names))}, "
        f"not public: {sorted(set(names) - set(jaxsync.__all__))}"
    )


DOCS_URL = "https://jaxsync.github.io/jaxsync/"


def _anchors(page: Path) -> set[str]:
    """The heading ids mkdocs gives a page (its toc slugs, simplified)."""
    heads = re.findall(r"^#{1,6} (.+?)\s*$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in heads}


def test_readme_links_are_absolute_and_name_docs_pages():
    """PyPI shows README.md as the long description, where a relative link breaks: the
    README links by absolute URL, and each link into the docs site names a page (and a
    heading) that docs/ has."""
    links = re.findall(r"\]\(([^)\s]+)\)|<(https?://[^>]+)>", README.read_text())
    links = [a or b for a, b in links]
    assert links, "the README links into the docs"
    for link in links:
        assert re.match(r"https?://", link), f"README.md: relative link {link}"
        if not link.startswith(DOCS_URL):
            continue
        path, _, anchor = link.removeprefix(DOCS_URL).partition("#")
        path = ROOT / "docs" / path.strip("/")
        page = path.with_suffix(".md") if path.with_suffix(".md").is_file() else path / "index.md"
        assert page.is_file(), f"README.md: {link} is no page of docs/"
        assert not anchor or anchor in _anchors(page), f"README.md: {link}: no such heading"

"""Checks of what a :class:`jaxsync.TrainStep` is given, the same in every mode.

The step's three bodies (ddp, zero, fsdp) share these, so a mistake is refused
the same way whatever the mode: batches whose leaves disagree on their rows,
a state whose buffers were donated already, a loss that is an integer or is
already averaged over the data axes, integer params, and processes that
disagree (:mod:`consistency`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.axes import check_idle_axes, mesh_axes_size
from ..core.names import param_name
from ..core.specs import entry_axes
from ..layout.ownership import WholeMatrices
from ..multihost.consistency import (
    check_agree,
    describe_value,
    param_values,
    shardings,
    structure,
)
from ..optim.checks import check_labels
from ..optim.per_matrix import per_matrix
from .modes import deterministic_of

PyTree = Any

STATE_DELETED = (
    "{fn}: the state's arrays were deleted (e.g. {leaf}): this state was donated to an "
    "earlier call of the step, which reused its buffers. Use the state the step returned: "
    "`state, loss = step(state, batch)`; to keep the old one, pass `donate=False` to "
    "`jaxsync.train_step` or copy it first (`jax.tree.map(jnp.copy, state)`)."
)


def check_state_alive(state: PyTree, fn: str) -> None:
    """Refuses a state whose buffers were donated (JAX 0.10 may crash on them)."""
    # Every call checks: the leaves alone, their paths only to name a deleted one.
    if not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        return
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(STATE_DELETED.format(fn=fn, leaf=f"state{jax.tree_util.keystr(path)}"))


STATE_ON_OTHER_MESH = (
    "{fn}: the state's arrays are on a mesh with devices {got}, and this step's mesh has "
    "{want}{why}. Shards belong to positions in the mesh, so the step cannot read them "
    "there. Build the state with this step's `init` (or restore into it), build the step "
    "with the mesh the state was made on, or {move}"
)
#: Moving a state whose shards fit this step's data-parallel size as they are.
MOVE_PUT = (
    "move the state: `state = jax.device_put(state, "
    "step.state_shardings(step.abstract_state(params)))`."
)
#: Moving a state whose flat shards were cut for another data-parallel size.
MOVE_CHECKPOINT = (
    "move the state through a checkpoint: its flat shards were cut for {cut} "
    "data-parallel ranks and this step's are {dp}, so save it with "
    "`jaxsync.Checkpointer(dir).save_state(old_step, state)` and restore it with "
    "`Checkpointer(dir).restore_state(step, step.abstract_state(params))`, which cuts "
    "them again."
)


def _cut_for(state: PyTree) -> int:
    """The data-parallel size the state's flat shards were cut for (its layout tag); 0
    where none depends on it or the tag cannot be read here."""
    try:
        return int(np.asarray(state.layout)[0])
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        return 0


def check_state_mesh(state: PyTree, mesh: Any, fn: str, axes: Any = ()) -> None:
    """The state must live on the step's mesh, devices in the same order (``axes``: the
    step's data axes, sized only for the advice on moving a refused state)."""
    want = [d.id for d in mesh.devices.flat]
    seen: set[int] = set()
    for x in jax.tree.leaves(state):
        m = getattr(getattr(x, "sharding", None), "mesh", None)
        if m is None or id(m) in seen or not hasattr(m, "devices"):
            continue
        seen.add(id(m))
        got = [d.id for d in m.devices.flat]
        if got != want or dict(m.shape) != dict(mesh.shape):
            why = f" (axes {dict(m.shape)} vs {dict(mesh.shape)})"
            if got != want:
                same = sorted(got) == sorted(want)
                why = " (the same devices in another order)" if same else " (other devices)"
            cut, dp = _cut_for(state), mesh_axes_size(mesh, axes, fn) if axes else 0
            move = MOVE_CHECKPOINT.format(cut=cut, dp=dp) if cut and cut != dp else MOVE_PUT
            raise ValueError(
                STATE_ON_OTHER_MESH.format(fn=fn, got=got, want=want, why=why, move=move)
            )


def checked_labels(labels: Any, inner: dict[str, Any]) -> Any:
    """``labels`` for ``optax.multi_transform`` (ddp), checked as ZeRO checks them: one
    label string per param, each a key of ``tx`` (a None or unknown label would be
    an optax KeyError or a silently untrained param)."""

    def labels_of(params: PyTree) -> PyTree:
        tree = labels(params) if callable(labels) else labels
        check_labels(params, tree, inner)
        return tree

    return labels_of


def labeled_tx(tx: Any, labels: Any, stacked: Sequence[str] = ()) -> Any:
    """``optax.multi_transform`` of a mapping ``label -> optimizer`` with checked
    ``labels``: how every step whose optimizer sees whole params (DDP, and all
    modes on a 2-D mesh) runs parameter groups. A :func:`jaxsync.whole_matrices`
    label runs its optimizer matrix by matrix, layer by layer in ``stacked`` groups,
    as the distributed optimizer's owners do."""
    import optax

    def run(v: Any) -> Any:  # a `tree` one routes by itself, on the masked tree
        if isinstance(v, WholeMatrices):
            return v.inner if v.tree else per_matrix(v.inner, stacked)
        return v

    inner = {k: run(v) for k, v in dict(tx).items()}
    return optax.multi_transform(inner, checked_labels(labels, dict(tx)))


SPEC_AXIS_UNKNOWN = (
    "{fn}: param {param} (shape {shape}) carries the sharding {spec}, over {missing}, which "
    "the step's mesh {names} does not have. Shard the params over the step's mesh (the "
    "same axis names), or build the step with that mesh."
)
SPEC_NOT_SUPPORTED = (
    "{fn}: param {param} (shape {shape}) is sharded over {other} ({spec}), so the step leaves "
    "{other} to the compiler (tensor parallelism by specs); {what} cannot run there: {fix}."
)
SPEC_PART_OF_DATA = (
    "{fn}: param {param} (shape {shape}) is sharded over {ours} ({spec}), part of the step's "
    "data axes {data}. The step holds every param whole over its data axes (and shards it "
    "over all of them itself in 'zero' and 'fsdp'), so this split would be dropped and "
    "every device would hold the whole param. If {ours} is a model axis (e.g. experts), "
    "leave it out of `axis_name` (axis_name={rest!r}) and split the batch rows over it "
    "after the data axes (place the batch with P({rows!r})): the compiler then keeps the "
    "param's split and jaxsync reduces its gradient over {rest!r} only. If the split is "
    "only where the param was created, pass it replicated (or split over all of {data})."
)
SPEC_DIVIDES = (
    "{fn}: param {param} (shape {shape}) carries the sharding {spec}, and dimension {dim} "
    "(size {size}) does not divide over {axes} (size {n}). Choose a spec whose axes divide "
    "the dims they shard."
)


GROUPED_TIE = (
    "{fn}: the rule for {prefix!r} is Tied({axis!r}, groups={groups}), which sums the "
    "gradient within each group of stages only, so the groups' copies would part ways; "
    "but a train step holds every param under `rules` replicated over {axis!r} (one copy "
    "for all its stages). Pass `groups=None` (all stages share the one copy), or hold "
    "the param per stage on the explicit path (`jaxsync.value_and_grad` and "
    "`jaxsync.all_reduce_grads` with `rules=`)."
)


def check_step_rules(mode: Any, fn: str) -> None:
    """Rules a train step can honour: no tie within stage groups (its params under
    rules are replicated over the rules' axes, so every stage holds the same copy)."""
    for prefix, rule in getattr(getattr(mode, "rules", None), "rules", ()):
        if getattr(rule, "groups", None) is not None:
            raise ValueError(
                GROUPED_TIE.format(fn=fn, prefix=prefix, axis=rule.axis, groups=rule.groups)
            )


def check_param_shardings(params: PyTree, cfg: Any, fn: str) -> None:
    """What a step cannot honour about its params' shardings is an error, never a
    silent replication: axes the mesh lacks, specs that do not divide, a split over
    some of the data axes only (expert parallelism misplaced in ``axis_name``), and
    options that need every param replicated outside the data axes."""
    mesh, data = cfg.mesh, cfg.axis_name
    first = None
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        if spec is None:
            continue
        name, shape = param_name(path), tuple(np.shape(x))
        named = [a for entry in spec for a in entry_axes(entry)]
        ours = tuple(a for a in data if a in named)
        if ours and len(ours) < len(data):
            rest = tuple(a for a in data if a not in ours)
            raise ValueError(
                SPEC_PART_OF_DATA.format(
                    fn=fn, param=name, shape=shape, spec=spec, ours=ours, data=data,
                    rest=rest[0] if len(rest) == 1 else rest, rows=rest + ours,
                )
            )  # fmt: skip
        for dim, entry in enumerate(spec):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            missing = [a for a in axes if a not in mesh.axis_names]
            if missing:
                raise ValueError(
                    SPEC_AXIS_UNKNOWN.format(
                        fn=fn, param=name, shape=shape, spec=spec, missing=missing,
                        names=dict(mesh.shape),
                    )
                )  # fmt: skip
            n = int(np.prod([mesh.shape[a] for a in axes]))
            if dim < len(shape) and shape[dim] % n:
                raise ValueError(
                    SPEC_DIVIDES.format(
                        fn=fn, param=name, shape=shape, spec=spec, dim=dim, size=shape[dim],
                        axes=axes, n=n,
                    )
                )  # fmt: skip
            other = tuple(a for a in axes if a not in data)
            if other and first is None:
                first = (name, shape, spec, other)
    if jax.process_count() == 1:  # else after the processes agree on the specs
        check_mesh_use(params, cfg, fn)
    if first is None:
        return
    unsupported = [
        (getattr(cfg.mode, "rules", None) is not None, "`rules` (SyncRules)",
         "the compiler already reduces each gradient over the axes it shards; drop `rules`"),
        (deterministic_of(cfg.mode) is not None, "`deterministic`",
         "its fixed-point sums need every param whole on each device; drop it, or pass "
         "the params replicated outside the data axes"),
        (getattr(cfg.mode, "units", None) is not None, "FSDP `units`",
         "each param is gathered on its own where the model uses it; drop `units`"),
    ]  # fmt: skip
    for bad, what, fix in unsupported:
        if bad:
            name, shape, spec, other = first
            raise ValueError(
                SPEC_NOT_SUPPORTED.format(
                    fn=fn, param=name, shape=shape, spec=spec, other=other, what=what, fix=fix
                )
            )


def check_mesh_use(params: PyTree, cfg: Any, fn: str) -> None:
    """Every mesh axis of size > 1 is a data axis, in a param's spec, named by the
    mode's ``rules`` or in ``loss_axes`` (:func:`core.axes.check_idle_axes`)."""
    used = {r.axis for _, r in getattr(getattr(cfg.mode, "rules", None), "rules", ())}
    for x in jax.tree.leaves(params):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        used.update(a for entry in spec or () for a in entry_axes(entry))
    check_idle_axes(cfg.mesh, cfg.axis_name, used, getattr(cfg, "loss_axes", ()), fn)


DETERMINISTIC_MODEL_STATE = (
    "{fn}: `deterministic` does not support NNX model state besides `nnx.Param`s, and this "
    "model has {leaves} (mode={mode!r}). Batch statistics are computed from each device's "
    "rows and averaged over devices, and an RNG stream (Dropout) draws from one key on "
    "every device for a different share of the batch, so both depend on the number of "
    "devices and break the mode's bitwise promise. Remove them for deterministic runs "
    "(e.g. LayerNorm instead of BatchNorm, `nnx.Dropout(rate=0)` without `rngs`), or drop "
    "`deterministic`."
)


def check_deterministic_state(det: Any, model_state: PyTree, mode: str, fn: str) -> None:
    """Deterministic mode refuses model state it cannot keep independent of N."""
    if det is None:
        return
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(model_state)[0]]
    if names:
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise ValueError(DETERMINISTIC_MODEL_STATE.format(fn=fn, leaves=shown, mode=mode))


# ---------------------------------------------------------------- processes
_SKIP = ("loss_fn", "tx", "mesh", "labels")


def step_items(cfg: Any) -> list[tuple[str, str]]:
    """What the processes' steps must agree on: mode, options, optimizer, mesh."""
    items = [("mode and options", describe_value({
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
        if not f.name.startswith("_") and f.name not in _SKIP
    }))]  # fmt: skip
    items.append(("optimizer `tx` (its hyperparameters)", describe_value(cfg.tx)))
    items.append(("`labels`", describe_value(cfg.labels)))
    mesh = cfg.mesh
    items.append(("mesh", f"{dict(mesh.shape)} {[d.id for d in mesh.devices.flat]}"))
    items.append(("loss_fn", getattr(cfg.loss_fn, "__qualname__", type(cfg.loss_fn).__name__)))
    return items


def check_processes_at_init(cfg: Any, params: PyTree, model_state: PyTree) -> None:
    """At ``init``: config, optimizer and param structure first, then param values."""
    if jax.process_count() == 1:
        return
    fn = "TrainStep.init"
    items = step_items(cfg) + [
        ("param structure (paths, shapes, dtypes)", structure(params)),
        ("param shardings (PartitionSpecs)", shardings(params)),
        ("model state structure", structure(model_state)),
    ]
    check_agree(items, fn)
    check_agree(param_values(params), fn, "the values of params that must be replicated")
    check_mesh_use(params, cfg, fn)


def check_processes_first_step(cfg: Any, state: PyTree, batch: PyTree) -> None:
    """On the first step: config, the state's structure and each process's batch."""
    if jax.process_count() == 1:
        return
    items = step_items(cfg) + [
        ("state structure", structure(state)),
        ("this process's batch (paths, local shapes, dtypes)", structure(batch)),
    ]
    check_agree(items, "TrainStep.__call__")


def check_state_dtypes(new: PyTree, old: PyTree) -> None:
    """The optimizer state keeps its dtypes: the step is compiled for the state
    ``init`` made, and a skipped step hands the old one back."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise TypeError(
            "jaxsync.train_step: `tx.update` returned an optimizer state of another "
            f"structure than `tx.init` made: {jax.tree.structure(new)} against "
            f"{jax.tree.structure(old)}. An optimizer's state must keep its structure."
        )
    got = jax.tree_util.tree_flatten_with_path(new)[0]
    for (path, n), o in zip(got, jax.tree.leaves(old), strict=True):
        if jnp.dtype(n.dtype) != jnp.dtype(o.dtype):
            raise TypeError(
                f"jaxsync.train_step: `tx.update` returned the optimizer state leaf "
                f"{jax.tree_util.keystr(path)} as {jnp.dtype(n.dtype).name}, but `tx.init` "
                f"made it {jnp.dtype(o.dtype).name}. An optimizer's state must keep its "
                "dtypes from step to step; cast it in the transform."
            )

"""A whole data-parallel training step from a loss, an optax optimizer and a mesh.

Every jaxsync user otherwise writes the same thirty lines: the optimizer
wrapper, sharded init, ``jax.jit(jax.shard_map(..., in_specs=..., out_specs=...))``
with the state's specs, donation, batch placement (and its microbatch layout),
``jaxsync.value_and_grad`` or ``accumulate_grads`` with the right ``sync``, and a
``pmean`` of the loss for logging; NNX users also split and merge their module.
:func:`train_step` writes them once, for the three modes:

- ``"ddp"``: replicated optax state, bucketed all-reduce of local gradients.
- ``"zero"``: :func:`jaxsync.distributed_optimizer` (ZeRO-1/2).
- ``"fsdp"``: :func:`jaxsync.fully_shard` (ZeRO-3), the model reading
  ``fs.view(shards)``.

The explicit ``shard_map`` path stays: the builder composes the same public
functions and adds no numerics of its own beyond DDP/FSDP clipping, skipping
and loss scaling (the distributed optimizer's arithmetic).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.axes import mesh_axes_size
from ..core.hosts import traced_on
from ..core.names import param_name
from ..core.specs import full_spec
from ..core.validate import check_float_params
from ..fsdp.held import NOT_PARAMS, FsdpShards
from ..multihost import watchdog
from ..multihost.data import place_batch
from ..optim.loss_scale import LossScale
from ..optim.master import MasterState
from ..optim.portable import signature
from . import handed, skips
from .body import per_device
from .checks import (
    check_deterministic_state,
    check_param_shardings,
    check_processes_at_init,
    check_processes_first_step,
    check_state_alive,
    check_state_mesh,
)
from .held import whole_params
from .made import made_from, note_made, unmatched
from .make import distinct, make_state, replicated_copy
from .models import linen
from .models.collections import check_collections
from .models.nnx_bridge import is_graphdef, is_module, merge_split, split_model
from .modes import DDP, Mode, deterministic_of
from .parts import Plan
from .pieces.rng import KeyKind, check_batch_keys, check_key, keyed
from .shard_tag import check_tag, check_untagged, remember, tagged
from .train_state import TrainState
from .two_d.plan import project, spec_layout, spec_master, spec_params
from .xla_options import state_share, step_compiler_options

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """A jitted data-parallel training step; build it with :func:`train_step`.

    ``init(params_or_module)`` returns the global, sharded :class:`TrainState`;
    ``step(state, batch)`` returns ``(state, loss)`` (the loss averaged over the
    data-parallel devices). The state is donated: use the returned one.
    """

    loss_fn: Callable[..., Any]
    tx: optax.GradientTransformation
    mesh: Mesh
    mode: Mode  # DDP, ZeRO or FSDP, each carrying only its own options
    axis_name: tuple[str, ...]
    microbatches: int
    stacked: tuple[str, ...]
    clip_grad_norm: float | None
    loss_scale: LossScale
    donate: bool
    labels: Any
    has_aux: bool = False
    aux_reduce: dict[str, str] = dataclasses.field(default_factory=dict)
    state_reduce: dict[str, str] = dataclasses.field(default_factory=dict)
    loss_axes: tuple[str, ...] = ()  # mesh axes the loss uses itself (core.axes.check_idle_axes)
    metrics: Any = None  # a TrainerMetrics: update/param norms and rate (optim.logged)
    _plans: dict[Any, Plan] = dataclasses.field(default_factory=dict, repr=False)
    _stepped: list[bool] = dataclasses.field(default_factory=list, repr=False)
    _keyed: dict[Any, Callable[..., Any]] = dataclasses.field(default_factory=dict, repr=False)
    _tags: list[Any] = dataclasses.field(default_factory=list, repr=False)  # shard_tag

    # ------------------------------------------------------------------ init
    def init(self, params: Any, *nnx_states: Any, model_state: Any = None) -> TrainState:
        """The initial global state from ``params`` (a pytree of arrays) or an ``nnx.Module``.

        A module (or ``graphdef, *states`` from ``nnx.split``) is split into its
        ``nnx.Param`` values (trained) and the rest of its state
        (``state.model_state``, kept as the model updates it); the loss function
        then receives the merged module. A flax linen model's mutable collections go
        in ``model_state`` (``{"batch_stats": variables["batch_stats"]}``): the loss then
        receives ``{"params": params, **collections}`` and returns ``(loss,
        new_collections)`` (with ``has_aux``: ``(loss, (new_collections, aux))``).
        """
        model, params, rest = self._split(params, nnx_states, "TrainStep.init", model_state)
        check_processes_at_init(self, params, rest)
        # Copies: the step donates the state, which must never delete the caller's
        # arrays (or the module's, for an nnx.Module). Params the compiler shards
        # over other axes keep their sharding (copied by two_d.plan.make_state).
        layout = spec_layout(self, params)
        if layout is not None:
            rest = replicated_copy(rest, self.mesh)
        else:
            params, rest = replicated_copy((params, rest), self.mesh)
        state, plan = make_state(self, model, params, rest, layout)
        state, specs = tagged(self, state, plan.specs)
        plan = dataclasses.replace(plan, specs=specs)
        state = distinct(state)
        remember(self, state.layout)
        self._register(state, plan, (model, params, rest))
        handed.note(self, state)
        return state

    def abstract_state(self, params: Any, *nnx_states: Any, model_state: Any = None) -> TrainState:
        """The state ``init`` would return, as ``jax.ShapeDtypeStruct``s with shardings.

        ``params`` may hold ``jax.ShapeDtypeStruct`` leaves (or be an abstract
        module from ``nnx.eval_shape``): nothing is allocated, so a step for a mesh
        of compile-only devices (:func:`jaxsync.gpu_topology`) or for a model too
        large for this machine can be lowered with :meth:`lower`, compiled, and
        read (:func:`jaxsync.schedule_report`, ``memory_analysis()``).
        """
        model, params, rest = self._split(
            params, nnx_states, "TrainStep.abstract_state", model_state
        )
        return self._abstract(model, params, rest)

    def _abstract(self, model: Any, params: PyTree, rest: PyTree) -> TrainState:
        """:meth:`abstract_state` of split, checked params (registers the plan)."""
        built: dict[str, Plan] = {}
        layout = spec_layout(self, params)  # from the shardings, before tracing drops them

        def make(params: PyTree, rest: PyTree) -> TrainState:
            state, plan = make_state(self, model, params, rest, layout)
            state, specs = tagged(self, state, plan.specs, abstract=True)
            built["plan"] = dataclasses.replace(plan, specs=specs)
            return state

        shapes = jax.eval_shape(make, params, rest)
        plan = built["plan"]
        state = jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(self.mesh, full_spec(spec, x.ndim))
            ),
            shapes, plan.specs,
        )  # fmt: skip
        self._register(state, plan, (model, params, rest))
        return state

    def _split(
        self, params: Any, nnx_states: tuple, fn: str, model_state: Any = None
    ) -> tuple[Any, PyTree, PyTree]:
        """``(model definition or None, params, rest of the model state)``, checked."""
        model, rest = None, {}
        if nnx_states or is_graphdef(params):
            params = merge_split(params, nnx_states)
        if isinstance(params, FsdpShards):  # an FSDP state's params: no tree of the model's
            raise TypeError(NOT_PARAMS.format(fn=fn))
        if is_module(params):
            if model_state is not None:
                raise ValueError(
                    f"{fn}: an nnx.Module carries its own state; `model_state` is for a "
                    "flax linen model's mutable collections."
                )
            model, params, rest = split_model(params)
        else:  # a pytree: linen's nn.with_partitioning boxes become placements
            params = linen.unbox(params, self.mesh, self.axis_name)
            if model_state is not None:
                rest = check_collections(model_state, fn)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        bad = [param_name(p) for p, x in leaves if not hasattr(x, "dtype")]
        if not leaves or bad:
            what = "it is empty" if not leaves else f"leaves {bad[:4]} are not arrays"
            raise TypeError(
                f"{fn}: `params` must be a non-empty pytree of arrays or an nnx.Module; {what}."
            )
        check_float_params(params, self.mode.name, fn)
        check_param_shardings(params, self, fn)
        check_deterministic_state(deterministic_of(self.mode), rest, self.mode.name, fn)
        return model, params, rest

    def _register(self, state: TrainState, plan: Plan, made: tuple) -> None:
        object.__setattr__(plan, "state_share", state_share(state, self.mesh))
        object.__setattr__(plan, "fn", self._build(plan))
        self._plans[signature(state)] = plan
        note_made(signature(state), *made)

    # ------------------------------------------------------------------ step
    def __call__(
        self, state: TrainState, batch: PyTree, *, key: Any = None
    ) -> tuple[TrainState, jax.Array]:
        """One step on the global ``batch`` (host arrays are fine): ``(state, loss)``.

        ``key``: a PRNG key for this step (split a new one each step). Each piece of
        the global batch (a device's microbatch; a deterministic unit) gets its own,
        ``jax.random.fold_in(key, piece)``, as ``loss_fn``'s third argument:
        ``loss_fn(params, batch, key)`` (see docs/train-step.md, "Random numbers").
        """
        check_state_alive(state, "TrainStep.__call__")
        check_state_mesh(state, self.mesh, "TrainStep.__call__", self.axis_name)
        plan = self._plan(state, "TrainStep.__call__")
        fn = self._fn(plan, key)
        check_batch_keys(batch)
        placed = self.place(batch)
        if not self._stepped:  # once: every process takes its first step together
            check_processes_first_step(self, state, batch)
            self._stepped.append(True)
        skips.watch(self, state)
        out = watchdog.run_step(fn, state, placed)  # marks the step for a hang's report
        handed.note(self, out[0])
        remember(self, out[0].layout)
        return out

    def lower(self, state: TrainState, batch: PyTree, *, key: Any = None) -> Any:
        """The step lowered for ``state`` and ``batch`` (``.compile()``, then e.g.
        :func:`jaxsync.overlap_report` or ``.memory_analysis()``)."""
        jitted, extra = self._jitted(self._plan(state, "TrainStep.lower"), key)
        return jitted.lower(state, self.place(batch), *extra)

    def _fn(self, plan: Plan, key: Any) -> Callable[[Any, Any], Any]:
        """The step's ``fn(state, batch)``: the plan's, or with ``key``, the keyed one."""
        jitted, extra = self._jitted(plan, key)
        return jitted if not extra else lambda state, batch: jitted(state, batch, *extra)

    def _jitted(self, plan: Plan, key: Any) -> tuple[Any, tuple[Any, ...]]:
        """``(jitted step, its arguments after state and batch)``: with ``key``, the
        program that takes the key's data (built once per plan and kind of key)."""
        if key is None:
            return plan.fn, ()
        data, kind = check_key(key, self.loss_fn)
        cache = (id(plan), kind)
        if cache not in self._keyed:
            self._keyed[cache] = self._build(plan, kind)
        return self._keyed[cache], (data,)

    def place(self, batch: PyTree) -> PyTree:
        """``batch`` sharded over the data axes (rows per device must split into
        ``microbatches``); what ``__call__`` does to its batch. With several
        processes each passes its own rows, as for :func:`jaxsync.shard_batch`.

        A leaf already placed with its rows split over the data axes and then
        other axes (``P(("data", "expert"))``, for a model the compiler shards
        over ``"expert"``) keeps that sharding; see :func:`rows_kept`.
        """
        return place_batch(batch, self.mesh, self.axis_name, self.microbatches)

    def _plan(self, state: Any, fn: str) -> Plan:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"{fn}: `state` must be the TrainState from `init`, got {type(state).__name__}."
            )
        plan = self._plans.get(signature(state))
        if plan is None and (made := made_from(signature(state))) is not None:
            # a state another step made from a model: this step's plan for that model (one
            # whose settings do not take that model is refused below)
            with contextlib.suppress(TypeError, ValueError):
                self._abstract(*made)
            plan = self._plans.get(signature(state))
        if plan is None:
            check_untagged(state, fn)
            raise ValueError(unmatched(fn, state, self.mode.name))
        check_tag(self, state, fn)  # a state cut for another layout (plain orbax restore)
        return plan

    def _layer_bytes(self, plan: Plan) -> int:
        """The largest layer the step gathers in its loops (FSDP, ZeRO's held groups)."""
        if plan.fs is not None:
            return plan.fs.layer_bytes()
        if plan.held:
            return plan.tx.layout(plan.template, self.mesh).layer_bytes(plan.held)
        return 0

    def _build(self, plan: Plan, kind: KeyKind | None = None) -> Callable[..., Any]:
        """The jitted step ``fn(state, batch)``; with ``kind``, ``fn(state, batch, key
        data)`` (the step's key, replicated: :mod:`rng` folds each piece's)."""
        axes = self.axis_name
        data = axes if len(axes) > 1 else axes[0]
        donate = (0,) if self.donate else ()
        key_spec = () if kind is None else (P(),)

        def step(state: TrainState, batch: Any, *key: Any) -> tuple[TrainState, Any]:
            with traced_on(self.mesh):  # which hosts each reduction spans
                batch = keyed(self, plan, batch, key[0] if key else None, kind)
                return per_device(self, plan, state, batch)

        # The program's name in profiles, dumps and XLA's logs: jit_jaxsync_zero_step.
        step.__name__ = step.__qualname__ = f"jaxsync_{self.mode.name}_step"
        if plan.dims is None:
            body = jax.shard_map(
                step, mesh=self.mesh, in_specs=(plan.specs, P(data), *key_spec),
                out_specs=(plan.specs, P()),
            )  # fmt: skip
            return jax.jit(
                body, donate_argnums=donate,
                compiler_options=step_compiler_options(
                    self.mode.name, two_d=False, layer_bytes=self._layer_bytes(plan),
                    devices=mesh_axes_size(self.mesh, axes, "jaxsync.train_step"),
                    state=plan.state_share, stacked=bool(self.stacked),
                ),
            )  # fmt: skip
        # Manual over the data axes (and any axis no param uses); the compiler
        # partitions the rest, and the jit pins the state's whole shardings.
        manual = plan.dims.manual(self.mesh)
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        local = jax.tree.map(lambda s: project(s, manual), plan.specs, is_leaf=is_spec)
        body = jax.shard_map(
            step, mesh=self.mesh, in_specs=(local, P(data), *key_spec), out_specs=(local, P()),
            axis_names=manual,
        )  # fmt: skip
        whole = jax.tree.map(lambda s: NamedSharding(self.mesh, s), plan.specs, is_leaf=is_spec)
        return jax.jit(
            body, in_shardings=(whole, None, *(None for _ in key_spec)),
            out_shardings=(whole, NamedSharding(self.mesh, P())),
            donate_argnums=donate,
            compiler_options=step_compiler_options(self.mode.name, two_d=True),
        )  # fmt: skip

    # ------------------------------------------------------------ state API
    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs of ``state``'s arrays (for your own shard_map or jit)."""
        return self._plan(state, "TrainStep.state_specs").specs

    def state_shardings(self, state: TrainState) -> TrainState:
        """``NamedSharding``s of ``state``'s arrays (e.g. to restore a checkpoint into)."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s),
            self.state_specs(state),
            is_leaf=lambda x: isinstance(x, P),
        )

    def optimizer(self, state: TrainState) -> Any:
        """The optimizer the step runs (``"zero"``: the distributed optimizer around ``tx``;
        FSDP: ``tx``, or with ``labels`` ``FullyShard.multi_transform(tx)``), e.g. for
        ``Checkpointer.save(tx=...)``."""
        return self._plan(state, "TrainStep.optimizer").tx

    def fully_shard(self, state: TrainState) -> Any:
        """The :class:`jaxsync.FullyShard` of an ``"fsdp"`` step (None otherwise)."""
        return self._plan(state, "TrainStep.fully_shard").fs

    def params(self, state: TrainState) -> PyTree:
        """The params as a pytree shaped like the ones given to ``init``, replicated
        (FSDP: gathered from the shards, in the params' own dtypes), in every mode.

        Read the params here, not from ``state.params``: FSDP's is an
        :class:`jaxsync.FsdpShards` of flat, padded fp32 unit shards, and a ZeRO step
        holds its stacked groups as master shards only. Where it gathers (FSDP; a
        1-D ZeRO step with stacked groups) it runs a program on every device: with
        several processes, call it on each of them, as any collective."""
        plan = self._plan(state, "TrainStep.params")
        if plan.dims is not None:
            return spec_params(self, plan, state)
        if plan.held:
            return whole_params(
                plan.tx, state.opt_state, state.params, plan.template, plan.held, self.mesh
            )
        if plan.fs is None:
            return state.params
        full = plan.fs.unshard(state.params)
        return jax.tree.map(lambda x, t: x.astype(t.dtype), full, plan.template)

    def master(self, state: TrainState) -> PyTree:
        """The fp32 master weights, as a pytree shaped like the params.

        ``"zero"``: gathered from the distributed optimizer's shards; ``"fsdp"``:
        the fp32 shards, gathered; ``"ddp"``: the fp32 master its optimizer keeps
        for bf16/fp16 params (for fp32 params, the params themselves).
        """
        plan = self._plan(state, "TrainStep.master")
        if plan.dims is not None:
            return spec_master(self, plan, state)
        if plan.fs is not None:
            return plan.fs.unshard(state.params)
        if isinstance(self.mode, DDP):
            if isinstance(state.opt_state, MasterState):
                return state.opt_state.master
            return jax.tree.map(lambda x: x.astype(jnp.float32), state.params)
        master = plan.tx.to_portable(state.opt_state, plan.template, self.mesh)["master"]
        return jax.tree_util.tree_map_with_path(
            lambda path, _: master[param_name(path)], plan.template
        )

    def model(self, state: TrainState) -> Any:
        """The trained ``nnx.Module`` (for an ``init`` given a module)."""
        plan = self._plan(state, "TrainStep.model")
        if plan.model is None:
            raise ValueError(
                "TrainStep.model: this state was initialised from a pytree of params, not an "
                "nnx.Module; read `step.params(state)` instead."
            )
        return plan.model.merge(self.params(state), state.model_state)

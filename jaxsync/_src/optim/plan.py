"""The distributed optimizer's plan: which buffer each param goes to, on which ranks.

Everything the optimizer closes over lives here, together with the one place
that turns params (local, inside shard_map; or global with their specs,
outside) into a :class:`~jaxsync.Layout` whose buffer keys carry the labels,
the finalize rules and the axes each param varies over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core.held import check_not_held
from ..core.introspect import is_muon
from ..core.names import group_of, param_name
from ..core.specs import local_shape, param_specs_of, spec_axes
from ..core.validate import check_param_leaves, check_param_specs
from ..layout.layout import Layout
from ..layout.ownership import WholeMatrices
from ..layout.placement import build_layout
from ..layout.records import BufferKey
from ..sync.finalize import SyncRules, beyond_data, sync_keys
from .checks import check_labels
from .elementwise import check_elementwise
from .layerwise import owned_transform
from .loss_scale import LossScale, init_loss_scale
from .state import DistributedOptimizerState, initial_metrics

PyTree = Any
Labels = PyTree | Callable[[PyTree], PyTree] | None

MUON_NOT_MATRIX = (
    "param {path} has shape {shape} and is routed to a `jaxsync.whole_matrices` "
    "optax.contrib.muon, which orthogonalizes 2-D matrices only: on {what} it would "
    "silently run its Adam instead. {fix} To train what optax.multi_transform trains "
    "on one device (muon deciding by its own dimension numbers), pass the muon without "
    "`jaxsync.whole_matrices`: it is then handed each param whole in the param tree."
)
OWNED_VARYING = (
    "param {path} (local shape {shape}) is routed to a `jaxsync.whole_matrices` optimizer "
    "but is sharded over mesh axes {axes}: whole-matrix ownership needs the whole matrix "
    "on its owner. Replicate it over those axes, or give it a flat-sharded optimizer label."
)


class Plan:
    """Everything the transformation closes over; hashable by identity."""

    def __init__(
        self,
        inner: optax.GradientTransformation | Mapping[str, optax.GradientTransformation],
        axes: tuple[str, ...],
        labels: Labels,
        bucket_size: int | None,
        reduce_dtype: Any,
        clip_grad_norm: float | None,
        loss_scale: LossScale,
        check_elementwise: bool,
        rules: SyncRules | None = None,
        stacked: tuple[str, ...] = (),
        deterministic: Any = None,
        norms: bool = False,
    ):
        self.deterministic = deterministic
        self.norms = norms  # update and param norms in the metrics (optim.logged)
        self.rate = False  # a learning rate in the metrics: set by jaxsync.train_step
        self.unit_prints = False  # units' gradient fingerprints: set by jaxsync.train_step
        # A buffer per stacked param (each gathered in the forward, or cast in the update
        # on one device, straight into its own array): set by jaxsync.train_step.
        self.split_stacks = False
        self.rules = rules
        self.stacked = stacked
        self.inner = inner
        self.axes = axes
        self.labels = labels
        self.bucket_size = bucket_size
        self.reduce_dtype = reduce_dtype
        self.clip_grad_norm = clip_grad_norm
        self.loss_scale = loss_scale
        self.check_elementwise = check_elementwise

    # ------------------------------------------------------------- layout
    def label_tree(self, params: PyTree) -> PyTree | None:
        if self.labels is None:
            return None
        labels = self.labels(params) if callable(self.labels) else self.labels
        assert isinstance(self.inner, Mapping)
        check_labels(params, labels, self.inner)
        return labels

    def layout(
        self,
        params: PyTree,
        mesh_shape: Mapping[str, int],
        varying: Sequence[tuple[str, ...]],
    ) -> Layout:
        """The layout for local params, given which non-DP axes each one varies over."""
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        labels = self.label_tree(params)
        labs = [None] * len(leaves)
        if labels is not None:
            labs = jax.tree.leaves(jax.tree.map(lambda _, lab: lab, params, labels))
        syncs = sync_keys(self.rules, params, self.axes, mesh_shape)
        by_path = {}
        for (path, _), lab, sync, var in zip(leaves, labs, syncs, varying, strict=True):
            name = jax.tree_util.keystr(path)
            bad = set(var) & set(sync.dp_axes)
            if bad:
                raise ValueError(
                    f"param {param_name(path)} differs across data-parallel axes {sorted(bad)}; "
                    "params must be replicated over the axes the optimizer shards over. Pass "
                    "it with a PartitionSpec that does not name those axes (or mark an "
                    "expert axis with jaxsync.ExpertParallel)."
                )
            by_path[name] = (lab, sync, tuple(sorted(var)), param_name(path))

        muons: dict[Any, bool] = {}  # closures read once per label, not once per param

        def muon_label(lab: Any) -> bool:
            if lab not in muons:
                muons[lab] = is_muon(self.transform_of(lab))
            return muons[lab]

        def key_fn(path: str, leaf: Any) -> BufferKey:
            lab, sync, var, dotted = by_path[path]
            owned = self.owned_cost(lab)
            if owned is not None and var:
                raise ValueError(OWNED_VARYING.format(path=path, shape=leaf.shape, axes=var))
            if owned is not None and muon_label(lab) and not self.transform_of(lab).tree:
                self._check_matrix(dotted, tuple(leaf.shape))
            # With split_stacks a stacked param lies in a buffer of its own: a layer
            # gathered in the forward (a held group) then gathers each param straight
            # into its own array, with no copy of it cut out of a gathered bucket.
            stacked = self.split_stacks and owned is None and group_of(dotted, self.stacked)
            return BufferKey(
                jnp.dtype(leaf.dtype).name,
                sync.dp_axes,
                lab,
                sync.sum_axes,
                sync.mean_axes,
                var,
                owned=owned,
                part=dotted if stacked else None,
            )

        return build_layout(
            params,
            num_shards=lambda key: math.prod(mesh_shape[a] for a in key.axes),
            bucket_size=self.bucket_size,
            key_fn=key_fn,
            stacked=self.stacked,
        )

    def layout_inside(self, params: PyTree) -> Layout:
        """Layout inside shard_map: local shapes, varying axes from the params' types."""
        check_not_held(params, "distributed_optimizer")
        mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
        return self.layout(params, mesh_shape, beyond_data(params, self.axes, self.rules))

    def layout_outside(
        self, params: PyTree, mesh: Mesh, param_specs: PyTree = None
    ) -> tuple[Layout, PyTree, PyTree]:
        """Layout from global params (outside shard_map): (layout, local params, specs)."""
        check_not_held(params, "distributed_optimizer")
        check_param_leaves(params, "distributed_optimizer")
        specs = param_specs_of(params, param_specs)
        check_param_specs(params, specs, mesh)
        local = jax.tree.map(
            lambda x, spec: jax.ShapeDtypeStruct(local_shape(x.shape, spec, mesh), x.dtype),
            params,
            specs,
            is_leaf=lambda x: isinstance(x, P),
        )
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        varying = [spec_axes(spec) for spec in jax.tree.leaves(specs, is_leaf=is_spec)]
        return self.layout(local, dict(mesh.shape), varying), local, specs

    def _check_matrix(self, name: str, shape: tuple[int, ...]) -> None:
        """Muon owns 2-D matrices: a param (or a stacked param's layer) of another rank
        would get its Adam fallback, which no test of the user would notice."""
        group = group_of(name, self.stacked)
        row = shape[1:] if group is not None else shape
        if len(row) == 2:
            return
        if group is not None:
            what, fix = (
                f"each layer of stacked group {group!r} (shape {row})",
                "Label it for an elementwise optimizer (muon_labels does for non-matrices).",
            )
        elif len(shape) == 3:
            what, fix = (
                "a 3-D array",
                "If it is a stack of layers [L, m, n], pass `stacked=` naming its group "
                "(each layer's matrix is then owned whole); else label it for an "
                "elementwise optimizer.",
            )
        else:
            what, fix = (f"a {len(shape)}-D array", "Label it for an elementwise optimizer.")
        raise ValueError(MUON_NOT_MATRIX.format(path=name, shape=shape, what=what, fix=fix))

    def transform_of(self, label: str | None) -> Any:
        return self.inner if label is None else self.inner[label]

    def owned_cost(self, label: str | None) -> Any:
        """The ownership cost model of ``label``'s params, None where flat-sharded."""
        tx = self.transform_of(label)
        return tx.owned if isinstance(tx, WholeMatrices) else None

    def inner_for(
        self, layout: Layout, buffer: int, rank: Any = None
    ) -> optax.GradientTransformation:
        """The transformation run on ``buffer``'s shard; for an owned buffer, its
        matrices' (``rank``: this rank's index, static or traced; None: read it)."""
        tx = self.transform_of(layout.buffers[buffer].key.label)
        if isinstance(tx, WholeMatrices):
            return owned_transform(layout, buffer, tx, rank)
        return tx

    # --------------------------------------------------------------- init
    def init_for_rank(
        self, params: PyTree, layout: Layout, rank_of: Callable[[int], Any]
    ) -> DistributedOptimizerState:
        flat = layout.flatten(params, jnp.float32)
        master, inner_state = [], []
        for bi in range(len(layout.buffers)):
            shard = layout.shard_of(bi, flat[bi], rank_of(bi))
            master.append(shard)
            inner_state.append(self.inner_for(layout, bi, rank_of(bi)).init(shard))
        return DistributedOptimizerState(
            master=tuple(master),
            inner_state=tuple(inner_state),
            loss_scale=init_loss_scale(self.loss_scale),
            metrics=initial_metrics(
                len(layout.slots),
                self.norms,
                self.rate,
                self.deterministic.units if self.unit_prints else 0,
            ),
        )

    def check(self, params: PyTree, layout: Layout) -> None:
        if not self.check_elementwise:
            return
        for bi, buf in enumerate(layout.buffers):
            if buf.key.owned is not None:  # whole matrices: no flat shards to probe
                continue
            # The tree as optax.multi_transform hands it to the label's optimizer on one
            # device: the real names, other labels' params masked out. A transform keyed
            # by names then acts on the tree and not on the nameless shards, and the
            # probe sees the difference (a list here hid it: 6e-2 off in a run).
            keep = {layout.slots[i].path for i in buf.slots}
            sub = jax.tree_util.tree_map_with_path(
                lambda path, x, keep=keep: jax.ShapeDtypeStruct(np.shape(x), jnp.float32)
                if jax.tree_util.keystr(path) in keep else optax.MaskedNode(),
                params,
            )  # fmt: skip
            what = "all params" if buf.key.label is None else f"label {buf.key.label!r}"
            check_elementwise(self.inner_for(layout, bi), sub, what)

    def state_specs(
        self, params: PyTree, mesh: Mesh, param_specs: PyTree = None
    ) -> DistributedOptimizerState:
        layout, local, _ = self.layout_outside(params, mesh, param_specs)
        # The probe first: an optimizer keyed by the param tree (muon's dimension
        # numbers, a mask tree) fails on a flat shard, inside optax, in the line below.
        self.check(local, layout)
        shapes = jax.eval_shape(lambda p: self.init_for_rank(p, layout, lambda _: 0), local)

        def spec_for(bi: int) -> Callable[[Any], P]:
            buf = layout.buffers[bi]
            shape = (*buf.lead, layout.shard_size(bi))
            sharded = P(*(None,) * len(buf.lead), buf.key.axes + buf.key.varying)
            if buf.key.owned is not None:  # every rank's own packed vectors
                return lambda x: sharded
            return lambda x: sharded if tuple(x.shape) == shape else P()

        return DistributedOptimizerState(
            master=tuple(spec_for(bi)(m) for bi, m in enumerate(shapes.master)),
            inner_state=tuple(
                jax.tree.map(spec_for(bi), s) for bi, s in enumerate(shapes.inner_state)
            ),
            loss_scale=jax.tree.map(lambda _: P(), shapes.loss_scale),
            # P(None, ...) per dimension: what the step returns for a replicated array
            metrics=jax.tree.map(lambda x: P(*(None,) * x.ndim), shapes.metrics),
        )

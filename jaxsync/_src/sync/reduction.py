"""How local gradients become global ones: the default strategy, bucketed sums.

The public entry points (:mod:`grad_sync`) validate their arguments, pick a
strategy once with :func:`reduction_of` and hand it the whole call: this module's
:class:`Bucketed` (float sums per bucket, in ``reduce_dtype``), or deterministic
mode's :class:`~jaxsync._src.deterministic.strategy.ExactSums`. Both offer the
same three calls, so no function below an entry point tests which mode it is in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core.axes import AxisName, bound_axes
from ..core.validate import check_local_loss
from ..deterministic.exact import UNIT_GRADS_WITHOUT_MODE
from ..deterministic.strategy import ExactSums
from ..deterministic.units import Deterministic, UnitGrads, check_deterministic
from ..layout.layout import Layout
from ..layout.placement import build_layout
from ..layout.records import BufferKey
from ..program.grad_program import value_and_grad as program_value_and_grad
from .checks import check_local_grads
from .collectives import bucket_all_reduce
from .finalize import SyncRules, local_view, sync_keys
from .scan_sync import sync_rules, sync_value_and_grad

PyTree = Any


class Bucketed:
    """Local gradients of a device-varying view, reduced bucket by bucket as floats."""

    def value_and_grad(
        self, fun: Callable[..., Any], axis_name: AxisName, argnums: Any, has_aux: bool,
        rules: SyncRules | None, sync: Any,
    ) -> Callable[..., Any]:  # fmt: skip
        if sync is not None:
            return _synced(fun, sync, argnums, has_aux, rules)
        vg = program_value_and_grad(fun, argnums=argnums, has_aux=has_aux)
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            axes = bound_axes(axis_name, "jaxsync.value_and_grad")
            args = list(args)
            for i in nums:
                args[i] = local_view(args[i], axes, rules)
            out, grads = vg(*args, **kwargs)
            check_local_loss(out, axes, has_aux, axis_name)
            return out, grads

        return wrapped

    def accumulate(
        self, fun: Callable[..., Any], params: PyTree, microbatches: PyTree,
        axes: tuple[str, ...], has_aux: bool, accum_dtype: Any, rules: SyncRules | None,
        sync: Any, all_aux: bool = False,
    ) -> tuple[Any, PyTree]:  # fmt: skip
        """``all_aux``: the aux of every microbatch, stacked (``train_step`` combines
        them into the step's one-device aux); otherwise the last one's."""
        n = jax.tree.leaves(microbatches)[0].shape[0]
        if sync is not None:
            return self._accumulate_synced(
                fun, params, microbatches, n, axes, has_aux, sync, all_aux
            )
        vg = self.value_and_grad(fun, axes, 0, has_aux, rules, None)

        def body(acc: PyTree, mb: PyTree) -> tuple[PyTree, Any]:
            out, g = vg(params, mb)
            acc = jax.tree.map(lambda a, x: a + x.astype(accum_dtype), acc, g)
            return acc, out

        # The first microbatch seeds the carry, so it has the gradients' exact type
        # (device-varying over whichever axes they are).
        out0, g0 = vg(params, jax.tree.map(lambda m: m[0], microbatches))
        total = jax.tree.map(lambda g: g.astype(accum_dtype), g0)
        rest = jax.tree.map(lambda m: m[1:], microbatches)
        total, outs = jax.lax.scan(body, total, rest)
        outs = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), out0, outs)
        grads = jax.tree.map(lambda g: g / n, total)
        if has_aux:
            losses, aux = outs
            return (jnp.mean(losses), aux if all_aux else jax.tree.map(lambda a: a[-1], aux)), grads
        return jnp.mean(outs), grads

    def _accumulate_synced(
        self, fun: Callable[..., Any], params: PyTree, microbatches: PyTree, n: int,
        axes: tuple[str, ...], has_aux: bool, sync: Any, all_aux: bool = False,
    ) -> tuple[Any, Any]:  # fmt: skip
        """Megatron's sync in the last microbatch: the first k-1 run without
        communication; each layer's sum is added before its reduction in the last."""
        last = jax.tree.map(lambda m: m[-1], microbatches)
        acc = None
        if n > 1:
            head = jax.tree.map(lambda m: m[:-1], microbatches)
            out0, acc = self.accumulate(
                fun, params, head, axes, has_aux, jnp.float32, sync_rules(sync), None, all_aux
            )
            acc = jax.tree.map(lambda g: g * (n - 1), acc)  # the sum, not the mean
        out, grads = sync_value_and_grad(
            fun, sync, params, (last,), has_aux=has_aux, acc=acc, microbatches=n,
            fn="jaxsync.accumulate_grads",
        )  # fmt: skip
        if n == 1:
            if all_aux and has_aux:
                out = (out[0], jax.tree.map(lambda a: jnp.asarray(a)[None], out[1]))
            return out, grads
        if has_aux:
            (loss0, aux0), (loss, aux) = out0, out
            if all_aux:  # the first n - 1, then the last
                last = jax.tree.map(lambda b: jnp.asarray(b)[None], aux)
                aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), aux0, last)
            return ((loss0 * (n - 1) + loss) / n, aux), grads
        return (out0 * (n - 1) + out) / n, grads

    def all_reduce(
        self, grads: PyTree, axis_name: AxisName, bucket_size: int | None, reduce_dtype: Any,
        average: bool, rules: SyncRules | None, fn: str,
    ) -> PyTree:  # fmt: skip
        if isinstance(grads, UnitGrads):
            raise TypeError(UNIT_GRADS_WITHOUT_MODE.format(fn=fn, units=grads.units))
        axes = bound_axes(axis_name, fn)
        layout = sync_layout(grads, axes, bucket_size, rules)
        check_local_grads(grads, layout, fn, axis_name=axis_name, rules=rules)
        return bucket_all_reduce(
            grads, layout, axis_name=axes, reduce_dtype=reduce_dtype, average=average
        )


BUCKETED = Bucketed()


def reduction_of(deterministic: Deterministic | bool | None) -> Bucketed | ExactSums:
    """The strategy for ``deterministic=`` (checked): exact sums, or bucketed floats."""
    det = check_deterministic(deterministic)
    return BUCKETED if det is None else ExactSums(det)


def _synced(
    fun: Callable[..., Any], sync: Any, argnums: Any, has_aux: bool, rules: Any
) -> Callable[..., Any]:
    if not isinstance(argnums, int):
        raise ValueError(
            f"with `sync`, `argnums` must be a single int (the params argument), got {argnums!r}."
        )
    if rules is not None:
        raise ValueError(
            "with `sync`, pass `rules` to the sync (jaxsync.DataParallel(rules=...) or "
            "distributed_optimizer(rules=...)), not to value_and_grad: one place decides them."
        )

    def wrapped(*args: Any) -> Any:
        args = list(args)
        params = args[argnums]

        def call(p: PyTree, *rest: Any) -> Any:
            return fun(*rest[:argnums], p, *rest[argnums:])

        others = args[:argnums] + args[argnums + 1 :]
        return sync_value_and_grad(call, sync, params, others, has_aux=has_aux)

    return wrapped


def sync_layout(
    grads: PyTree,
    axes: tuple[str, ...],
    bucket_size: int | None,
    rules: SyncRules | None = None,
) -> Layout:
    """The one-shard layout a bucketed all-reduce of ``grads`` runs over."""
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    syncs = sync_keys(rules, grads, axes, shape)
    by_path = {
        jax.tree_util.keystr(p): s
        for (p, _), s in zip(jax.tree_util.tree_flatten_with_path(grads)[0], syncs, strict=True)
    }

    def key_fn(path: str, leaf: Any) -> BufferKey:
        s = by_path[path]
        return BufferKey(jnp.dtype(leaf.dtype).name, s.dp_axes, None, s.sum_axes, s.mean_axes)

    return build_layout(grads, num_shards=1, bucket_size=bucket_size, key_fn=key_fn)

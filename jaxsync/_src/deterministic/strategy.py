"""Deterministic mode as a reduction strategy: every sum of one step is exact.

:func:`jaxsync.value_and_grad`, :func:`jaxsync.accumulate_grads`,
:func:`jaxsync.all_reduce_grads` and :func:`jaxsync.sync_grads` pick their
strategy once, from ``deterministic=`` (or from the :class:`~jaxsync.UnitGrads`
they are handed), and hand the whole call to it: the default one
(:class:`~jaxsync._src.sync.reduction.Bucketed`) or this one. Nothing below the
entry point asks again which mode it is in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .exact import all_reduce_unit_grads
from .units import Deterministic, check_det_args, deterministic_value_and_grad, unit_value_and_grad

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ExactSums:
    """Sums over units in fixed point: bitwise the same mean at any DP size.

    ``det`` is None only for :func:`jaxsync.all_reduce_grads` handed
    :class:`~jaxsync.UnitGrads` without ``deterministic=``: the units are then read
    off the gradients.
    """

    det: Deterministic | None

    def value_and_grad(
        self, fun: Callable[..., Any], axis_name: Any, argnums: Any, has_aux: bool,
        rules: Any, sync: Any,
    ) -> Callable[..., Any]:  # fmt: skip
        return deterministic_value_and_grad(fun, axis_name, argnums, has_aux, rules, sync, self.det)

    def accumulate(
        self, fun: Callable[..., Any], params: PyTree, microbatches: PyTree,
        axes: tuple[str, ...], has_aux: bool, accum_dtype: Any, rules: Any, sync: Any,
    ) -> tuple[Any, Any]:  # fmt: skip
        del accum_dtype  # the sum is exact, in fixed point
        fn = "jaxsync.accumulate_grads"
        check_det_args(0, rules, sync, fn)
        return unit_value_and_grad(
            fun, params, microbatches, self.det, axes, has_aux=has_aux, fn=fn
        )

    def all_reduce(
        self, grads: Any, axes: Any, bucket_size: int | None, reduce_dtype: Any,
        average: bool, rules: Any, fn: str,
    ) -> PyTree:  # fmt: skip
        del reduce_dtype  # the sum is exact
        return all_reduce_unit_grads(grads, axes, bucket_size, average, rules, self.det, fn)

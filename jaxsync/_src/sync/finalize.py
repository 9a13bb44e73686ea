"""Per-parameter sync rules across parallelism modes (Megatron's finalize_model_grads).

Data parallelism reduces every gradient over the data axes. Other parallel
modes add reductions that depend on the parameter, declared here by path
pattern instead of attributes set on modules:

- :class:`Tied`: a param held by several stages of a pipeline axis (a tied
  input/output embedding on the first and last stage, or Colossal-AI's shared
  modules, in groups of stages) has its gradient summed within each group.
- :class:`SequenceParallel`: a param replicated over the tensor axis but fed a
  different sequence chunk on each tensor rank (layernorms under sequence
  parallelism) has its gradient summed (or averaged) over that axis.
- :class:`ExpertParallel`: a param sharded over an expert axis is reduced only
  over the remaining (expert-data-parallel) axes, with the averaging factor of
  the whole data-parallel group, as Megatron scales expert gradients.

The rules resolve to a static :class:`ParamSync` per parameter, which becomes
part of its :class:`~jaxsync.BufferKey`: params with different reductions live in
different buffers, and each bucket's extra reductions are psums over named axes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

from ..core.axes import to_varying, varying_axes
from ..core.names import param_name

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Tied:
    """Gradient summed over the stages of ``axis`` that hold the param.

    Args:
      axis: the pipeline mesh axis.
      groups: disjoint groups of stage indices that each share one copy
        (e.g. ``((0, 3),)`` for first and last of 4 stages); None: all stages.
        Stages outside every group keep their own gradient.
    """

    axis: str = "pipe"
    groups: tuple[tuple[int, ...], ...] | None = None


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Gradient summed over ``axis`` (or averaged, with ``average=True``)."""

    axis: str = "tensor"
    average: bool = False


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Param sharded over ``axis``: reduced over the other data-parallel axes only."""

    axis: str = "expert"


Rule = Tied | SequenceParallel | ExpertParallel


def summed_axes(rules: Any) -> frozenset[str]:
    """The axes every rule of ``rules`` (a :class:`SyncRules` or None) that names them
    sums the gradients over (``Tied``, ``SequenceParallel()``): a loss computed in
    pieces over such an axis is the sum of its pieces."""
    kinds: dict[str, set[bool]] = {}
    for _, rule in getattr(rules, "rules", ()):
        if isinstance(rule, Tied | SequenceParallel):
            kinds.setdefault(rule.axis, set()).add(_sums(rule))
    return frozenset(a for a, k in kinds.items() if k == {True})


def _sums(rule: Tied | SequenceParallel) -> bool:
    """Whether ``rule`` sums the gradient over its axis (else it averages it)."""
    return isinstance(rule, Tied) or not rule.average


class ParamSync(NamedTuple):
    """How one param's gradient is reduced (static; part of its buffer key)."""

    dp_axes: tuple[str, ...]
    sum_axes: tuple[tuple[str, tuple[tuple[int, ...], ...] | None], ...] = ()
    mean_axes: tuple[str, ...] = ()

    @property
    def owned_axes(self) -> tuple[str, ...]:
        """Axes whose reduction jaxsync performs (grads are kept local over them)."""
        return self.dp_axes + tuple(a for a, _ in self.sum_axes) + self.mean_axes


@dataclasses.dataclass(frozen=True)
class SyncRules:
    """An ordered set of ``(pattern, rule)`` pairs, matched on dotted param names.

    A pattern is a regular expression searched in names such as
    ``"blocks.0.ln1.scale"`` (:func:`jaxsync.param_name`). A param may match
    several rules on different axes (a tied embedding under sequence
    parallelism is both :class:`Tied` and :class:`SequenceParallel`).

    Example:
      >>> rules = jaxsync.SyncRules.of({
      ...     r"^embed\\.": [jaxsync.Tied("pipe"), jaxsync.SequenceParallel("tensor")],
      ...     r"\\.ln\\d?\\.": jaxsync.SequenceParallel("tensor"),
      ...     r"^moe\\.experts\\.": jaxsync.ExpertParallel("expert"),
      ... })
    """

    rules: tuple[tuple[str, Rule], ...] = ()

    @staticmethod
    def of(rules: Mapping[str, Rule | Sequence[Rule]]) -> SyncRules:
        pairs = []
        for pattern, rule in rules.items():
            for r in rule if isinstance(rule, list | tuple) else (rule,):
                if not isinstance(r, Tied | SequenceParallel | ExpertParallel):
                    raise TypeError(
                        f"rule for pattern {pattern!r} must be jaxsync.Tied, "
                        f"SequenceParallel or ExpertParallel, got {r!r}."
                    )
                pairs.append((pattern, r))
        return SyncRules(tuple(pairs))

    def resolve(
        self, params: PyTree, dp_axes: tuple[str, ...], mesh_shape: Mapping[str, int]
    ) -> list[ParamSync]:
        """One :class:`ParamSync` per leaf of ``params``, after checking the rules."""
        names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        return list(_resolve(self, tuple(names), dp_axes, tuple(mesh_shape.items())))


def _check_rule(rule: Rule, dp_axes: tuple[str, ...], shape: dict[str, int]) -> None:
    what = f"rule {rule}"
    if rule.axis not in shape:
        raise ValueError(
            f"{what} names axis {rule.axis!r}, which is not in the mesh; the mesh has "
            f"axes {tuple(shape)} with sizes {tuple(shape.values())}."
        )
    if isinstance(rule, ExpertParallel):
        if rule.axis not in dp_axes:
            raise ValueError(
                f"{what}: the expert axis must be one of the data-parallel axes {dp_axes} "
                "(the batch is split over it; expert params are reduced over the others)."
            )
        if len(dp_axes) < 2:
            raise ValueError(
                f"{what}: expert params need another data-parallel axis to "
                f"reduce over; `axis_name` is only {dp_axes}."
            )
    elif rule.axis in dp_axes:
        raise ValueError(
            f"{what}: axis {rule.axis!r} is a data-parallel axis, which every gradient is "
            "already reduced over; name the pipeline or tensor axis."
        )
    if isinstance(rule, Tied) and rule.groups is not None:
        n = shape[rule.axis]
        flat = [i for g in rule.groups for i in g]
        if any(not 0 <= i < n for i in flat) or len(set(flat)) != len(flat):
            raise ValueError(
                f"{what}: groups must be disjoint stage indices in [0, {n}) for axis "
                f"{rule.axis!r} of size {n}, got {rule.groups}."
            )


@functools.lru_cache(maxsize=64)
def _resolve(
    rules: SyncRules,
    names: tuple[str, ...],
    dp_axes: tuple[str, ...],
    mesh_shape: tuple[tuple[str, int], ...],
) -> tuple[ParamSync, ...]:
    shape = dict(mesh_shape)
    matched: list[dict[str, Rule]] = [{} for _ in names]
    for pattern, rule in rules.rules:
        _check_rule(rule, dp_axes, shape)
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"rule pattern {pattern!r} is not a valid regular expression: {e}"
            ) from e
        hits = [i for i, n in enumerate(names) if rx.search(n)]
        if not hits:
            sample = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ValueError(
                f"rule pattern {pattern!r} ({rule}) matches no parameter. An unmatched rule is "
                "an error, not a warning: it almost always is a typo that would leave those "
                f"gradients unreduced. Param names look like: {sample}."
            )
        for i in hits:
            prev = matched[i].get(rule.axis)
            if prev is not None and prev != rule:
                raise ValueError(
                    f"param {names[i]} is matched by two conflicting rules on axis "
                    f"{rule.axis!r}: {prev} and {rule}. Make the patterns disjoint."
                )
            matched[i][rule.axis] = rule
    out = []
    for m in matched:
        dp, sums, means = dp_axes, [], []
        for rule in m.values():
            if isinstance(rule, ExpertParallel):
                dp = tuple(a for a in dp if a != rule.axis)
            elif _sums(rule):
                sums.append((rule.axis, getattr(rule, "groups", None)))
            else:
                means.append(rule.axis)
        out.append(ParamSync(dp, tuple(sorted(sums)), tuple(sorted(means))))
    return tuple(out)


def sync_keys(
    rules: SyncRules | None,
    params: PyTree,
    dp_axes: tuple[str, ...],
    mesh_shape: Mapping[str, int],
) -> list[ParamSync]:
    """Per-leaf :class:`ParamSync`; without rules every param is plain data parallel."""
    if rules is None or not rules.rules:
        return [ParamSync(dp_axes)] * len(jax.tree.leaves(params))
    return rules.resolve(params, dp_axes, mesh_shape)


def expert_axes(rules: SyncRules | None) -> frozenset[str]:
    """The mesh axes of ``rules``' :class:`ExpertParallel` rules."""
    if rules is None:
        return frozenset()
    return frozenset(r.axis for _, r in rules.rules if isinstance(r, ExpertParallel))


def beyond_data(tree: Any, axes: tuple[str, ...], rules: SyncRules | None) -> list[tuple[str, ...]]:
    """Per leaf of ``tree`` (inside shard_map), the mesh axes its values vary over beside
    the data ``axes`` that are not expert axes, in the mesh's order: an expert param's
    expert axis, a tensor-parallel piece's axis. A buffer's key carries them
    (``BufferKey.varying``), so its in-loop gradients are typed as they are computed."""
    data_only = frozenset(axes) - expert_axes(rules)
    order = jax.sharding.get_abstract_mesh().axis_names
    return [
        tuple(a for a in order if a in varying_axes(x) - data_only) for x in jax.tree.leaves(tree)
    ]


def local_view(tree: Any, axes: tuple[str, ...], rules: SyncRules | None) -> Any:
    """``tree`` typed device-varying over the data ``axes`` and each leaf's rule-owned axes.

    Differentiating w.r.t. this view yields local, unreduced gradients over exactly
    the axes jaxsync reduces (bucket by bucket); over any other axis JAX's autodiff
    keeps reducing replicated params as it always does.
    """
    if rules is None:
        return to_varying(tree, axes)
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    syncs = sync_keys(rules, tree, axes, shape)
    leaves, treedef = jax.tree.flatten(tree)
    owned = [to_varying(x, axes + s.owned_axes) for x, s in zip(leaves, syncs, strict=True)]
    return jax.tree.unflatten(treedef, owned)

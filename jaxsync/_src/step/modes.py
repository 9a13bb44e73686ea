"""The data-parallel modes of :func:`jaxsync.train_step`, as values.

Each mode is a frozen value that carries only its own options, the way
Megatron-Core keeps a ``DistributedDataParallelConfig`` and FSDP2 a
``MixedPrecisionPolicy``: ``jaxsync.FSDP(units=...)`` has no ``bucket_size`` and
``jaxsync.ZeRO(...)`` no ``units``, so a wrong mix cannot be written, only a
typo, which Python refuses. The strings ``"ddp"``, ``"zero"`` and ``"fsdp"`` stay
as shorthand for the defaults; :func:`mode_of` turns either form (and the
keywords ``train_step`` took before the values existed) into one value, checked
once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax.numpy as jnp

from ..core.validate import check_bool, check_float_dtype
from ..deterministic.units import Deterministic, check_deterministic
from ..fsdp.gather import MixedPrecision
from ..layout.placement import check_bucket_size
from ..sync.checks import check_rules
from ..sync.finalize import SyncRules


@dataclasses.dataclass(frozen=True)
class _Bucketed:
    """Options shared by the two modes that reduce flat, bucketed buffers."""

    bucket_size: int | None = None
    reduce_dtype: Any = jnp.float32
    rules: SyncRules | None = None
    deterministic: Deterministic | None = None

    name: ClassVar[str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_size", check_bucket_size(self.bucket_size))
        # None: each gradient reduced in its own dtype (DDP; ZeRO requires a dtype)
        check_float_dtype(self.reduce_dtype, f"{type(self).__name__}.reduce_dtype", allow_none=True)
        check_rules(self.rules)
        det = check_deterministic(self.deterministic, f"{type(self).__name__}.deterministic")
        object.__setattr__(self, "deterministic", det)
        fp32 = self.reduce_dtype is None or jnp.dtype(self.reduce_dtype) == jnp.float32
        if det is not None and not fp32:
            raise ValueError(
                f"{type(self).__name__}: `deterministic` sums exactly in fixed point and hands "
                f"fp32 on; `reduce_dtype={jnp.dtype(self.reduce_dtype).name}` would be ignored. "
                "Drop `reduce_dtype`, or drop `deterministic`."
            )
        if det is not None and self.rules is not None:
            raise ValueError(
                f"{type(self).__name__}: `deterministic` supports plain data parallelism only; "
                "drop `rules`, or drop `deterministic`."
            )


@dataclasses.dataclass(frozen=True)
class DDP(_Bucketed):
    """Plain data parallelism: a replicated optax state, local gradients all-reduced
    bucket by bucket (Megatron's ``DistributedDataParallel``).

    With ``stacked=`` groups on more than one device, each layer's gradient is
    reduce-scattered inside the backward loop and the reduced stack gathered after it,
    for the update (``jaxsync.DataParallel(shard_grads=True)``): the bytes of an
    all-reduce, and the whole reduced stack is never held beside the activations.

    Attributes:
      bucket_size: elements per communication bucket (None: one bucket per buffer).
      reduce_dtype: dtype of the gradient reduction (fp32 by default, also for bf16
        models).
      rules: :class:`jaxsync.SyncRules` for params not reduced over the data axes
        alone (tied, sequence-parallel, expert-parallel).
      deterministic: a :class:`jaxsync.Deterministic` (or True): results bitwise
        identical at every data-parallel size dividing its ``units``.

      param_dtype: the dtype the loss reads the params in (None: their own). Each
        floating param is cast once per step, before the loss, as a ``jax.jit`` step
        that casts its fp32 params to bf16 does, instead of in every layer of the
        forward and again in the backward. The gradients are still reduced in
        ``reduce_dtype`` and applied to the params in their own dtype.

    Example:
      >>> step = jaxsync.train_step(loss_fn, optax.adam(1e-3), mesh, jaxsync.DDP(bucket_size=2**22))
    """

    param_dtype: Any = None

    name: ClassVar[str] = "ddp"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float_dtype(self.param_dtype, "DDP.param_dtype", allow_none=True)


@dataclasses.dataclass(frozen=True)
class ZeRO(_Bucketed):
    """The distributed optimizer (ZeRO-1/2): gradients reduce-scattered bucket by bucket,
    each rank updating its shard of the fp32 master weights and optimizer state, then
    all-gathering the params. The default mode.

    On a 1-D mesh, stacked-layer groups (``stacked=``) are held only as the master
    shards and gathered layer by layer in the next forward, where the gather overlaps
    compute (Megatron's ``overlap_param_gather``); read the params with
    ``step.params(state)``.

    Attributes: as :class:`DDP`'s, and
      reshard_after_forward: free each layer gathered in the forward and gather it
        again in the backward (FSDP's reshard; the default). The backward gathers the
        next layer while it computes this one, so the second gather costs no step time
        on XLA's model of H100s (Llama-style 1.1B on 8: 146.4 ms kept, 144.0
        resharded; 7.2B on 64: 412.5 / 399.7 ms) and frees the params whole (7792 ->
        6037 MiB, 20412 -> 7688 MiB per GPU). False keeps the gathered layers for the
        backward, whatever the layer body's remat policy (the memory of the params
        whole, as ZeRO-1 holds them): each layer gathered once per step.

    Example:
      >>> step = jaxsync.train_step(loss_fn, optax.adamw(1e-3), mesh, jaxsync.ZeRO())
    """

    reshard_after_forward: bool = True

    name: ClassVar[str] = "zero"

    def __post_init__(self) -> None:
        super().__post_init__()
        # the optimizer's math runs in ``reduce_dtype``: None names no dtype here
        check_float_dtype(self.reduce_dtype, "ZeRO.reduce_dtype")
        check_bool(self.reshard_after_forward, "ZeRO.reshard_after_forward")


@dataclasses.dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallelism (ZeRO-3 / FSDP2): params, gradients and optimizer
    state all sharded, each unit gathered when the model reads it.

    Attributes:
      units: FSDP units as dotted param-name prefixes (default: one per top-level
        entry; stacked groups are their own units, gathered layer by layer).
      policy: the :class:`jaxsync.MixedPrecision` policy (gather, compute and
        reduction dtypes).
      reshard_after_forward: free each gathered unit after the forward and gather it
        again in the backward (less memory, one more all-gather per unit).

    Example:
      >>> fsdp = jaxsync.FSDP(policy=jaxsync.MixedPrecision(param_dtype=jnp.bfloat16))
      >>> step = jaxsync.train_step(loss_fn, optax.adamw(1e-3), mesh, fsdp)
    """

    units: tuple[str, ...] | None = None
    policy: MixedPrecision | None = None
    reshard_after_forward: bool = True

    name: ClassVar[str] = "fsdp"

    def __post_init__(self) -> None:
        if self.units is not None:
            if isinstance(self.units, str) or not isinstance(self.units, Sequence):
                raise TypeError(
                    f"`FSDP.units` must be a sequence of param-name prefixes, e.g. "
                    f"('embed', 'blocks', 'head'), got {self.units!r}."
                )
            object.__setattr__(self, "units", tuple(self.units))
        if self.policy is not None and not isinstance(self.policy, MixedPrecision):
            raise TypeError(f"`FSDP.policy` must be a jaxsync.MixedPrecision, got {self.policy!r}.")
        check_bool(self.reshard_after_forward, "FSDP.reshard_after_forward")


Mode = DDP | ZeRO | FSDP
MODES: dict[str, type] = {"ddp": DDP, "zero": ZeRO, "fsdp": FSDP}

#: ``train_step`` keywords that became options of a mode value.
MODE_OPTIONS = {
    "bucket_size": (DDP, ZeRO),
    "reduce_dtype": (DDP, ZeRO),
    "rules": (DDP, ZeRO),
    "deterministic": (DDP, ZeRO),
    "units": (FSDP,),
    "policy": (FSDP,),
    "reshard_after_forward": (FSDP, ZeRO),
}


def _spelling(cls: type, options: dict[str, Any]) -> str:
    def shown(v: Any) -> str:  # a dtype as it is written: jnp.bfloat16
        try:
            if isinstance(v, type | jnp.dtype):
                return f"jnp.{jnp.dtype(v).name}"
        except TypeError:
            pass
        return repr(v)

    args = ", ".join(f"{k}={shown(v)}" for k, v in options.items())
    return f"jaxsync.{cls.__name__}({args})"


def mode_of(mode: Any, options: dict[str, Any], fn: str = "jaxsync.train_step") -> Mode:
    """``mode`` (a string or a mode value) and the old per-mode keywords as one value.

    The keywords still work with a string (``mode="fsdp", units=...``); one that
    belongs to another mode, or given beside a mode value, is an error that shows
    the value to write instead.
    """
    unknown = sorted(set(options) - set(MODE_OPTIONS))
    for key in unknown:  # an option only a mode value takes: show the value to write
        owners = [c for c in MODES.values() if key in {f.name for f in dataclasses.fields(c)}]
        if owners:
            named = MODES.get(mode) if isinstance(mode, str) else type(mode)
            if named not in owners:
                where = f"mode={mode!r}" if isinstance(mode, str) else f"jaxsync.{named.__name__}"
                raise TypeError(_foreign(key, options[key], where, owners))
            raise TypeError(
                f"{fn}: `{key}` is an option of the mode value, not a keyword of "
                f"{fn}; pass it inside it: {_spelling(named, {key: options[key]})}."
            )
    if unknown:
        raise TypeError(f"{fn}() got unexpected keyword argument(s) {unknown}.")
    if isinstance(mode, DDP | ZeRO | FSDP):
        cls = type(mode)
        for key, value in options.items():
            if cls not in MODE_OPTIONS[key]:
                raise TypeError(_foreign(key, value, f"jaxsync.{cls.__name__}"))
        if options:
            merged = {
                **{f.name: getattr(mode, f.name) for f in dataclasses.fields(mode)
                   if getattr(mode, f.name) != f.default},
                **options,
            }  # fmt: skip
            raise TypeError(
                f"{fn}: {sorted(options)} are options of the mode; pass them inside it: "
                f"{_spelling(cls, merged)}."
            )
        return mode
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"`mode` must be jaxsync.DDP(...), jaxsync.ZeRO(...) or jaxsync.FSDP(...) (or "
            f"the shorthand 'ddp', 'zero' or 'fsdp'), got {mode!r}."
        )
    cls = MODES[mode]
    # ``options`` holds only the keywords the caller wrote (``**mode_options``), so
    # one of another mode is refused at any value, its default too: dropping it
    # would train without what the caller asked for.
    foreign = [key for key in options if cls not in MODE_OPTIONS[key]]
    if foreign:
        raise ValueError(_foreign(foreign[0], options[foreign[0]], f"mode={mode!r}"))
    return cls(**options)


def _foreign(key: str, value: Any, mode: str, owners: Any = None) -> str:
    owners = MODE_OPTIONS[key] if owners is None else owners
    names = " or ".join(f"jaxsync.{c.__name__}" for c in owners)
    return (
        f"`{key}` is an option of {names}, not of {mode}. Drop `{key}`, or train with "
        f"{_spelling(owners[-1], {key: value})}."
    )


def deterministic_of(mode: Mode) -> Deterministic | None:
    """The mode's :class:`jaxsync.Deterministic`, or None (FSDP has none)."""
    return mode.deterministic if isinstance(mode, _Bucketed) else None

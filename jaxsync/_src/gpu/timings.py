"""What a schedule report holds: the step's modeled figures, per computation and collective.

Frozen records only: :mod:`read` fills them from XLA's dump, and :mod:`schedule`
compiles the program that writes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class CollectiveTiming:
    """One asynchronous collective as the scheduler placed it.

    Attributes:
      name: the ``*-start`` (or ``async-start``) instruction.
      kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``, ...
      computation: the computation it sits in.
      runs: how many times it runs per step (loop trip counts multiplied).
      bytes: result bytes of one run.
      modeled_us: its own modeled duration, start to done.
      overlap_us: modeled compute time scheduled between its start and its done.
      overlap_ops: number of compute instructions scheduled there.
      is_sync: XLA's ``is_sync`` (run as a blocking collective, no overlap possible).
    """

    name: str
    kind: str
    computation: str
    runs: int
    bytes: int
    modeled_us: float
    overlap_us: float
    overlap_ops: int
    is_sync: bool


@dataclasses.dataclass(frozen=True)
class AsyncTiming:
    """One asynchronous op that is not a collective (a dynamic slice on another
    stream, say), as XLA charged it and as :attr:`ScheduleReport.repriced_us` prices it.

    Attributes:
      name: its start instruction.
      computation: the computation it sits in.
      runs: runs per step.
      bytes: what it reads and writes in device memory per run (a slice at the part
        it takes).
      xla_us: its start-to-done span on XLA's timeline (XLA gives such an op a flat
        5000-cycle latency: 5 ms on the H100 target).
      repriced_us: its measured time where a kernel table names what it runs, else
        ``bytes`` over the target's memory bandwidth.
    """

    name: str
    computation: str
    runs: int
    bytes: int
    xla_us: float
    repriced_us: float


@dataclasses.dataclass(frozen=True)
class Hotspot:
    """One costly instruction: its modeled time per run and runs per step."""

    name: str
    opcode: str
    computation: str
    us: float
    runs: int
    op_name: str

    @property
    def total_us(self) -> float:
        return self.us * self.runs


@dataclasses.dataclass(frozen=True)
class ComputationTiming:
    """One computation's modeled time per run, and how often it runs per step.

    ``source`` is ``"xla"`` (the scheduler's ``total_cycles``, or its price of the
    same kernels in the pricing twin), ``"roofline"``, or ``"xla+roofline"`` (the
    twin held some of its kernels); ``span_us`` is the scheduler's makespan of it;
    ``walk_us`` is XLA's statistics rule replayed on the dumped (scheduled) order
    (see :attr:`ScheduleReport.walk_us`); ``repriced_us`` the same walk with
    non-collective async ops at their bytes and measured kernel times where given,
    ``measured_us`` the part of it from measured times
    (see :attr:`ScheduleReport.repriced_us`).
    """

    name: str
    runs: int
    own_us: float
    source: str
    exposed_us: Mapping[str, float]
    span_us: float = 0.0
    walk_us: float = 0.0
    repriced_us: float = 0.0
    measured_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """A GPU step as XLA's latency-hiding scheduler modeled it; times in microseconds.

    Attributes:
      step_us: the modeled step by XLA's scheduler statistics: every computation's
        ``total_cycles`` times its runs. XLA computes them on the order from before
        its latency-hiding scheduler moved the collectives, so they can charge a
        collective's latency that the schedule hides (:attr:`makespan_us`).
      roofline_us: the part of ``step_us`` priced by the roofline, not by XLA: the
        kernels of skipped computations that the pricing twin could not price.
      roofline_scale: the factors applied to those roofline figures, for matmul
        kernels and for the rest: XLA's modeled time of the same class of kernels
        in the scheduled computations over their roofline.
      exposed_us: per collective kind, the time it runs with nothing to overlap.
      computations: every priced computation.
      collectives: every asynchronous collective.
      memory: ``memory_analysis()`` per device, bytes: ``arguments``, ``outputs``,
        ``aliased``, ``temps`` and ``peak`` (arguments + outputs - aliased + temps).
      device: the GPU the program was compiled for.
      hotspots: the costliest compute instructions of the scheduled computations
        (time x runs), dearest first: where to look for the step's cost.
      hlo_text: the compiled module (``jaxsync.overlap_report(report.hlo_text)``
        says where each collective sits).
      async_ops: every asynchronous op that is not a collective, repriced at its
        bytes (:attr:`repriced_us`).
      bandwidth: the memory bandwidth (bytes/s) they were repriced at: the target
        GPU's (:class:`jaxsync.GpuSpec`), the rate XLA's cost model gives
        memory-bound kernels of that target.
      kernel_table: how many measured kernel times were given (``kernel_times``).
    """

    step_us: float
    roofline_us: float
    roofline_scale: tuple[float, float]
    exposed_us: Mapping[str, float]
    computations: tuple[ComputationTiming, ...]
    collectives: tuple[CollectiveTiming, ...]
    memory: Mapping[str, int]
    device: str
    hotspots: tuple[Hotspot, ...] = ()
    hlo_text: str = dataclasses.field(default="", repr=False)
    async_ops: tuple[AsyncTiming, ...] = ()
    bandwidth: float = 0.0
    kernel_table: int = 0

    @property
    def exposed_total_us(self) -> float:
        return sum(self.exposed_us.values())

    @property
    def xla_share(self) -> float:
        """The share of ``step_us`` that XLA's own cost model priced (the rest: roofline)."""
        return 1.0 - self.roofline_us / self.step_us if self.step_us else 1.0

    @property
    def readings_gap(self) -> float:
        """How far the timeline reads from the statistics: ``makespan / step - 1``.
        Negative where the scheduler hid collectives the statistics still charge;
        beyond 5% either way, quote both (:meth:`summary` says so and why)."""
        return self.makespan_us / self.step_us - 1.0 if self.step_us else 0.0

    @property
    def makespan_us(self) -> float:
        """The step by the scheduler's own timeline: the schedule XLA will run.

        ``step_us`` (XLA's scheduler statistics) walks each computation adding each
        instruction's cost and, at an async done, what is left of its latency; but
        XLA walks the order from before its latency-hiding scheduler installed its
        own. Where that older order has a collective's start and done side by side,
        the statistics charge its whole latency, however much compute the schedule
        put beside it; the timeline credits the overlap: a reduce-scatter beside two
        independent matmuls on 8 x H100 reads 6.11 ms in the statistics (3.74 ms of
        compute + its 2.37 ms latency) and 3.75 ms on the timeline; :attr:`walk_us`,
        the statistics' rule replayed on the scheduled order, reads 3.74 ms
        (``tests/test_readings.py``). The timeline can read higher too: a 6.7B fp32
        DDP step on 64 x H100 reads 200.8 ms in the statistics and 474.1 ms on the
        timeline, whose per-layer all-reduces run one after another. Read both
        before trusting a ratio.
        """
        return sum(c.span_us * c.runs for c in self.computations)

    @property
    def walk_us(self) -> float:
        """The scheduled-order walk: XLA's statistics rule on the dumped order.

        Each instruction's modeled duration added in the order the scheduler chose;
        at each async done, what is left of the collective's latency since its start.
        The dump carries no latency, so each pair's span on the timeline stands for it
        (at least the latency; the same where the scheduler waited on it, and moot
        where compute fills it): a reading checkable by hand from the dump, close to
        :attr:`makespan_us` (which also holds the scheduler's one-cycle edges) and
        below :attr:`step_us` by what the schedule hid. Computations XLA did not
        schedule hold nothing asynchronous: their kernels' sum.
        """
        return sum(c.walk_us * c.runs for c in self.computations)

    @property
    def repriced_us(self) -> float:
        """The step walked on the scheduled order (:attr:`walk_us`'s rule), repriced.

        XLA's cost model has no rule for an asynchronous op that is not a collective
        and charges each a flat 5000 cycles at its done (5 ms on the H100 target);
        here each is priced at its bytes over :attr:`bandwidth`
        (:attr:`async_ops`), and each kernel named in ``kernel_times`` at its
        measured time; a done waits for what is left of its op's time since its
        start, so what the schedule put between them hides it. A collective keeps
        its span on XLA's timeline, as in :attr:`walk_us`.
        Without either, it equals :attr:`walk_us`. XLA's own readings stay as they
        were (:attr:`step_us`, :attr:`makespan_us`).
        """
        return sum(c.repriced_us * c.runs for c in self.computations)

    @property
    def measured_us(self) -> float:
        """The part of :attr:`repriced_us` priced from measured kernel times."""
        return sum(c.measured_us * c.runs for c in self.computations)

    @property
    def measured_share(self) -> float:
        """``measured_us / repriced_us``: how much of the repriced step was measured."""
        return self.measured_us / self.repriced_us if self.repriced_us else 0.0

    def collective_bytes(self, kind: str | None = None) -> int:
        """Bytes moved per step (result bytes x runs), of one kind or all."""
        return sum(c.bytes * c.runs for c in self.collectives if kind in (None, c.kind))

    def summary(self) -> str:
        """A plain-text account: step, exposure by kind, memory, loops."""
        lines = [
            f"{self.device}: modeled step {self.step_us / 1e3:.3f} ms "
            f"({self.roofline_us / 1e3:.3f} ms of it by roofline, matmuls x"
            f"{self.roofline_scale[0]:.2f}, other kernels x{self.roofline_scale[1]:.2f}), "
            "exposed communication "
            f"{self.exposed_total_us / 1e3:.3f} ms ({self.exposed_total_us / self.step_us:.1%})",
        ]
        lines.append(f"  on the scheduler's timeline: {self.makespan_us / 1e3:.3f} ms"
                     f" ({self.readings_gap:+.1%})")
        if abs(self.readings_gap) > 0.05:
            lines.append(
                "  the two readings differ by more than 5%: quote both (the statistics "
                "price the order from before the scheduler moved the collectives; the "
                "timeline is the schedule)"
            )
        lines.append(f"  priced by XLA's cost model: {self.xla_share:.1%}")
        if self.bandwidth:  # read from a dump (the rule below applied)
            runs = sum(a.runs for a in self.async_ops)
            lines.append(
                f"  repriced: {self.repriced_us / 1e3:.3f} ms against {self.walk_us / 1e3:.3f}"
                f" ms on the same walk: {len(self.async_ops)} asynchronous non-collective ops"
                f" ({runs} runs per step) at their bytes over {self.bandwidth / 1e12:.2f} TB/s,"
                f" {self.measured_share:.1%} of it from {self.kernel_table} measured kernel times"
            )
            for a in sorted(self.async_ops, key=lambda a: -a.xla_us * a.runs)[:8]:
                lines.append(
                    f"    {a.name} ({a.computation}) x {a.runs}: {a.bytes / 2**20:.1f} MiB, "
                    f"XLA {a.xla_us:.1f} us, repriced {a.repriced_us:.1f} us"
                )
        for kind, us in sorted(self.exposed_us.items()):
            lines.append(f"  exposed {kind}: {us / 1e3:.3f} ms")
        m = self.memory
        lines.append(
            f"  memory per device: args {m['arguments'] / 2**20:.1f} MiB, temps "
            f"{m['temps'] / 2**20:.1f} MiB, peak {m['peak'] / 2**20:.1f} MiB"
        )
        for c in self.computations:
            if c.runs > 1 or c.source == "roofline":
                lines.append(f"  {c.name}: {c.own_us / 1e3:.3f} ms x {c.runs} ({c.source})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()



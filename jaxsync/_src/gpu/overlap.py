"""Where each collective sits in a compiled step, and what runs while it is in flight.

With scanned layers (``[L, ...]`` params run by ``lax.scan``) a gradient sync placed
after ``jax.grad`` cannot overlap with backprop; only a collective issued inside
the backward loop body can. :func:`overlap_report` reads the compiled HLO and says,
for every collective, which computation and which ``while`` loop it sits in, whether
that loop is a forward or a transposed (backward) loop, and, for asynchronous
collectives in a scheduled module, how many compute instructions the schedule
places between its ``-start`` and its ``-done``.

What XLA:CPU does (jax 0.10.2, 8 simulated devices): collectives are synchronous
(plain ``all-reduce(...)``, no ``-start``/``-done``), so nothing overlaps and
``overlap_ops`` is ``None``. A collective issued in a scan body stays in that
loop's body computation: XLA:CPU neither unrolls (L=2 stays a loop) nor hoists or
sinks it, nor combines it across the loop boundary. A loop of trip count 1 is
removed by the while-loop simplifier, and its collective then sits in the entry
computation, though its ``op_name`` still says ``.../while/body/...``.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from .hlo import _ARRAY, COLLECTIVES, _arrays

ROLES = ("forward", "backward", "unknown")

# Not compute that can hide a collective: plumbing, copies (layout and loop-carry
# moves), other communication; `-start`/`-done`/`-update` forms are excluded too.
_NOT_COMPUTE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy", "copy-start",
    "copy-done", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
    "domain", "send", "recv", *COLLECTIVES,
})  # fmt: skip
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_SHAPE = re.compile(r"[a-z]\w*\[[^\]]*\](?:\{[^}]*\})?")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_PAREN = re.compile(r"[(){}]")
_BRACKET = re.compile(r"[(){},]")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')

_NOT_HLO = (
    "`{fn}` needs compiled HLO (an `HloModule ...` text), got {got!r}. "
    "Pass `jax.jit(f).lower(*args).compile()` or its `.as_text()`; "
    "`.lower(...).as_text()` is StableHLO, before XLA placed anything."
)
_BAD_FILTER = "`{arg}` must be None or one of {allowed}, got {got!r}."


@dataclass(frozen=True)
class CollectiveSite:
    """One collective in the compiled module (an async ``-start``/``-done`` pair once).

    Attributes:
      name: instruction name (the ``-start`` for an async collective).
      kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
        ``"collective-permute"`` or ``"all-to-all"``.
      shapes: result arrays, e.g. ``("f32[2,16]",)``; several when XLA combined
        collectives into one tuple-shaped op.
      bytes: result bytes, summed over ``shapes``.
      computation: the HLO computation holding the instruction.
      loops: the ``while`` instructions it runs inside, outermost first (a
        computation called from a loop body counts as inside that loop).
      where: ``"entry"`` when it runs once per step (outside every loop), else
        ``"/".join(loops)``.
      trip_count: times it runs per step: the product of the enclosing loops'
        ``known_trip_count`` (1 outside loops; ``None`` if XLA does not know one).
      loop_role: for the innermost loop, ``"backward"`` when its JAX ``op_name``
        holds ``transpose(`` (the scan's transposed loop), ``"forward"`` for any
        other JAX loop, ``"unknown"`` without metadata; ``None`` outside loops.
      is_async: issued as ``*-start``/``*-done`` (or ``async-start``).
      overlap_ops: compute instructions scheduled between start and done in the
        same computation; ``None`` for a synchronous collective (XLA:CPU's), which
        blocks until done, so nothing can overlap with it.
      overlap_names: their names (``None`` when ``overlap_ops`` is).
      op_name: the JAX ``op_name`` metadata of the instruction (``""`` if none).
    """

    name: str
    kind: str
    shapes: tuple[str, ...]
    bytes: int
    computation: str
    loops: tuple[str, ...]
    where: str
    trip_count: int | None
    loop_role: str | None
    is_async: bool
    overlap_ops: int | None
    overlap_names: tuple[str, ...] | None
    op_name: str

    @property
    def dtype(self) -> str:
        """The result dtype (``"f32,bf16"`` for a mixed combined op)."""
        return ",".join(dict.fromkeys(s.split("[")[0] for s in self.shapes))


@dataclass(frozen=True)
class OverlapReport:
    """Every collective of a compiled module, with its placement and overlap.

    Attributes:
      collectives: one :class:`CollectiveSite` per collective, in text order.
      scheduled: the module says ``is_scheduled=true``: the instruction order of
        each computation is the execution order, so ``overlap_ops`` is the schedule.
    """

    collectives: tuple[CollectiveSite, ...]
    scheduled: bool

    def __iter__(self):
        return iter(self.collectives)

    def __len__(self) -> int:
        return len(self.collectives)

    def in_loop(self, kind: str | None = None, role: str | None = None) -> list[CollectiveSite]:
        """Collectives inside some loop body, optionally of one kind and loop role."""
        _check("kind", kind, COLLECTIVES)
        _check("role", role, ROLES)
        return [
            c for c in self.collectives
            if c.loops and kind in (None, c.kind) and role in (None, c.loop_role)
        ]  # fmt: skip

    def in_entry(self, kind: str | None = None) -> list[CollectiveSite]:
        """Collectives that run once per step, outside every loop."""
        _check("kind", kind, COLLECTIVES)
        return [c for c in self.collectives if not c.loops and kind in (None, c.kind)]

    def counts(self) -> dict[tuple[str, str], int]:
        """Number of collective instructions per ``(kind, where)``."""
        out: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            out[c.kind, c.where] = out.get((c.kind, c.where), 0) + 1
        return out

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    @property
    def loop_fraction(self) -> float:
        """Share of collective bytes issued inside loop bodies (bytes per iteration)."""
        return sum(c.bytes for c in self.collectives if c.loops) / max(self.total_bytes, 1)

    @property
    def overlapped_fraction(self) -> float:
        """Share of collective bytes with at least one compute op between start and done."""
        return sum(c.bytes for c in self.collectives if c.overlap_ops) / max(self.total_bytes, 1)

    def summary(self) -> str:
        """A plain-text table: one row per collective, then the totals."""
        head = ("name", "kind", "result", "bytes", "where", "role", "overlap")
        rows = [head] + [
            (c.name, c.kind, " ".join(c.shapes), str(c.bytes), c.where, c.loop_role or "-",
             "sync" if c.overlap_ops is None else str(c.overlap_ops))
            for c in self.collectives
        ]  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"{len(self.collectives)} collectives, {self.total_bytes} bytes; "
            f"in loop bodies {self.loop_fraction:.0%}, overlapped by compute "
            f"{self.overlapped_fraction:.0%} (sync = blocking collective, nothing overlaps)"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def overlap_report(compiled_or_text: Any) -> OverlapReport:
    """Lists every collective of a compiled step: where it runs and what overlaps it.

    Args:
      compiled_or_text: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``)
        or its ``.as_text()``.

    Returns:
      An :class:`OverlapReport`.

    Example:
      >>> report = jaxsync.overlap_report(jax.jit(step).lower(params, batch).compile())
      >>> assert not report.in_entry("reduce-scatter")  # all inside the backward loop
      >>> print(report)
    """
    text = hlo_text(compiled_or_text)
    comps, entry = _parse(text)
    scheduled = bool(re.search(r"^HloModule\b[^\n]*\bis_scheduled=true", text, re.M))
    loops = _loop_context(comps, entry)
    wrapped = {
        callee
        for insts in comps.values() for inst in insts if inst.opcode == "async-start"
        for _, callee in inst.calls
    }  # fmt: skip
    sites = []
    for comp, insts in comps.items():
        if comp in wrapped or comp not in loops:
            continue  # async wrappers are reported at their async-start
        for i in range(len(insts)):
            site = _site(comps, comp, insts, i, loops[comp])
            if site is not None:
                sites.append(site)
    return OverlapReport(collectives=tuple(sites), scheduled=scheduled)


def hlo_text(compiled_or_text: Any, fn: str = "overlap_report") -> str:
    """The optimized HLO text of a ``jax.stages.Compiled`` (or that text), checked;
    ``fn``: the public function the errors name."""
    if not isinstance(compiled_or_text, str) and not hasattr(compiled_or_text, "as_text"):
        raise TypeError(_NOT_HLO.format(fn=fn, got=type(compiled_or_text).__name__))
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    if "HloModule" not in text:
        raise ValueError(_NOT_HLO.format(fn=fn, got=text.strip()[:60] + "..."))
    return text


@dataclass(frozen=True)
class _Inst:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    calls: tuple[tuple[str, str], ...]  # (attribute, computation)
    op_name: str
    attrs: str


def _parse(text: str) -> tuple[dict[str, list[_Inst]], str]:
    comps: dict[str, list[tuple[str, _Inst | None]]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
        elif line.strip().startswith("}"):
            current = None
        elif (inst := _parse_instruction(line)) or not comps[current]:
            comps[current].append((line, inst))
        elif line.strip():  # a hand-written instruction continued on the next line
            joined = comps[current][-1][0] + " " + line.strip()
            comps[current][-1] = (joined, _parse_instruction(joined))
    parsed = {c: [i for _, i in lines if i] for c, lines in comps.items()}
    return parsed, entry or next(reversed(comps), "")  # XLA prints the entry last


def _parse_instruction(line: str) -> _Inst | None:
    m = _INSTRUCTION.match(line)
    if not m:
        return None
    name, rest = m.groups()
    shape = ""
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    elif sm := _SHAPE.match(rest):
        shape, rest = sm.group(0), rest[sm.end() :].lstrip()
    om = _OPCODE.match(rest)
    if not om:
        return None
    end = _closing(rest, om.end() - 1)
    operands = tuple(o.split()[-1].lstrip("%") for o in _split_top(rest[om.end() : end]) if o)
    attrs = rest[end + 1 :]
    calls = tuple(
        (attr, c.strip().lstrip("%"))
        for attr, value in _CALLED.findall(attrs) for c in value.strip("{}").split(",") if c.strip()
    )  # fmt: skip
    op = _OP_NAME.search(attrs)
    return _Inst(name, shape, om.group(1), operands, calls, op.group(1) if op else "", attrs)


def _closing(s: str, start: int) -> int:
    """Index of the bracket closing the one at ``s[start]``."""
    depth = 0
    for m in _PAREN.finditer(s, start):
        depth += 1 if m.group() in "({" else -1
        if depth == 0:
            return m.start()
    return len(s) - 1


def _split_top(s: str) -> list[str]:
    """``s`` split at the commas outside any brackets."""
    cuts, depth = [-1], 0
    for m in _BRACKET.finditer(s):
        ch = m.group()
        if ch == ",":
            if depth == 0:
                cuts.append(m.start())
        else:
            depth += 1 if ch in "({" else -1
    return [s[a + 1 : b].strip() for a, b in zip(cuts, [*cuts[1:], len(s)], strict=True)]


def _loop_context(comps: dict[str, list[_Inst]], entry: str) -> dict[str, tuple]:
    """Per computation reachable from the entry: its enclosing ``(while, role, trips)``.

    Breadth-first, so a computation called from several places gets its
    shallowest placement (XLA clones loop bodies, so this is rare).
    """
    ctx: dict[str, tuple[tuple[str, str], ...]] = {entry: ()}
    queue = deque([entry])
    while queue:
        comp = queue.popleft()
        for inst in comps.get(comp, ()):
            for attr, callee in inst.calls:
                if callee in ctx or callee not in comps:
                    continue
                inner = ctx[comp]
                if inst.opcode == "while" and attr in ("body", "condition"):
                    body = next((c for a, c in inst.calls if a == "body"), callee)
                    trips = _TRIPS.search(inst.attrs)
                    role = _loop_role(inst, comps.get(body, []))
                    inner += ((inst.name, role, int(trips.group(1)) if trips else None),)
                ctx[callee] = inner
                queue.append(callee)
    return ctx


def _loop_role(while_inst: _Inst, body: list[_Inst]) -> str:
    """``backward`` for a transposed loop, from JAX's ``op_name`` metadata.

    On jax 0.10 a scan under ``jax.grad`` gives two while ops whose op_names
    read ``jit(step)/shard_map/jvp()/while`` (forward) and
    ``jit(step)/shard_map/transpose(jvp())/while`` (backward); with
    ``jax.checkpoint`` the body ops read ``.../transpose(jvp())/while/body/
    closed_call/checkpoint/...``. Anything inside a transposed scope is the
    backward pass. Without metadata on the while op, the body's op_names decide.
    """
    if "transpose(" in while_inst.op_name:
        return "backward"
    if while_inst.op_name.rsplit("/", 1)[-1].startswith("while"):
        return "forward"  # scan, fori_loop, while_loop, map all lower to `while`
    names = [i.op_name for i in body if i.op_name]
    if any("transpose(" in n for n in names):
        return "backward"
    return "forward" if any("while/body" in n for n in names) else "unknown"


def _site(comps, comp: str, insts: list[_Inst], i: int, loops) -> CollectiveSite | None:
    inst = insts[i]
    shape, is_async, kind = inst.shape, True, inst.opcode.removesuffix("-start")
    if inst.opcode in COLLECTIVES:
        is_async = False
    elif inst.opcode.endswith("-start") and kind in COLLECTIVES:
        shape = _start_result(kind, inst.shape)
    elif inst.opcode == "async-start":
        wrapped = [
            w for _, c in inst.calls for w in comps.get(c, []) if w.opcode in COLLECTIVES
        ]  # fmt: skip
        if not wrapped:
            return None
        kind, shape = wrapped[-1].opcode, wrapped[-1].shape
    else:
        return None
    overlap = None
    if is_async:
        done = _find_done(insts, i)
        if done is not None:
            shape = shape if inst.opcode == "async-start" else insts[done].shape
            overlap = tuple(x.name for x in insts[i + 1 : done] if _is_compute(x.opcode))
    names = tuple(w for w, _, _ in loops)
    trips = [t for _, _, t in loops]
    return CollectiveSite(
        name=inst.name,
        kind=kind,
        shapes=tuple(f"{t}[{dims}]" for t, dims in _ARRAY.findall(shape)),
        bytes=sum(b for _, b in _arrays(shape)),
        computation=comp,
        loops=names,
        where="/".join(names) or "entry",
        trip_count=None if None in trips else math.prod(trips),
        loop_role=loops[-1][1] if loops else None,
        is_async=is_async,
        overlap_ops=None if overlap is None else len(overlap),
        overlap_names=overlap,
        op_name=inst.op_name,
    )


def _start_result(kind: str, shape: str) -> str:
    """The results part of a ``*-start`` shape (used only when no ``-done`` is found).

    ``all-reduce-start`` has the all-reduce's own shape; the others hold
    ``(operands, results, context...)``.
    """
    if kind == "all-reduce" or not shape.startswith("("):
        return shape
    parts = _split_top(shape[1:-1])
    return parts[1] if len(parts) > 1 else shape


def _find_done(insts: list[_Inst], start: int) -> int | None:
    chain = {insts[start].name}
    for j in range(start + 1, len(insts)):
        x = insts[j]
        if x.operands and x.operands[0] in chain:
            if x.opcode.endswith("-done"):
                return j
            if x.opcode.endswith("-update"):
                chain.add(x.name)
    return None


def _is_compute(opcode: str) -> bool:
    return opcode not in _NOT_COMPUTE and not opcode.endswith(("-start", "-done", "-update"))


def _check(arg: str, value: str | None, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise ValueError(_BAD_FILTER.format(arg=arg, allowed=allowed, got=value))

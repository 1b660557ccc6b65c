"""Audits of a captured graph: where every address in it points, and which declared buffers each
segment touches, checked against the declarations. Both backends describe their graphs as
:class:`~graphctl.graphs.analysis.nodes.Node` lists, so the audit is one piece of code: kernel arguments
and copy addresses on CUDA, recorded ops' tensors (by storage identity) on the emulated backend.

**Pointer audit.** Every address is classified against the memory the runner knows
(:class:`~graphctl.graphs.analysis.nodes.Region`): a declared buffer or twin (with its offset),
graphctl's snapshot arenas, the runner's static inputs and outputs, frozen tensor arguments,
parameters the caller registered (``params=``), the graph's private pool; failing those, the
caching allocator's blocks outside the pool.

- **error** ``dangling``: an address in a *freed* allocator block (emulated: a tensor from
  outside the capture that only the graph still holds) that the node certainly uses: a whole
  pointer-sized kernel parameter, a copy's source or destination, a recorded op's tensor. The
  graph reads or writes memory the allocator may hand to anyone: the temporary allocated
  outside the pool (TensorRT-LLM #16290).
- **possible** ``dangling``: the same address found as a word *inside* a larger kernel parameter
  (a struct) or a library's packed argument buffer. Whether the kernel dereferences that word
  is unknown: TensorIterator's functors carry fixed-size arrays and padding whose unused words
  hold stale host-stack values, which on an H200 pointed into freed blocks in most captures of
  the reference engine while every replay equalled eager. Never an error by itself: a user
  would learn to ignore an audit that cries wolf. :func:`~graphctl.graphs.analysis.confirm.confirm`
  (``audit(confirm=True)``) settles each one by replaying with the region poisoned.
- **warning** ``unregistered``: an address in a live allocator block that nobody registered.
  Often a model weight not passed as ``params=``. Blocks that the runner's eager warmup
  allocated and kept (cuBLAS workspaces, other lazily created library state) and live memory
  in a CUDA library's kernel (arguments packed in ``extra``, or a cuBLAS/cuDNN/CUTLASS kernel
  name, ``nodes.LIBRARY_KERNEL_PREFIXES``) are ``workspace``: counted, not reported.
- Addresses in no known memory (sizes that look like pointers, TMA descriptor fields, memory
  from ``cudaMalloc`` outside torch) are counted as ``unknown``.

**Segment audit.** The nodes between switch boundaries form the segments (target, draft,
post). graphctl's own switch kernels are the declared machinery and are skipped.

- **error** ``refreshed-in-target``: a target-role segment (``target`` or ``post``) touches a
  buffer that is refreshed in place before replay (or recomputed from one). The refresh runs
  before the whole graph, so the target would read draft contents (TensorRT-LLM #16887). Named
  with the kernel or op.
- **warning** ``unread-reader``: a buffer whose ``readers=`` names a role that no node of that
  role touches. Buffers left at the default readers (any segment), host mirrors and ``Stable``
  scratch declare nothing to check.
- **error** ``stale-derived``: a node reads a derived buffer after a write of one of its
  ``Recompute`` inputs that no recompute followed (``meta.seq_lens.fill_(1)`` instead of
  ``state.write("seq_lens", ...)``, then a read of ``req_idx_per_token``): replay and eager are
  equally wrong, so ``verify()`` cannot see it. Named with the reading op, the write's op and
  node, the input and the derived buffer. A write of a derived buffer (its recompute, or a
  snapshot restore: a copy from graphctl's arena) makes it current again; ``Stable`` scratch
  inputs never make anything stale (recompute fns use them as workspace).

Kernel arguments do not say whether a kernel reads or writes a pointer, so on CUDA a "touch"
counts as both for usage. The stale-derived rule needs to know writes from reads, so on CUDA it
sees copies and memsets only (a kernel's touch of a derived buffer makes it current, never
flags); the emulated audit of the same forward, or ``GRAPHCTL_CHECK_STALE``, sees the rest.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from graphctl.graphs.analysis.nodes import Node, Region, census, flatten
from graphctl.state.spec import DEFAULT_READERS

__all__ = ["Finding", "Audit", "AddressMap", "audit_graph", "param_tensors"]

# Lookup order: the most specific name wins where regions overlap (an output lives in the pool).
# A freed block outranks a warmup allocation (the allocator's word on liveness is the latest).
# "boundary": an eager region's static outputs (graphs/capture/pieces.py), read by the piece after it.
_PRIORITY = {"buffer": 0, "arena": 0, "input": 0, "output": 1, "argument": 1, "param": 1, "boundary": 1, "pool": 2,
             "freed": 3, "workspace": 4, "live": 5}


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    severity: str  # "error", "possible" (an unconfirmed dangling word) or "warning"
    kind: str  # "dangling", "unregistered", "refreshed-in-target", "unread-reader", "stale-derived"
    buffer: str  # the buffer or memory region concerned
    segment: str  # the segment (or role, for unread-reader) it was found in
    op: str | None  # the kernel or op name
    message: str
    node: int | None = None
    where: str = ""  # which argument held the address
    region: tuple[int, int] | None = None  # the freed block [start, end) of a dangling finding
    evidence: str = ""  # how a possible finding was settled (confirm), or why it stays possible

    def __str__(self) -> str:
        at = f" (node {self.node}: {self.op}, {self.where})" if self.node is not None else ""
        why = f"; {self.evidence}" if self.evidence else ""
        return f"{self.severity} {self.kind}: [{self.buffer}] {self.message} in segment {self.segment}{at}{why}"


@dataclasses.dataclass(frozen=True, slots=True)
class Audit:
    """One bucket's audit: findings, what each segment touched, and the census."""

    bucket: int
    findings: tuple[Finding, ...]
    usage: Mapping[str, Mapping[str, str]]  # segment -> buffer -> "read" / "write" / "read+write" / "touch"
    classes: Mapping[str, int]  # region kind (or "unknown") -> addresses classified as such
    census: Mapping[str, Mapping[str, int]]
    dropped: tuple[Finding, ...] = ()  # possible findings a confirm replay showed harmless (with evidence)

    @property
    def possible(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "possible")

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    def to_dict(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "errors": len(self.errors), "possible": len(self.possible),
                "warnings": len(self.warnings), "findings": [dataclasses.asdict(f) for f in self.findings],
                "dropped": [dataclasses.asdict(f) for f in self.dropped],
                "usage": {s: dict(u) for s, u in self.usage.items()}, "classes": dict(self.classes),
                "census": {k: dict(v) for k, v in self.census.items()}}

    def __str__(self) -> str:
        buf = io.StringIO()
        more = f"{len(self.possible)} possible, " if self.possible else ""
        buf.write(f"bucket {self.bucket}: {len(self.errors)} errors, {more}{len(self.warnings)} warnings; "
                  f"addresses: {', '.join(f'{k} {v}' for k, v in sorted(self.classes.items()))}\n")
        for seg, used in self.usage.items():
            buf.write(f"  {seg}: {', '.join(f'{b} ({a})' for b, a in sorted(used.items())) or 'no declared buffer'}\n")
        for f in self.findings:
            buf.write(f"  {f}\n")
        for f in self.dropped:
            buf.write(f"  dropped {f}\n")
        return buf.getvalue()


class AddressMap:
    """Addresses to regions, most specific region first (see ``_PRIORITY``)."""

    def __init__(self, regions: Iterable[Region]) -> None:
        self.regions = sorted((r for r in regions if r.end > r.start), key=lambda r: (_PRIORITY[r.kind], r.start))

    def lookup(self, address: int) -> tuple[Region, int] | None:
        for r in self.regions:
            if r.start <= address < r.end:
                return r, address - r.start
        return None


def param_tensors(params: Any) -> dict[str, torch.Tensor]:
    """Model tensors by name from an ``nn.Module`` (parameters and buffers), a mapping of name to
    tensor or module, or an iterable of tensors and modules (nested iterables too). Anything
    else raises ``TypeError`` naming what was found: a silently ignored ``params=`` would turn
    every model tensor into "unknown" memory."""
    out: dict[str, torch.Tensor] = {}

    def add(prefix: str, v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out[prefix] = v
        elif isinstance(v, torch.nn.Module):
            for n, t in (*v.named_parameters(), *v.named_buffers()):
                out[f"{prefix}.{n}" if prefix else n] = t
        elif isinstance(v, Mapping):
            for k, e in v.items():
                add(f"{prefix}.{k}" if prefix else str(k), e)
        elif isinstance(v, Iterable) and not isinstance(v, (str, bytes)):
            for i, e in enumerate(v):
                add(f"{prefix}[{i}]" if prefix else f"param[{i}]", e)
        else:
            raise TypeError(f"audit params: {prefix or 'params'} is a {type(v).__qualname__}; expected an nn.Module, "
                            "a tensor, a mapping or an iterable of those")

    if params is not None:
        add("", params)
    return out


def _span(kind: str, name: str, t: torch.Tensor) -> Region | None:
    if not t.numel():
        return None
    st = t.untyped_storage()
    if t.is_contiguous():
        return Region(name, kind, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
    return Region(name, kind, st.data_ptr(), st.data_ptr() + st.nbytes())


def _role(segment: str) -> str:
    return "draft" if segment.startswith("draft") else "target"


def _merge(old: str | None, new: str) -> str:
    if old is None or old == new:
        return new
    return "touch" if "touch" in (old, new) else "read+write"


def audit_graph(graph: Any, bucket: int, *, known: Sequence[tuple[str, str, torch.Tensor]], segments: Sequence[Any],
                workspaces: Sequence[Region] = (), plan: Any = None, params: Any = None) -> Audit:
    """The pointer and segment audits of ``bucket``'s graph (see the module docstring), from
    explicit records: ``graph`` (its ``nodes()`` and ``memory_regions()``), ``known`` (the
    ``(kind, name, tensor)`` memory the runner owns: buffers, arenas, inputs, outputs, frozen
    arguments), its ``segments`` (``Segment``: name, start, end node), ``workspaces`` (what the
    warmups allocated and kept), the state's compiled ``plan`` (or None) and ``params``."""
    nodes: Sequence[Node] = graph.nodes()
    named = [r for kind, name, t in known if (r := _span(kind, name, t)) is not None]
    named += [r for n, t in param_tensors(params).items() if (r := _span("param", n, t)) is not None]
    amap = AddressMap(named + list(workspaces) + list(graph.memory_regions()))
    findings: list[Finding] = []
    classes: dict[str, int] = {}
    seg_of = {}
    for seg in segments:
        for i in range(seg.start, min(seg.end, len(nodes))):
            seg_of[i] = seg.name
    refreshed: set[str] = set()
    if plan is not None:
        refreshed = {n for n, d in plan.buffers.items() if d.refresh is not None}
        refreshed |= set(plan.closure(refreshed))
    usage: dict[str, dict[str, str]] = {s.name: {} for s in segments}
    reported: set[tuple] = set()
    for node, at in flatten(nodes):
        top = int(at.split("/")[0])
        seg = seg_of.get(top, "target")  # a body's nodes belong to their parent's segment
        for ref in node.refs:
            hit = amap.lookup(ref.address)
            kind = hit[0].kind if hit else "unknown"
            if kind == "live" and node.library:
                kind = "workspace"
            classes[kind] = classes.get(kind, 0) + 1
            if hit is None or node.graphctl:
                continue
            region, off = hit
            key = (at, region.name)
            where = ref.where if at == str(top) else f"body node {at}, {ref.where}"
            if kind == "freed" and key not in reported:
                reported.add(key)
                if ref.exact:
                    findings.append(Finding("error", "dangling", region.name, seg, node.name,
                                            f"{node.kind} uses {ref.address:#x} (+{off}) in memory freed since "
                                            "capture: a temporary allocated outside the graph's pool", top, where,
                                            (region.start, region.end)))
                else:
                    findings.append(Finding("possible", "dangling", region.name, seg, node.name,
                                            f"{node.kind} argument word {ref.address:#x} (+{off}) points into memory "
                                            "freed since capture; whether the kernel dereferences it is unknown "
                                            "(audit(confirm=True) replays with the block poisoned)", top, where,
                                            (region.start, region.end)))
            elif kind == "live" and key not in reported:
                reported.add(key)
                hint = ("the forward writes state graphctl does not know: declare it in a StateSpec or let "
                        "side_effects='restore' handle it" if ref.access == "write" else
                        "pass model tensors as params=")
                findings.append(Finding("warning", "unregistered", region.name, seg, node.name,
                                        f"{node.kind} uses {ref.address:#x} (+{off}) in a live allocation nobody "
                                        f"registered ({hint})", top, where))
            elif kind == "buffer":
                used = usage.setdefault(seg, {})
                first = region.name not in used
                used[region.name] = _merge(used.get(region.name), ref.access)
                if first and _role(seg) == "target" and region.name in refreshed:
                    findings.append(Finding("error", "refreshed-in-target", region.name, seg, node.name,
                                            f"target-role {node.kind} touches a buffer refreshed in place before "
                                            "replay", top, where))
    if plan is not None:
        for n, d in plan.buffers.items():
            if d.stable or d.host or d.readers == DEFAULT_READERS:
                continue  # nothing declared to check: scratch, host mirrors, or "any segment may read"
            for role in sorted({_role(x) for x in d.readers}):
                if not any(n in u for s, u in usage.items() if _role(s) == role):
                    findings.append(Finding("warning", "unread-reader", n, role, None,
                                            f"declared as read by {role} segments, none reads it"))
    if plan is not None:
        findings += _stale_reads(nodes, seg_of, amap, plan)
    return Audit(bucket, tuple(findings), usage, classes, census(nodes))


def _stale_reads(nodes: Sequence[Node], seg_of: Mapping[int, str], amap: AddressMap, plan: Any) -> list[Finding]:
    """The ``stale-derived`` rule (module docstring), in node order: which derived buffers a
    write of one of their inputs left stale, and which node read one before its recompute."""
    inputs = {n: set(d.derive.inputs) for n, d in plan.buffers.items() if d.derive is not None}
    scratch = {n for n, d in plan.buffers.items() if d.stable}
    # a Swap's twin stands for its base inside a draft segment: a write to the bound block table
    # there is a write of the recompute's input "block_table"
    twins: dict[str, set[str]] = {}
    for ph in plan.phases.values():
        for attr, twin in ph.swaps:
            twins.setdefault(twin, set()).add(attr)
    stale: dict[str, tuple[str, str, int]] = {}  # derived -> (input, writing op, node)
    out: list[Finding] = []
    for node, at in flatten(nodes):
        top = int(at.split("/")[0])
        hits = [(amap.lookup(r.address), r) for r in node.refs]
        named = [(h[0], r) for h, r in hits if h is not None and h[0].kind in ("buffer", "arena")]
        restore = any(reg.kind == "arena" and r.access == "read" for reg, r in named)
        snapshot = any(reg.kind == "arena" and r.access != "read" for reg, r in named)
        bufs = [(reg.name, r.access) for reg, r in named if reg.kind == "buffer"]
        touched = {b for b, _ in bufs} | {a for b, _ in bufs for a in twins.get(b, ())}
        for b, access in bufs:
            if b not in stale or node.graphctl or snapshot:
                continue
            if access == "write" or (access == "touch" and (node.kind == "kernel" or touched & inputs[b])):
                continue  # its recompute (or a kernel: read or write unknown); cleared below
            i, op, k = stale.pop(b)
            out.append(Finding("error", "stale-derived", b, seg_of.get(top, "target"), node.name,
                               f"{node.kind} reads '{b}' after {op} (node {k}) wrote its Recompute input '{i}' in "
                               f"place with no recompute between: write '{i}' through state.write(), not in place",
                               top, f"{'read' if access == 'read' else 'touch'} of {b}"))
        for b, access in bufs:
            if access == "read":
                continue
            stale.pop(b, None)  # written (or touched by a kernel): current again
            if access != "write" or restore or b in scratch:
                continue
            for name in {b} | twins.get(b, set()) if seg_of.get(top, "target").startswith("draft") else {b}:
                for d in plan.dependents.get(name, ()):
                    if d != b and not node.graphctl:
                        stale.setdefault(d, (name, node.name, top))
    return out


"""Segment audit of an emulated capture: which declared buffers each segment reads and writes,
found by storage identity from the recorded ops, checked against the declared readers.

- **error**: a target-role segment (``target`` or ``post``) reads a buffer that is refreshed in
  place before replay (or recomputed from one). At replay the refresh runs before the whole
  graph, so the target would read draft contents (TensorRT-LLM #16887). The finding names the
  op that reads it.
- **warning**: a buffer declared as read by a segment role that no op of that role reads.

graphctl's own ops (the switch's fused snapshot and restore) are the declared machinery and
are not counted as reads or writes. The CUDA pointer audit (issue 6) will report the same
findings from kernel arguments.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_leaves

from graphctl.graphs.emulated import EmulatedGraph

if TYPE_CHECKING:
    from graphctl.graphs.runner import GraphRunner

__all__ = ["Finding", "audit_segments"]


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    severity: str  # "error" or "warning"
    buffer: str
    segment: str
    op: str | None
    message: str

    def __str__(self) -> str:
        where = f" (op {self.op})" if self.op else ""
        return f"{self.severity}: [{self.buffer}] {self.message} in segment {self.segment}{where}"


def _is_view(func) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _role(segment: str) -> str:
    return "draft" if segment.startswith("draft") else "target"


def audit_segments(runner: "GraphRunner", bucket: int) -> list[Finding]:
    """The findings for ``bucket``'s emulated graph (see the module docstring)."""
    graph, state = runner.graph(bucket), runner.state
    if state is None or not isinstance(graph, EmulatedGraph):
        return []  # the CUDA pointer audit is issue 6's; without a state there is nothing declared
    plan = state.plan
    by_storage: dict[int, str] = {}
    for name in plan.buffers:
        t = state.tensor(name)
        if t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), name)
    refreshed = {n for n, d in plan.buffers.items() if d.refresh is not None}
    refreshed |= set(plan.closure(refreshed))
    reads: dict[str, dict[str, str]] = {"target": {}, "draft": {}}  # role -> buffer -> first op reading it
    findings = []
    ops = graph.recorded_ops()
    for seg in runner.segments(bucket):
        role = _role(seg.name)
        for func, args, kwargs in ops[seg.start:seg.end]:
            name = func._schema.name
            if name.startswith("graphctl::") or _is_view(func):
                continue  # the switch's own machinery; views read nothing (their consumers do)
            written = {i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and
                       a.alias_info.is_write}
            flat_args = [a for i, a in enumerate(args) if i not in written]
            for t in tree_leaves((flat_args, {k: v for k, v in kwargs.items() if k != "out"})):
                if not isinstance(t, torch.Tensor) or not t.numel():
                    continue
                buf = by_storage.get(t.untyped_storage().data_ptr())
                if buf is None:
                    continue
                first = buf not in reads[role]
                reads[role].setdefault(buf, name)
                if first and role == "target" and buf in refreshed:
                    findings.append(Finding("error", buf, seg.name, name,
                                            "target-role op reads a buffer refreshed in place before replay"))
    for n, d in plan.buffers.items():
        if d.stable:
            continue
        for r in sorted({_role(x) for x in d.readers}):
            if n not in reads[r]:
                findings.append(Finding("warning", n, r, None, f"declared as read by {r} segments, none reads it"))
    return findings

"""Captured graphs re-pointed at moved buffers, without recapture.

A KV pool grown or a block table reallocated means a new metadata object state: the user binds
it again (``bind`` refuses a buffer rebound behind its back). Every captured graph still bakes
the old addresses. Peers recapture everything (seconds per graph). graphctl knows, from the
bound states, which tensor every old address belonged to, so :func:`repoint` rewrites the
addresses in place (``plan_repoint``: every check first, then one call that rewrites):

- every declared buffer (twins and ``Stable`` scratch included) and every snapshot arena of the
  old state is paired with the same entry of the new one; each pair must agree in shape, dtype,
  strides and device (:class:`~graphctl.errors.RepointError` otherwise, nothing patched);
- each graph rewrites every reference into an old span to the same offset in the new one:
  emulated graphs swap the recorded tensors for views of the new storage; CUDA graphs patch
  the kernel-node arguments and the memcpy/memset addresses of the instantiated graph
  (``cuGraphExec*NodeSetParams``) and of its template. An address the CUDA backend cannot
  rewrite safely (inside a library kernel's opaque ``extra`` buffer, a conditional body or
  child graph, a copy straddling a moved buffer) refuses the whole re-point before anything
  changed;
- the runner then takes the new state and the new addresses as its manifest.

What stays the caller's job: the forward must read the new state too (an engine holding
``self.state`` sets it to the new one), and the old buffers' contents are not copied.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from graphctl.errors import RepointError
from graphctl.graphs.replay.rebinding import with_entries
from graphctl.state.validate import byte_range

__all__ = ["Move", "entries", "lookup", "moves_between", "plan_repoint"]


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """Bytes ``[start, end)`` of ``name`` now live at ``new_start`` (same layout)."""

    name: str
    start: int
    end: int
    new_start: int
    new: torch.Tensor  # the tensor now at new_start (emulated graphs re-view its storage)

    def map(self, address: int) -> int | None:
        """The new address of ``address``, or None when it is not in this move's span."""
        return address - self.start + self.new_start if self.start <= address < self.end else None


def moves_between(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> list[Move]:
    """The moves from ``old`` to ``new`` (name -> tensor, the same names), unmoved ones left
    out; :class:`RepointError` naming the first entry whose layout differs."""
    if set(old) != set(new):
        missing, extra = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        raise RepointError("the new state declares other buffers", buffer=(missing or extra)[0],
                           expected=f"the captured state's {len(old)} entries",
                           found=f"missing {missing}, extra {extra}",
                           fix="bind the new metadata object with the same spec the graphs were captured with")
    moves = []
    for name, a in old.items():
        b = new[name]
        if (a.shape, a.dtype, a.stride(), a.device) != (b.shape, b.dtype, b.stride(), b.device):
            raise RepointError("a moved buffer changed its layout", buffer=name,
                               expected=f"{tuple(a.shape)} {a.dtype} strides {a.stride()} on {a.device}",
                               found=f"{tuple(b.shape)} {b.dtype} strides {b.stride()} on {b.device}",
                               fix="allocate the new buffer with the captured shape, dtype and strides (a different "
                                   "size bakes different launch shapes: reset() and capture again)")
        if a.data_ptr() != b.data_ptr():
            start, end = byte_range(a)
            moves.append(Move(name, start, end, b.data_ptr(), b))
    spans = sorted((m.start, m.end, m.new_start - m.start, m.name) for m in moves)
    for (_, e0, d0, n0), (s1, _, d1, n1) in zip(spans, spans[1:]):
        if s1 < e0 and d0 != d1:  # declared aliases share memory: they must move together, by one offset
            raise RepointError("two moved buffers overlap in the old memory but moved apart", buffer=n1,
                               expected=f"{n1} at the same offset from {n0} as before", found="a different offset",
                               fix="keep aliased buffers views of one new tensor, as they were of the old one")
    return moves


def lookup(moves: list[Move], address: int) -> int | None:
    """The new address of ``address`` under ``moves``, or None when none covers it."""
    for m in moves:
        if (got := m.map(address)) is not None:
            return got
    return None


def entries(state: Any) -> dict[str, torch.Tensor]:
    """What a state's captured graphs may hold the address of: its declared buffers (twins and
    scratch included) and its snapshot arenas."""
    out = {n: state.tensor(n) for n in state.plan.buffers}
    out.update({f"arena {n}": t for n, t in state.arenas().items()})
    return out


def plan_repoint(runner: Any, new: Any) -> Callable[[], dict[int, int]]:
    """Check now that every captured bucket of ``runner`` (a ``GraphRunner``) can be re-pointed
    from its state to ``new`` (``RepointError`` otherwise, nothing changed); the returned call
    rewrites them all, gives the runner ``new`` and the new addresses as its manifests, and says
    per bucket how many nodes (CUDA) or recorded tensors (emulated) it rewrote. The caller runs
    it with interrupts held and drops every graph if it raises partway (``graphs/face.py``)."""
    old = runner.state
    if old is None or new is None:
        raise RepointError("re-pointing needs the runner's bound state", buffer=None,
                           expected="a runner built with state= and a newly bound state of the same spec",
                           found="no state" if old is None else "None", fix="pass state= to graphed(), then "
                           "runner.repoint(graphctl.bind(meta)) after moving its buffers")
    graphs = {b: runner.record(b) for b in runner.captured}
    moves = moves_between(entries(old), entries(new)) if new is not old else []
    applies = {b: cap.graph.repoint(moves) for b, cap in graphs.items()} if moves else {}
    addresses = new.addresses()

    def apply() -> dict[int, int]:
        done = {b: fn() for b, fn in applies.items()}
        for cap in graphs.values():
            cap.manifest = {n: addresses.get(n, a) for n, a in cap.manifest.items()}
            cap.checked = False
        runner.capture.paths = with_entries(runner.capture.paths, new)  # the declared entries, as bound now
        runner.state = new
        return {b: done.get(b, 0) for b in graphs}

    return apply

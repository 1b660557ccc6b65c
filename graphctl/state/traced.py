"""The switch and ``write`` as ``torch.compile`` traces them (``fullgraph=True``).

Under ``torch.compiler.is_compiling()`` a :class:`~graphctl.state.bound.BoundState` hands out
:class:`TracedSwitch` instead of the transactional ``Switch``, and ``write`` goes through
:func:`traced_write`. Dynamo cannot trace what makes the eager switch transactional (a lock,
held signal handlers, the entering frame, the fused byte arena viewed as several dtypes), and
inside one compiled graph it needs none of it: the graph runs whole or raises, and attribute
rebindings are side effects Dynamo applies only after the graph ran. So the traced switch is
the same plan written as plain tensor code Dynamo and AOTAutograd understand:

- enter: clone every snapshotted buffer (functional copies, not the arena), copy the
  copy-in-place sources in, rebind the swapped attributes (and their declared views) to their
  twins, recompute the derived buffers in dependency order;
- ``write(name, value)``: copy into the rows given, pad the tail by the buffer's policy,
  recompute every dependent, transitively, where the attribute is bound now;
- exit: copy every snapshot back, rebind the bind-time originals.

A write the eager path refuses (an undeclared, derived or non-mutable buffer) and a nested
switch are refused while tracing too, but Dynamo cannot carry a raised exception out of a
``fullgraph=True`` trace: the compile stops with ``torch._dynamo.exc.Unsupported`` naming the
offending line, not with graphctl's typed error. Not traced: observers and the debug knobs
(``check_stale``, ``verify_restore``). Compile after ``bind``; a state used by a compiled function must not be
rebound behind graphctl's back (Dynamo guards on the attributes it read).
"""
from __future__ import annotations

from typing import Any

import torch

from graphctl.errors import SwitchError
from graphctl.state import paths
from graphctl.state.core import StateCore
from graphctl.state.steps import rebind_step

__all__ = ["TracedSwitch", "traced_write"]


class TracedSwitch:
    """A switch Dynamo inlines: see the module docstring."""

    def __init__(self, st: StateCore, role: str, phase: str) -> None:
        self.st, self.role, self.pp = st, role, st.plan.phases[phase]
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rebinds: list[Any] = []

    def __enter__(self) -> TracedSwitch:
        st, pp = self.st, self.pp
        if st._traced is not None:
            raise SwitchError("nested switch in a compiled function", expected="one switch at a time",
                              found=f"'{self.role}' inside '{st._traced.role}'", fix="exit the first switch first")
        self.saved = [(st.binding.tensors[n], st.binding.tensors[n].clone()) for n in pp.snapshot]
        st._traced = self
        for name, act in pp.copies:
            st.binding.tensors[name].copy_(st._source(act))
        self.rebinds = [rebind_step(st, name, twin) for name, twin in pp.swaps]  # the eager switch's own steps
        for step in self.rebinds:
            step.apply()
        for name in pp.recompute:
            st._recompute(name)
        return self

    def __exit__(self, *exc: Any) -> None:
        st = self.st
        for live, saved in self.saved:
            live.copy_(saved)
        for step in reversed(self.rebinds):
            step.undo()
        st._traced = None


def traced_write(st: StateCore, name: str, value: torch.Tensor) -> None:
    """``state.write`` as traced code (see the module docstring)."""
    d = st.plan.buffers.get(name)
    sw = st._traced
    if d is None or d.derive is not None or (sw is not None and name not in st.plan.mutable):
        raise SwitchError("write() refused in a compiled function", buffer=name,
                          expected="a declared, non-derived buffer (mutable inside a switch)",
                          found="not declared" if d is None else "derived" if d.derive is not None else "not mutable",
                          fix="write a declared input buffer; declare mutable=True to write it inside a switch")
    target = paths.get(st.obj, name)
    n = value.shape[d.axis_dim] if d.axis is not None else target.shape[0]
    target.narrow(d.axis_dim if d.axis is not None else 0, 0, n).copy_(value)
    if d.axis is not None and n < target.shape[d.axis_dim]:
        d.padding.apply(target.narrow(d.axis_dim, n, target.shape[d.axis_dim] - n),
                        target.narrow(d.axis_dim, n - 1, 1) if n else None, d.axis_dim)
    resolve = sw.pp.resolve if sw is not None else {}
    held = resolve.get(name, name)
    shared = [e for e in st.binding.tensors if resolve.get(e, e) == held] or [name]
    for dep in st.plan.closure(shared):
        st._recompute(dep)

"""The native switch: one phase's steps as one call into ``graphctl._C`` per direction.

``BoundState._steps`` builds the Python steps of a phase (snapshot groups, rebinds, recomputes;
the reference) or, where it can, one :class:`~graphctl.state.transaction.Step` backed by a
``SwitchTable`` built here from the same groups and plan: per device group the statics, arenas
and copy sources, the attribute puts of every swap and alias, and each recompute as a
pre-resolved call (inside a switch every declared entry is bound to a known tensor or object, so
a recompute's target and inputs are fixed at build time). A switch then costs one C++ call to
apply and one to undo, with no Python loop over buffers and no dispatcher call made from
Python. The table counts what it applied, so its undo is right after a full apply, a partial one
or none (the step is ``idempotent``), and its failures are reported one by one
(:class:`~graphctl.state.transaction.StepFailures`).

Copy sources are read every switch (a callable one is called once, as the user callable it is)
and compared by identity and metadata (dtype, device, shape, strides, address: a tensor changed in
place keeps its identity) with the object validated last; a new or changed one is checked in Python, as
the Python step checks it, before anything is written. Where the Python steps stay: the
``capture`` phase (recorded once; its dead-capture handling is per step), no extension loaded,
``GRAPHCTL_NATIVE_SWITCH=0``, and states with a fault-injection or user hook installed (tests
reach inside the Python steps).
"""
from __future__ import annotations

import functools
from typing import Any

from graphctl import ops
from graphctl.state import paths
from graphctl.state.core import StateCore
from graphctl.state.recompute import refuse_return
from graphctl.state.spec import OpCall
from graphctl.state.steps import use_error
from graphctl.state.transaction import Step, StepFailures
from graphctl.state.validate import check_source, source_label

__all__ = ["native_step"]

_UNCHECKED = object()  # a copy source no switch has validated yet


def _target(obj: Any, name: str) -> Any:
    """What the table sets: a plain attribute name, or a setter for a path."""
    return functools.partial(paths.put, obj, name) if paths.is_path(name) else name


def _getter(st: StateCore, act: Any) -> Any:
    """How the table reads a copy source: a plain attribute name, or the state's own look-up (a
    path; a callable source, run as the user callable it is, once per switch)."""
    plain = isinstance(act.source, str) and not paths.is_path(act.source)
    return act.source if plain else functools.partial(st._source, act)


def _checked_call(st: StateCore, name: str, label: str, fn: Any, out: Any, *inputs: Any) -> None:
    """A Python Recompute fn as the C++ table calls it, its result checked as ``st._recompute`` does."""
    refuse_return(name, out, st._call_user(label, fn, out, *inputs))


def native_step(st: StateCore, phase: str) -> Step | None:
    """The phase's steps as one native step, or None where the Python steps must run."""
    if phase == "capture" or not ops.uses_extension():
        return None
    obj, pp = st.obj, st.plan.phases[phase]
    groups, copy_names, copy_acts = [], [], []
    for g in st.binding.groups[phase]:
        copies = tuple((i, _getter(st, act), _UNCHECKED) for i, _, act in g.copies)
        groups.append((f"snapshot[{g.device}]({', '.join(g.names)})", list(g.statics), list(g.arenas),
                       list(g.statics), copies))
        copy_names.append([name for _, name, _ in g.copies])
        copy_acts.append([act for _, _, act in g.copies])

    def bound(entry: str) -> Any:  # what the entry is bound to while the switch is in
        held = pp.resolve.get(entry, entry)
        return st.binding.tensors[held] if held in st.binding.tensors else st.binding.objects[held]

    puts = []
    for name, _ in pp.swaps:
        puts.append((_target(obj, name), bound(name), st.binding.tensors.get(name, st.binding.objects.get(name))))
        puts += [(_target(obj, alias), tv, ov) for alias, ov, tv in st.binding.aliases.get(name, ())]
    recomputes: list[tuple[Any, ...]] = []
    for n in pp.recompute:
        rc = st.plan.buffers[n].recompute
        if isinstance(rc.fn, OpCall):  # one op, launched from C++ with its arguments fixed here
            recomputes.append(("op", "graphctl::" + rc.fn.op, "",
                               rc.fn.bind(bound(n), tuple(bound(i) for i in rc.inputs))))
            continue
        args = (f"the Recompute fn of '{n}'", rc.fn, bound(n), *(bound(i) for i in rc.inputs))
        recomputes.append(("py", functools.partial(_checked_call, st, n), args))
    table = ops.switch_table(obj, groups, puts, recomputes)
    if table is None:
        return None

    def apply() -> None:
        stale = table.apply(True)
        if stale is None:
            return
        for gi, ci, src in stale:  # first switch, or a source rebound since: check it as the Python step does
            check_source(st, copy_names[gi][ci], src, source_label(copy_acts[gi][ci]), use_error)
            table.set_source(gi, ci, src, src)
        table.apply(False)  # nothing ran in between: the sources just checked are the ones to copy

    def undo() -> None:
        failures = table.undo()
        if failures:
            raise StepFailures([(str(what), err) for what, err in failures])

    return Step(f"native[{phase}]", apply, undo, recorded=False, idempotent=True)

"""The Python steps of a switch phase: the reference the native switch (``state/native.py``)
is tested against, and what runs where the native one does not (``capture``, hooks, no extension).

Per device group one snapshot step (one fused ``swap_through_`` that snapshots and writes the
copy-in-place sources; its ``prepare`` looks the sources up and checks a new one), one rebind
step per swap (the attribute and its declared views, always back to the bind-time original), one
recompute step per derived buffer whose inputs change (undone by the snapshot, which holds it).
"""
from __future__ import annotations

from typing import Any

from graphctl import ops
from graphctl.errors import SwitchError
from graphctl.state import paths
from graphctl.state.arena import Group
from graphctl.state.core import StateCore
from graphctl.state.transaction import Step
from graphctl.state.validate import check_source, source_label, source_meta

__all__ = ["python_steps", "rebind_step", "use_error"]


def python_steps(st: StateCore, phase: str) -> tuple[Step, ...]:
    pp = st.plan.phases[phase]
    return tuple([snapshot_step(st, g) for g in st.binding.groups[phase]]
                 + [rebind_step(st, name, twin) for name, twin in pp.swaps]
                 + [recompute_step(st, n) for n in pp.recompute])


def use_error(name: str, what: str, expected: Any, found: Any, fix: str) -> SwitchError:
    return SwitchError(what, buffer=name, expected=expected, found=found, fix=fix)


def snapshot_step(st: StateCore, g: Group) -> Step:
    statics, arenas = list(g.statics), list(g.arenas)
    sources = statics.copy() if g.copies else statics
    validated: dict[int, tuple[Any, tuple]] = {}  # copy index -> the source object last checked, its metadata

    def prepare() -> None:  # look the copy sources up and check them; writes nothing
        for i, name, act in g.copies:
            src = st._source(act)
            last = validated.get(i)
            # the same tensor object with the same metadata as last time needs no re-check; an object changed in
            # place (src.data = ..., resize_, set_) keeps its identity, not its dtype, shape, strides or address
            if last is None or last[0] is not src or last[1] != source_meta(src):
                check_source(st, name, src, source_label(act), use_error)
                validated[i] = (src, source_meta(src))
            sources[i] = src

    def apply() -> None:
        ops.swap_through_(statics, arenas, sources, validate=False)  # checked at bind

    def undo() -> None:
        ops.copy_(statics, arenas, validate=False)

    return Step(f"snapshot[{g.device}]({', '.join(g.names)})", apply, undo, recorded=g.device.type == "cuda",
                prepare=prepare if g.copies else None)


def rebind_step(st: StateCore, name: str, twin: str) -> Step:
    obj = st.obj
    original = st.binding.tensors.get(name, st.binding.objects.get(name))
    twin_value = st.binding.tensors.get(twin, st.binding.objects.get(twin))
    aliases = st.binding.aliases.get(name, ())

    def apply() -> None:
        paths.put(obj, name, twin_value)
        for alias, _, tv in aliases:
            paths.put(obj, alias, tv)

    def undo() -> None:
        # Always back to the bind-time original: a repeated swap can never save the twin.
        for alias, ov, _ in aliases:
            paths.put(obj, alias, ov)
        paths.put(obj, name, original)

    return Step(f"swap({name})", apply, undo, idempotent=True)


def recompute_step(st: StateCore, name: str) -> Step:
    # its undo is the snapshot's: the derived buffer is snapshotted with everything else
    return Step(f"recompute({name})", lambda: st._recompute(name), lambda: None,
                recorded=st.device.type == "cuda", idempotent=True)

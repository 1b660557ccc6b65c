"""Compile a spec into a plan: checks between entries, the dependency order of derived
buffers, and for each phase what is swapped, copied, recomputed and snapshotted.

A plan is pure data over entry names; ``graphctl.state.bound`` resolves it against a live
object. Phases: ``eager`` and ``capture`` apply swaps and draft copies (``capture`` records
the device work into the graph), ``eager`` and ``replay`` apply refreshes (host code around
``graph.replay()``; never inside a capture, where a refresh would be baked once). ``refresh``
is what the graph runner opens around ``graph.replay()``: the replay refreshes alone, without
snapshotting other buffers, so whatever the graph itself writes to them stays written (a
``replay`` switch restores every declared buffer on exit, the graph's writes included).
Every phase snapshots into arena slots of its own, so a ``replay`` or ``refresh`` switch open
around a graph whose capture recorded a ``capture`` switch never shares a slot with it.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from graphctl.errors import DeclarationError, did_you_mean
from graphctl.state.spec import BufferDecl, CopyInPlace, ObjectDecl, StateSpec, Swap, is_draft_segment

__all__ = ["PHASES", "PhasePlan", "Plan", "compile_spec"]

PHASES = ("eager", "capture", "replay", "refresh")


@dataclasses.dataclass(frozen=True, slots=True)
class PhasePlan:
    phase: str
    swaps: tuple[tuple[str, str], ...]  # (attribute, twin entry)
    copies: tuple[tuple[str, CopyInPlace], ...]  # (buffer written in place, action)
    recompute: tuple[str, ...]  # derived buffers, dependency order
    snapshot: tuple[str, ...]  # entries whose tensors are snapshotted (bound names, twins resolved)
    resolve: Mapping[str, str]  # attribute -> entry that holds it during the body
    hidden: tuple[str, ...] = ()  # entries under a swapped object: unreachable by name during the body


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    spec_name: str
    buffers: Mapping[str, BufferDecl]
    objects: Mapping[str, ObjectDecl]
    order: tuple[str, ...]  # every derived buffer, inputs before outputs
    dependents: Mapping[str, tuple[str, ...]]  # entry -> derived buffers depending on it, in order
    mutable: frozenset[str]
    phases: Mapping[str, PhasePlan]

    def closure(self, names: Iterable[str]) -> tuple[str, ...]:
        """Derived buffers depending (transitively) on any of ``names``, in dependency order."""
        return _closure(self.order, self.dependents, names)


def _closure(order: Sequence[str], dependents: Mapping[str, Any], names: Iterable[str]) -> tuple[str, ...]:
    hit: set[str] = set()
    for n in names:
        hit.update(dependents.get(n, ()))
    return tuple(d for d in order if d in hit)


def _topo(spec: StateSpec, buffers: Mapping[str, BufferDecl]) -> tuple[str, ...]:
    derived = {n: d.derive for n, d in buffers.items() if d.derive is not None}
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            cycle = path[path.index(n):] + [n]
            raise DeclarationError("Recompute inputs form a cycle", buffer=n, expected="an acyclic dependency graph",
                                   found=" -> ".join(cycle), fix="break the cycle: one of these must be a plain input")
        state[n] = 1
        for i in derived[n].inputs:
            if i in derived:
                visit(i, path + [n])
        state[n] = 2
        order.append(n)

    for n in derived:
        visit(n, [])
    return tuple(order)


def _starred(name: str) -> str:
    """``layers[0].keys`` -> ``layers[*].keys``: one element of a ``[*]`` entry expanded at bind."""
    return re.sub(r"\[\d+\]", "[*]", name, count=1)


def _check_entries(spec: StateSpec) -> None:
    entries = spec.entries
    twin_of: dict[str, str] = {}
    alias_owner: dict[str, str] = {}
    for name, d in entries.items():
        if isinstance(d.draft, Swap):
            twin = d.draft.twin
            if twin == name:
                raise DeclarationError("swaps to itself", buffer=name, expected="a separate twin entry", found=twin,
                                       fix="declare a draft twin, e.g. 'draft_" + name + "'")
            if twin not in entries:
                near = did_you_mean(twin, entries)
                raise DeclarationError("Swap twin is not declared", buffer=name, expected=f"an entry named '{twin}'",
                                       found="no such entry" + near,
                                       fix=f"declare spec.{d.kind}('{twin}', ...)" + (", or fix the twin's name"
                                                                                     if near else ""))
            t = entries[twin]
            if t.kind != d.kind:
                raise DeclarationError("Swap twin is of another kind", buffer=name, expected=d.kind, found=t.kind,
                                       fix="swap tensors with tensors and objects with objects")
            if isinstance(t.draft, Swap):
                raise DeclarationError(
                    "Swap twin is itself swapped",
                    buffer=name,
                    expected=f"'{twin}' without draft=Swap",
                    found=f"Swap(twin='{t.draft.twin}')",
                    fix="swap only from the target entry",
                )
            if twin in twin_of:
                raise DeclarationError("two entries swap to the same twin", buffer=name,
                                       expected=f"'{twin}' used by one base", found=f"also used by '{twin_of[twin]}'",
                                       fix="give each base its own twin")
            twin_of[twin] = name
            if isinstance(d, BufferDecl):
                for field in ("dtype", "shape"):
                    a, b = getattr(d, field), getattr(t, field)
                    if a is not None and b is not None and a != b:
                        raise DeclarationError(f"Swap twin has another {field}", buffer=name, expected=a, found=b,
                                               fix=f"declare '{twin}' with the {field} of '{name}'")
        if isinstance(d, BufferDecl):
            for a in d.aliases:
                if a in entries:
                    raise DeclarationError("an alias is also declared as an entry", buffer=name,
                                           expected=f"'{a}' only as an alias of '{name}'", found=f"entry '{a}'",
                                           fix=f"remove spec.buffer('{a}') or drop it from aliases=")
                if a in alias_owner:
                    raise DeclarationError("alias declared for two bases", buffer=name,
                                           expected=f"'{a}' a view of one base", found=f"also of '{alias_owner[a]}'",
                                           fix="a view belongs to one base buffer")
                alias_owner[a] = name
            if d.derive is not None:
                for i in d.derive.inputs:
                    if i not in entries and _starred(i) not in entries:
                        raise DeclarationError("Recompute input is not declared", buffer=name,
                                               expected=f"an entry named '{i}'",
                                               found="no such entry" + did_you_mean(i, entries),
                                               fix=f"declare '{i}' in the spec (a buffer or an object)")


def compile_spec(spec: StateSpec) -> Plan:
    """Check a spec as a whole and compile it (cached on the spec, which is then frozen)."""
    if spec._plan is not None:
        return spec._plan
    _check_entries(spec)
    entries = spec.entries
    buffers = {n: d for n, d in entries.items() if isinstance(d, BufferDecl)}
    objects = {n: d for n, d in entries.items() if isinstance(d, ObjectDecl)}
    order = _topo(spec, buffers)

    direct: dict[str, set[str]] = {}
    for n in order:
        rc = buffers[n].derive
        assert rc is not None  # the order holds derived buffers only
        for i in rc.inputs:
            direct.setdefault(i, set()).add(n)
    dependents: dict[str, tuple[str, ...]] = {}
    for n in entries:
        seen: set[str] = set()
        stack = list(direct.get(n, ()))
        while stack:
            m = stack.pop()
            if m not in seen:
                seen.add(m)
                stack.extend(direct.get(m, ()))
        dependents[n] = tuple(d for d in order if d in seen)

    copy_targets = {n for n, d in buffers.items() if isinstance(d.draft, CopyInPlace) or d.refresh is not None}
    for n, d in buffers.items():
        for act in (d.draft, d.refresh):
            if isinstance(act, CopyInPlace) and isinstance(act.source, str) and act.source in copy_targets:
                raise DeclarationError("CopyInPlace reads a buffer that is itself copied in place", buffer=n,
                                       expected="a source no switch writes", found=f"source '{act.source}'",
                                       fix="copy from the original source of both")
        if d.refresh is not None:
            for dep in (n,) + dependents[n]:
                readers = buffers[dep].readers
                if not all(is_draft_segment(r) for r in readers):
                    why = (
                        "is refreshed in place around replay"
                        if dep == n
                        else f"is recomputed from '{n}', which is refreshed in place around replay,"
                    )
                    raise DeclarationError(
                        f"{why} but a non-draft segment reads it", buffer=dep, expected="readers within draft segments",
                        found=sorted(readers),
                        fix="refresh a dedicated draft twin (declare it with readers={'draft'}) and Swap to it")

    mutable = frozenset(n for n, d in buffers.items() if d.mutable)
    plan_phases = {}
    for phase in PHASES:
        swapping = phase in ("eager", "capture")
        swaps = tuple((n, d.draft.twin) for n, d in entries.items() if isinstance(d.draft, Swap)) if swapping else ()
        resolve = dict(swaps)
        # entries under a swapped object (kv_cache_manager.k[0]) leave with it: inside the switch
        # their path leads into the twin (whose layers may be fewer), and nothing reaches them by
        # name; like the swapped attribute itself, they are neither checked there nor snapshotted
        hidden = tuple(n for n in entries for a, _ in swaps
                       if n.startswith(a) and n[len(a):len(a) + 1] in (".", "["))
        copies = []
        for n, d in buffers.items():
            if isinstance(d.draft, CopyInPlace) and swapping:
                copies.append((n, d.draft))
            if d.refresh is not None and phase != "capture":
                copies.append((n, d.refresh))
        changed = [n for n, _ in swaps] + [n for n, _ in copies]
        recompute = _closure(order, dependents, changed)
        written = [n for n, _ in copies] + list(recompute)
        if phase != "refresh":
            # Every declared buffer the body could leave changed is snapshotted, not only the
            # mutable ones: the forward's own kernels may write any of them, and the promise is
            # that a switch leaves each declared buffer bitwise as it found it. Not snapshotted:
            # Stable scratch, and the originals a swap unbinds (nothing reaches them by name).
            unbound = {n for n, _ in swaps} | set(hidden)
            written += [n for n, d in buffers.items() if d.switched and n not in unbound]
        snapshot: list[str] = []
        for n in written:
            held = resolve.get(n, n)
            if held not in snapshot and isinstance(entries[held], BufferDecl):
                snapshot.append(held)
        plan_phases[phase] = PhasePlan(phase, swaps, tuple(copies), recompute, tuple(snapshot), resolve, hidden)

    plan = Plan(spec.name, buffers, objects, order, dependents, mutable, plan_phases)
    spec._plan = plan
    spec.freeze()
    return plan

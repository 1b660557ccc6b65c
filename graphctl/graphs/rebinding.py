"""Tensors the graph reads through its arguments, rebound outside it, caught before the replay.

A graph bakes addresses. Declared buffers, static inputs and frozen arguments are checked
against the capture's manifest; a tensor reached *through* them is not: an engine that computes
a metadata tensor outside the graph and rebinds ``self.meta.sched = fresh`` each step leaves the
graph reading the capture-time tensor (vLLM #36611, #37639). At capture, :func:`collect` names
every tensor the tracked warmups read or wrote that the forward reaches by a path
(``graphs/reach.py``: an argument's attribute or item, ``self.…``, a closure cell, a global the
function names) and that graphctl does not own (static inputs, declared buffers, arenas) and is
not a weight;
:func:`first_moved` re-resolves those paths before each replay and names the first one that no
longer leads to the same tensor (address and shape). ``GRAPHCTL_CHECK_PATHS=0`` turns it off.
"""
from __future__ import annotations

import dataclasses
import keyword
import weakref
from collections.abc import Callable
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import ReplayError
from graphctl.graphs.reach import Reach

__all__ = ["MAX_PATHS", "PathCheck", "Paths", "collect", "first_moved"]

# past this many paths the per-replay check costs more than it saves (H200 host: ~0.14 us a path in C)
MAX_PATHS = 1024
_RANK = {"state": 0, "buffer": 1}  # kept first: metadata an engine rebinds, then a module's registered buffers


@dataclasses.dataclass(frozen=True)
class PathCheck:
    path: str
    root: Callable[[tuple, dict], Any]  # the root object for this call's (args, kwargs)
    steps: tuple[tuple[bool, Any], ...]  # (is_attribute, name or key), in order
    ptr: int
    shape: tuple[int, ...]
    shared: int = 0  # leading steps shared with the previous check of the same root (compiled: resolved once)
    tensor: Any = None  # a weak reference to the capture's tensor (a strong one would hide a freed temporary
    # from the audit, which names it dangling)
    source: Any = None  # the root for the native check: a cell, (constant,), (dict, key), or ``root`` itself


class Paths(list):
    """The checks in walk order, with :meth:`fast`: whether every path still leads to its tensor
    (each shared prefix resolved once, each leaf compared by identity through a weak reference,
    and by address), in one C call (``graphctl._C.paths_hold`` over ``program``) or, without the
    extension, one straight-line Python function (``walk``, its reference). A model's cache has
    dozens of paths (``cache.layers[i].keys``): on the H200 host between synchronized steps 66 of
    them cost ~70 µs as compiled Python against 9 µs in a tight loop (cold caches), which a bare
    ``@graphed`` decode step pays before every replay. :func:`first_moved` walks plainly only when
    the fast check fails, to name the path."""

    program: tuple
    walk: Callable[[tuple, dict], bool]

    def fast(self, args: tuple, kwargs: dict) -> bool:
        return ops.paths_hold(self.program, args, kwargs, self.walk)


def _program(checks: list[PathCheck]) -> tuple:
    """The checks as ``graphctl._C.paths_hold`` reads them (csrc/path_check.cpp)."""
    out, root = [], None
    for c in checks:
        first = c.root is not root
        root = c.root
        keep = 0 if first else c.shared
        out.append((c.source if first else None, keep, tuple(c.steps[keep:]), c.tensor, c.ptr))
    return tuple(out)


def _compile(checks: list[PathCheck]) -> Callable[[tuple, dict], bool]:
    consts: dict[str, Any] = {}
    lines = ["def fast(a, k):", "  try:", "    pass"]
    along: list[str] = []
    root = None
    for i, c in enumerate(checks):
        if c.root is not root:
            root, keep = c.root, 0
            consts[f"R{i}"] = root
            along = [f"r{i}"]
            lines.append(f"    r{i} = R{i}(a, k)")
        else:
            keep = c.shared
            del along[keep + 1:]
        for d, (is_attr, key) in enumerate(c.steps[keep:], start=keep):
            name = f"v{i}_{d}"
            if is_attr and isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key):
                lines.append(f"    {name} = {along[-1]}.{key}")
            else:
                consts[f"K{i}_{d}"] = key
                lines.append(f"    {name} = {'getattr(' + along[-1] + ', ' if is_attr else along[-1] + '['}"
                             f"K{i}_{d}{')' if is_attr else ']'}")
            along.append(name)
        consts[f"T{i}"] = c.tensor
        lines.append(f"    if {along[-1]} is not T{i}() or {along[-1]}.data_ptr() != {c.ptr}: return False")
    lines += ["  except (AttributeError, IndexError, KeyError, TypeError):", "    return False", "  return True"]
    scope: dict[str, Any] = dict(consts)
    exec(compile("\n".join(lines), "<graphctl path check>", "exec"), scope)  # noqa: S102 - our own code
    return scope["fast"]


def collect(reach: Reach, used: set, owned: set) -> tuple[Paths, dict[str, int]]:
    """The paths to re-check at every replay: walked tensors (``graphs/reach.py``) the warmups
    used (storage keys in ``used``) that graphctl does not own, and that are not weights (a
    model's parameters and ``params=`` are never rebound per step). At most :data:`MAX_PATHS`,
    dropped by role (a module's registered buffers before other state), never silently: the
    second value counts what was left unchecked, by role."""
    found = [leaf for k, leaf in reach.tensors.items() if leaf.role != "weight" and k in used and k not in owned]
    ranked = sorted(found, key=lambda leaf: (_RANK[leaf.role], leaf.order))
    kept, dropped = ranked[:MAX_PATHS], ranked[MAX_PATHS:]
    unchecked: dict[str, int] = {}
    for leaf in dropped:
        unchecked[leaf.role] = unchecked.get(leaf.role, 0) + 1
    out = Paths()
    for leaf in sorted(kept, key=lambda leaf: leaf.order):  # walk order: neighbours share a prefix
        prev = out[-1] if out and out[-1].root is leaf.root.get else None
        n = 0
        while prev is not None and n < min(len(prev.steps), len(leaf.steps)) - 1 and prev.steps[n] == leaf.steps[n]:
            n += 1
        out.append(PathCheck(leaf.path, leaf.root.get, leaf.steps, leaf.tensor.data_ptr(), tuple(leaf.tensor.shape),
                             shared=n, tensor=weakref.ref(leaf.tensor), source=leaf.root.source))
    out.walk, out.program = _compile(out), _program(out)
    return out, unchecked


def first_moved(checks: list[PathCheck], args: tuple, kwargs: dict) -> ReplayError | None:
    """The first path that no longer leads to the captured tensor, as a ``ReplayError``."""
    if isinstance(checks, Paths) and checks.fast(args, kwargs):
        return None  # every path leads to the very tensor object of the capture, at its address
    # the fast check failed (or was not compiled): walk each path plainly to name the first one that moved
    for c in checks:
        v = c.root(args, kwargs)
        try:
            for is_attr, k in c.steps:
                v = getattr(v, k) if is_attr else v[k]
        except (AttributeError, IndexError, KeyError, TypeError):
            v = None
        if isinstance(v, torch.Tensor) and v.data_ptr() == c.ptr and v.shape == c.shape:
            continue
        found = (f"{tuple(v.shape)} at {v.data_ptr():#x}" if isinstance(v, torch.Tensor)
                 else "nothing" if v is None else type(v).__name__)
        return ReplayError("a tensor the graph reads was rebound since the capture", buffer=c.path,
                           expected=f"{c.shape} at {c.ptr:#x} (the capture's)", found=found,
                           fix="write into the captured tensor in place (copy_) instead of rebinding the attribute, "
                               "declare it in a StateSpec, or reset() and capture again")
    return None

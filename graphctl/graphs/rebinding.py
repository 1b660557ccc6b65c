"""Tensors the graph reads through its arguments, rebound outside it, caught before the replay.

A graph bakes addresses. Declared buffers, static inputs and frozen arguments are checked
against the capture's manifest; a tensor reached *through* them is not: an engine that computes
a metadata tensor outside the graph and rebinds ``self.meta.sched = fresh`` each step leaves the
graph reading the capture-time tensor (vLLM #36611, #37639). At capture, :func:`collect` names
every tensor the first warmup read or wrote that the forward reaches by a path (an argument's
attribute or item, ``self.…``, a closure cell, a global the function names) and that graphctl
does not own (static inputs, declared buffers, arenas) and is not a model parameter or buffer;
:func:`first_moved` re-resolves those paths before each replay and names the first one that no
longer leads to the same tensor (address and shape). ``GRAPHCTL_CHECK_PATHS=0`` turns it off.
"""
from __future__ import annotations

import dataclasses
import inspect
import keyword
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import DeclarationError, ReplayError
from graphctl.graphs.compiled import unwrap
from graphctl.graphs.effects import storage_key

__all__ = ["PathCheck", "Paths", "check_option", "collect", "first_moved"]

_MAX_DEPTH = 5
_MAX_PATHS = 256  # past this, the check costs more than it saves: the longest are dropped first


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


def _roots(fn: Callable[..., Any], get_arg: Callable[[tuple, dict, str], Any], names: list[str],
           params: Any) -> list[tuple[str, Callable[[tuple, dict], Any], Any, Any]]:
    """(name, getter at call time, value now, native source) of what ``fn`` reaches (as
    ``effects.roots_of``)."""
    out: list[tuple[str, Callable[[tuple, dict], Any], Any, Any]] = []
    target = unwrap(fn)
    if inspect.ismethod(target):
        me = target.__self__
        out.append(("self", lambda a, k, me=me: me, me, (me,)))
        target = target.__func__
    code = getattr(target, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, target.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            out.append((name, lambda a, k, cell=cell: cell.cell_contents, value, cell))
        g = getattr(target, "__globals__", {})
        for name in code.co_names:
            if name in g and not isinstance(g[name], types.ModuleType):
                out.append((name, lambda a, k, g=g, name=name: g[name], g[name], (g, name)))
    if params is not None:
        out.append(("params", lambda a, k, p=params: p, params, (params,)))
    return out


def collect(fn: Callable[..., Any], arguments: dict[str, Any], get_arg: Callable[[tuple, dict, str], Any],
            params: Any, used: set, owned: set) -> list[PathCheck]:
    """The paths to re-check at every replay: tensors the warmup used (storage keys in ``used``)
    that graphctl does not own, reached through arguments, ``self``, closures and named globals."""
    roots = []
    for n, v in arguments.items():
        getter = lambda a, k, n=n: get_arg(a, k, n)  # noqa: E731
        roots.append((n, getter, v, getter))
    roots += _roots(fn, get_arg, list(arguments), params)
    found: dict[tuple[str, int], PathCheck] = {}
    seen: set[int] = set()
    sources = {id(getter): source for _, getter, _, source in roots}

    def visit(path: str, root: Callable, steps: tuple, v: Any, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            if isinstance(v, torch.nn.Parameter) or not v.untyped_storage().nbytes():
                return
            key = storage_key(v)
            if key in used and key not in owned and key not in found:
                found[key] = PathCheck(path, root, steps, v.data_ptr(), tuple(v.shape), tensor=weakref.ref(v),
                                       source=sources[id(root)])
            return
        if depth > _MAX_DEPTH or id(v) in seen or isinstance(v, (str, bytes, int, float, bool, type(None))):
            return
        if isinstance(v, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            return
        seen.add(id(v))
        if isinstance(v, dict):
            for k, e in list(v.items())[:256]:
                visit(f"{path}[{k!r}]", root, steps + ((False, k),), e, depth + 1)
        elif isinstance(v, (list, tuple)):
            for i, e in enumerate(v[:256]):
                visit(f"{path}[{i}]", root, steps + ((False, i),), e, depth + 1)
        try:
            attrs = vars(v)
        except TypeError:
            return
        for k, e in list(attrs.items()):
            # an nn.Module's parameters and registered buffers are the model's: never rebound per step
            if not k.startswith("__") and k not in ("_parameters", "_buffers", "_modules"):
                visit(f"{path}.{k}", root, steps + ((True, k),), e, depth + 1)
        if isinstance(v, torch.nn.Module):
            for n, m in v.named_children():
                visit(f"{path}.{n}", root, steps + ((True, n),), m, depth + 1)

    for name, root, value, _ in roots:
        visit(name, root, (), value, 0)
    visit = None  # noqa: F841 - break the function <-> cell cycle: GC is off during capture_all
    # the shortest _MAX_PATHS, kept in walk order: a path shares its prefix with the one before it
    # (cache.layers[3].keys, cache.layers[3].values), which the compiled check resolves once
    keep = {id(c) for c in sorted(found.values(), key=lambda c: len(c.steps))[:_MAX_PATHS]}
    out = Paths()
    for c in found.values():
        if id(c) in keep:
            prev = out[-1] if out and out[-1].root is c.root else None
            n = 0
            while prev is not None and n < min(len(prev.steps), len(c.steps)) - 1 and prev.steps[n] == c.steps[n]:
                n += 1
            out.append(dataclasses.replace(c, shared=n))
    out.walk, out.program = _compile(out), _program(out)
    return out


def check_option(value: Any) -> bool | None:
    """``check_paths=`` as given, refused unless a bool or None (None: the knob decides)."""
    if value is not None and not isinstance(value, bool):
        raise DeclarationError("check_paths takes a bool or None", expected="True, False or None (the knob)",
                               found=repr(value), fix="pass check_paths=False to skip the path check")
    return value


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

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
import types
from collections.abc import Callable
from typing import Any

import torch

from graphctl.errors import DeclarationError, ReplayError
from graphctl.graphs.effects import storage_key

__all__ = ["PathCheck", "check_option", "collect", "first_moved"]

_MAX_DEPTH = 5
_MAX_PATHS = 256  # past this, the check costs more than it saves: the longest are dropped first


@dataclasses.dataclass(frozen=True)
class PathCheck:
    path: str
    root: Callable[[tuple, dict], Any]  # the root object for this call's (args, kwargs)
    steps: tuple[tuple[bool, Any], ...]  # (is_attribute, name or key), in order
    ptr: int
    shape: tuple[int, ...]


def _roots(fn: Callable[..., Any], get_arg: Callable[[tuple, dict, str], Any], names: list[str],
           params: Any) -> list[tuple[str, Callable[[tuple, dict], Any], Any]]:
    """(name, getter at call time, value now) of what ``fn`` reaches (as ``effects.roots_of``)."""
    out: list[tuple[str, Callable[[tuple, dict], Any], Any]] = []
    target = fn
    if inspect.ismethod(target):
        me = target.__self__
        out.append(("self", lambda a, k, me=me: me, me))
        target = target.__func__
    code = getattr(target, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, target.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            out.append((name, lambda a, k, cell=cell: cell.cell_contents, value))
        g = getattr(target, "__globals__", {})
        for name in code.co_names:
            if name in g and not isinstance(g[name], types.ModuleType):
                out.append((name, lambda a, k, g=g, name=name: g[name], g[name]))
    if params is not None:
        out.append(("params", lambda a, k, p=params: p, params))
    return out


def collect(fn: Callable[..., Any], arguments: dict[str, Any], get_arg: Callable[[tuple, dict, str], Any],
            params: Any, used: set, owned: set) -> list[PathCheck]:
    """The paths to re-check at every replay: tensors the warmup used (storage keys in ``used``)
    that graphctl does not own, reached through arguments, ``self``, closures and named globals."""
    roots = [(n, (lambda a, k, n=n: get_arg(a, k, n)), v) for n, v in arguments.items()]
    roots += _roots(fn, get_arg, list(arguments), params)
    found: dict[tuple[str, int], PathCheck] = {}
    seen: set[int] = set()

    def visit(path: str, root: Callable, steps: tuple, v: Any, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            if isinstance(v, torch.nn.Parameter) or not v.untyped_storage().nbytes():
                return
            key = storage_key(v)
            if key in used and key not in owned and key not in found:
                found[key] = PathCheck(path, root, steps, v.data_ptr(), tuple(v.shape))
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

    for name, root, value in roots:
        visit(name, root, (), value, 0)
    visit = None  # noqa: F841 - break the function <-> cell cycle: GC is off during capture_all
    return sorted(found.values(), key=lambda c: len(c.steps))[:_MAX_PATHS]


def check_option(value: Any) -> bool | None:
    """``check_paths=`` as given, refused unless a bool or None (None: the knob decides)."""
    if value is not None and not isinstance(value, bool):
        raise DeclarationError("check_paths takes a bool or None", expected="True, False or None (the knob)",
                               found=repr(value), fix="pass check_paths=False to skip the path check")
    return value


def first_moved(checks: list[PathCheck], args: tuple, kwargs: dict) -> ReplayError | None:
    """The first path that no longer leads to the captured tensor, as a ``ReplayError``."""
    for c in checks:
        v = c.root(args, kwargs)
        try:
            for is_attr, k in c.steps:
                v = getattr(v, k) if is_attr else v[k]
        except (AttributeError, IndexError, KeyError, TypeError):
            v = None
        if isinstance(v, torch.Tensor) and v.data_ptr() == c.ptr and tuple(v.shape) == c.shape:
            continue
        found = (f"{tuple(v.shape)} at {v.data_ptr():#x}" if isinstance(v, torch.Tensor)
                 else "nothing" if v is None else type(v).__name__)
        return ReplayError("a tensor the graph reads was rebound since the capture", buffer=c.path,
                           expected=f"{c.shape} at {c.ptr:#x} (the capture's)", found=found,
                           fix="write into the captured tensor in place (copy_) instead of rebinding the attribute, "
                               "declare it in a StateSpec, or reset() and capture again")
    return None

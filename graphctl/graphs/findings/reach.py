"""What graphctl reaches from a forward: its roots, and one walk with one rule set.

Every check that looks behind a forward's arguments reads one :class:`Reach`: the write tracker
(``effects.py``: which tensors a warmup may write), the path check (``rebinding.py``: which
tensors to re-resolve before a replay), the host-state check (``hoststate.py``: which plain
values a warmup may flip), compiled callables (``compiled.py``: what the emulated recorder runs
as one call) and the list of tensors read that no path leads to. A capture walks twice: once
before the warmups, once after the capture.

**Roots** (:func:`roots`): the call's arguments, a bound method's ``self``, the closure cells
and the globals the code names (modules are not roots), and ``params=``; a compiled forward is
seen through its wrappers (``compiled.unwrap``).

**The walk** (:func:`walk`), depth first, first path wins per tensor storage and per host path:

- entered: dicts (every item), lists and tuples (every item), objects with a ``__dict__`` (every
  attribute but dunders), an ``nn.Module``'s own parameters, buffers and children (its hook
  dicts are machinery), and a ``BoundState`` only through ``.obj`` (the user's metadata);
- not entered: strings, numbers, ``None``, modules, classes, functions, methods, and the
  machinery of graphctl and of torch's compilers;
- leaves: tensors (with a role: ``weight`` for parameters and ``params=``, ``buffer`` for a
  module's registered buffers, ``state`` for the rest), plain host values (``bool``, ``int``,
  ``float``, ``str``, ``None``, tuples of up to 8 of these; not inside tuples, which cannot be
  written back), and compiled callables;
- bounds: :data:`MAX_DEPTH` levels below a root and :data:`MAX_NODES` objects entered. Neither
  cuts silently: what a bound left out is counted in :attr:`Reach.cut` and logged by the capture,
  and a tensor past them that the forward reads is listed as unreached.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from graphctl.graphs.capture.compiled import is_compiled, is_optimized_module, unwrap
from graphctl.state import BoundState

__all__ = ["MAX_DEPTH", "MAX_NODES", "Reach", "Root", "TensorLeaf", "HostLeaf", "SiteLeaf", "roots", "walk",
           "storage_key", "PLAIN"]

MAX_DEPTH = 8  # a model's weights sit 6 deep (self.model.layers[0].mlp.proj.weight)
MAX_NODES = 200_000  # objects entered: a model's attributes, not a dataset's
PLAIN = (bool, int, float, str, type(None))
# machinery, never user state: graphctl's own runners and states, and torch's compilers' (a compiled
# module's dynamo_ctx holds flags that change on its first compile)
_OWN = ("graphctl.graphs.", "graphctl.state.", "torch._dynamo.", "torch._inductor.", "torch._functorch.")
_HOOKS = frozenset({"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                    "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                    "_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs",
                    "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_non_persistent_buffers_set"})
_OPAQUE = (str, bytes, bytearray, int, float, complex, bool, type(None), types.ModuleType, type, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType, types.CodeType)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """A tensor's storage, by device and address (views of one storage share it)."""
    return (str(t.device), t.untyped_storage().data_ptr())


@dataclasses.dataclass(frozen=True, slots=True)
class Root:
    """One place a forward starts from: its value now, how to find it at a later call, and how
    to rebind it (closure cells and globals can be; arguments and ``self`` only through what
    they hold)."""

    name: str
    value: Any
    get: Callable[[tuple, dict], Any]  # (args, kwargs) of a call -> this root's value then
    source: Any  # the native path check's root: a cell, (constant,), (dict, key) or ``get`` itself
    put: Callable[[Any], None] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TensorLeaf:
    path: str  # e.g. "self.cache.layers[0].keys"
    root: Root
    steps: tuple[tuple[bool, Any], ...]  # (is_attribute, name or key) from the root, in order
    tensor: torch.Tensor
    role: str  # "weight", "buffer" or "state"
    order: int  # position in walk order (paths sharing a prefix sit together)


@dataclasses.dataclass(frozen=True, slots=True)
class HostLeaf:
    holder: Any
    how: str  # "attr" or "item"
    key: Any
    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class SiteLeaf:
    path: str
    obj: Any  # a compiled function, an OptimizedModule, or a module whose forward was compiled
    get: Callable[[], Any]
    put: Callable[[Any], None]


@dataclasses.dataclass
class Reach:
    """What one walk found (see the module docstring)."""

    roots: list[Root]
    tensors: dict[tuple[str, int], TensorLeaf] = dataclasses.field(default_factory=dict)
    host: dict[str, HostLeaf] = dataclasses.field(default_factory=dict)
    sites: list[SiteLeaf] = dataclasses.field(default_factory=list)
    objects: int = 0
    cut: dict[str, int] = dataclasses.field(default_factory=lambda: {"depth": 0, "nodes": 0})

    def watched(self) -> dict[tuple[str, int], tuple[str, torch.Tensor]]:
        """Storage key -> (path, tensor): what the write tracker watches."""
        return {k: (leaf.path, leaf.tensor) for k, leaf in self.tensors.items()}

    def cuts(self) -> str:
        """What the bounds left out, in words ("" when nothing)."""
        parts = [f"{self.cut['depth']:,} objects past depth {MAX_DEPTH}"] if self.cut["depth"] else []
        if self.cut["nodes"]:
            parts.append(f"{self.cut['nodes']:,} values past the bound of {MAX_NODES:,} objects")
        return "; ".join(parts)


def roots(fn: Callable[..., Any], arguments: dict[str, Any], params: Any = None,
          get_arg: Callable[[tuple, dict, str], Any] | None = None) -> list[Root]:
    """The roots of ``fn`` called with ``arguments`` (name -> value); ``get_arg(args, kwargs,
    name)`` finds an argument in a later call (without it, the roots serve this call only)."""
    out: list[Root] = []
    for n, v in arguments.items():
        getter = _argument(get_arg, n) if get_arg is not None else _const(v)
        out.append(Root(n, v, getter, getter))
    target = unwrap(fn)  # through torch.compile wrappers to the user's code
    if inspect.ismethod(target):
        me = target.__self__
        out.append(Root("self", me, _const(me), (me,)))
        target = target.__func__
    code = getattr(target, "__code__", None)  # builtins and C callables have none
    if code is not None:
        for name, cell in zip(code.co_freevars, target.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            out.append(Root(name, value, _cell(cell), cell, _setter(cell, "cell_contents", True)))
        g = getattr(target, "__globals__", {})
        for name in code.co_names:
            if name in g and not isinstance(g[name], types.ModuleType):
                out.append(Root(name, g[name], _global(g, name), (g, name), _setter(g, name, False)))
    if params is not None:
        out.append(Root("params", params, _const(params), (params,)))
    return out


def _site(v: Any) -> bool:
    return is_compiled(v) or (isinstance(v, torch.nn.Module) and is_compiled(vars(v).get("forward")))


def walk(start: list[Root], skip: Any = None) -> Reach:
    """One walk from ``start`` (see the module docstring). ``skip``: an object never entered or
    recorded (the forward itself, which the runner calls)."""
    r = Reach(start)
    seen: set[int] = set()
    stack: list[tuple[str, Root, tuple, Any, int, str, Any, str, Any]] = []
    # depth first, children pushed in reverse: a path's neighbours in walk order share its prefix
    for root in reversed(start):
        stack.append((root.name, root, (), root.value, 0, "state", None, "root", None))
    while stack:
        path, root, steps, v, depth, role, holder, how, key = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.device.type != "meta" and v.untyped_storage().nbytes():
                k = storage_key(v)
                if k not in r.tensors:
                    tensor_role = "weight" if isinstance(v, torch.nn.Parameter) else role
                    r.tensors[k] = TensorLeaf(path, root, steps, v, tensor_role, len(r.tensors))
            continue
        if how != "root" and how != "child" and holder is not None and not isinstance(holder, tuple) and \
                (isinstance(v, PLAIN) or (isinstance(v, tuple) and len(v) <= 8 and all(isinstance(e, PLAIN)
                                                                                         for e in v))):
            r.host.setdefault(path, HostLeaf(holder, how, key, v))
            continue
        if v is skip or id(v) in seen:
            continue
        if _site(v):
            _add_site(r, path, v, root, holder, how, key, skip)
            if not isinstance(v, torch.nn.Module):
                seen.add(id(v))  # one site per compiled function, wherever else it is held
                continue
            seen.add(id(vars(v).get("forward")))  # the module's site owns its forward
        if isinstance(v, _OPAQUE) or (type(v).__module__.startswith(_OWN) and
                                       not isinstance(v, (BoundState, torch.nn.Module))):
            continue
        if depth >= MAX_DEPTH:
            r.cut["depth"] += 1
            continue
        if r.objects >= MAX_NODES:
            r.cut["nodes"] += 1
            continue
        seen.add(id(v))
        r.objects += 1
        kids: list[tuple[str, tuple, Any, str, Any, str, Any]] = []  # path, steps, value, role, holder, how, key
        if isinstance(v, BoundState):  # graphctl's own: only the user's object behind it
            kids.append((f"{path}.obj", steps + ((True, "obj"),), v.obj, "state", v, "child", "obj"))
        elif isinstance(v, dict):
            kids += [(f"{path}[{k!r}]", steps + ((False, k),), e, "state", v, "item", k) for k, e in list(v.items())]
        elif isinstance(v, (list, tuple)):
            kids += [(f"{path}[{i}]", steps + ((False, i),), e, "state", v, "item", i) for i, e in enumerate(v)]
        else:
            try:
                attrs = vars(v)
            except TypeError:
                attrs = {}
            if isinstance(v, torch.nn.Module):  # steps through its dicts: a C lookup each (its __getattr__ is Python)
                kids += [(f"{path}.{n}", steps + ((True, "_parameters"), (False, n)), t, "weight", v, "child", n)
                         for n, t in v._parameters.items() if t is not None]
                kids += [(f"{path}.{n}", steps + ((True, "_buffers"), (False, n)), t, "buffer", v, "child", n)
                         for n, t in v._buffers.items() if t is not None]
                kids += [(f"{path}.{n}", steps + ((True, "_modules"), (False, n)), m, "state", v, "child", n)
                         for n, m in v._modules.items() if m is not None]
            kids += [(f"{path}.{k}", steps + ((True, k),), e, "state", v, "attr", k) for k, e in list(attrs.items())
                     if not k.startswith("__") and not (k in _HOOKS and isinstance(v, torch.nn.Module))]
        for p, s, e, rl, h, hw, k in reversed(kids):
            stack.append((p, root, s, e, depth + 1, rl, h, hw, k))
    return r


def _add_site(r: Reach, path: str, v: Any, root: Root, holder: Any, how: str, key: Any, skip: Any) -> None:
    """A compiled callable, with the slot it sits in: an ``nn.Module``'s instance ``forward``
    (what ``torch.compile`` wraps, and every call of the module goes through), else the
    attribute, item, closure cell or global holding it. A slot nothing can rebind is no site."""
    if isinstance(v, torch.nn.Module):
        if vars(v).get("forward") is skip:
            return
        r.sites.append(SiteLeaf(path if is_optimized_module(v) else f"{path}.forward", v
                                if is_optimized_module(v) else vars(v)["forward"],
                                _getter(v.__dict__, "forward", False), _setter(v.__dict__, "forward", False)))
    elif how == "root":
        if root.put is not None:
            r.sites.append(SiteLeaf(path, v, functools.partial(root.get, (), {}), root.put))
    elif not isinstance(holder, tuple):
        attr = how != "item"
        r.sites.append(SiteLeaf(path, v, _getter(holder, key, attr), _setter(holder, key, attr)))


# the getters and setters of roots and sites: closures over typed arguments (a lambda with default
# arguments would do, but reads worse and defeats the type checker)
def _const(v: Any) -> Callable[[tuple, dict], Any]:
    return lambda a, k: v


def _argument(get_arg: Callable[[tuple, dict, str], Any], name: str) -> Callable[[tuple, dict], Any]:
    return lambda a, k: get_arg(a, k, name)


def _cell(cell: types.CellType) -> Callable[[tuple, dict], Any]:
    return lambda a, k: cell.cell_contents


def _global(g: dict[str, Any], name: str) -> Callable[[tuple, dict], Any]:
    return lambda a, k: g[name]


def _getter(holder: Any, key: Any, attr: bool) -> Callable[[], Any]:
    return (lambda: getattr(holder, key)) if attr else (lambda: holder[key])


def _setter(holder: Any, key: Any, attr: bool) -> Callable[[Any], None]:
    def put(x: Any) -> None:
        if attr:
            setattr(holder, key, x)
        else:
            holder[key] = x
    return put

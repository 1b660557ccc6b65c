"""Compiled forwards (``torch.compile``) inside graphctl's graphs.

A forward may be a compiled function, a compiled module (``OptimizedModule``), or plain code that
calls compiled modules and functions. graphctl's warmups and capture must run the compiled
artifact (so the graph holds Inductor's fused kernels) and must never leave it uncompiled. Three
facts about dynamo shape what this module does:

- Dynamo skips every frame it meets while a ``TorchDispatchMode`` is on the stack (on some
  releases it marks the code object skipped for good). graphctl runs two such modes: the write
  tracker of each bucket's first warmup and the emulated backend's recorder. So neither ever
  meets a compiled frame: the tracked warmup runs under the ``force_eager`` stance (the same
  Python code, every write visible to the tracker; dynamo is not asked, so it records nothing),
  and the emulated recorder runs every compiled callable it can reach as one opaque recorded
  call (:func:`sites`), with the recorder popped and the stance restored, and everything else
  under ``force_eager``.
- Dynamo refuses to compile inside a CUDA stream capture. Every bucket therefore gets at least
  one untracked warmup (compiling its shapes) before the capture, and a frame dynamo is asked to
  convert during the capture pass (a cache miss: a guard that failed, a recompile limit hit) is
  counted as a compiled frame run uncompiled (:class:`Counters`), warned about and reported.
- ``mode="reduce-overhead"`` records Inductor's own CUDA graphs, which cannot run inside
  graphctl's capture: refused before anything runs (:func:`refuse_inductor_graphs`).

graphctl's reach (side effects, paths, host state) starts from :func:`unwrap`: the user's
function or module behind the compile wrappers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch._dynamo.utils import counters

from graphctl.errors import DeclarationError

__all__ = ["unwrap", "is_compiled", "eager", "Site", "sites", "Counters", "refuse_inductor_graphs", "never_compiled"]

_ORIG = "_torchdynamo_orig_callable"  # set by torch.compile on the function it returns
_MAX_DEPTH = 6
_CALLS = (torch.nn.Module.__call__, torch.nn.Module._wrapped_call_impl, torch.nn.Module._call_impl)


def is_compiled(obj: Any) -> bool:
    """A compiled module, or a function ``torch.compile`` returned."""
    return isinstance(obj, OptimizedModule) or (isinstance(obj, types.FunctionType) and _ORIG in vars(obj))


def unwrap(fn: Any) -> Any:
    """The user's code behind compile wrappers: a compiled function's original, a compiled
    module's original ``forward``; a module (or its bound ``__call__``) becomes its ``forward``."""
    for _ in range(8):  # wrappers nest (a compiled compiled function); a cycle would be a torch bug
        if isinstance(fn, OptimizedModule):
            fn = fn._orig_mod
        elif isinstance(fn, types.FunctionType) and _ORIG in vars(fn):
            fn = vars(fn)[_ORIG]
        elif isinstance(fn, torch.nn.Module):
            fn = fn.forward
        elif inspect.ismethod(fn) and fn.__func__ in _CALLS:
            fn = fn.__self__
        else:
            return fn
    return fn


def eager() -> Any:
    """Compiled code runs as plain Python, and dynamo is not asked (nothing is compiled or
    marked): the stance of graphctl's dispatch-mode runs. torch applies it when it is made; a
    context manager, whose ``__exit__`` puts the previous stance back and may run again from a
    ``finally`` (an interrupt at a with-statement's exit can skip the first)."""
    return torch.compiler.set_stance("force_eager")


def compiled_stance() -> contextlib.AbstractContextManager[Any]:
    return torch.compiler.set_stance("default")


@dataclasses.dataclass(frozen=True)
class Site:
    """One compiled callable the forward reaches: where (``path``), what, and how to rebind it
    for a scoped substitution (the emulated recorder's opaque calls)."""

    path: str
    obj: Any  # the OptimizedModule or compiled function
    get: Callable[[], Any]
    put: Callable[[Any], None]


def _module_sites(path: str, m: torch.nn.Module, out: dict[int, Site]) -> None:
    for name, sub in m.named_modules(prefix=path):
        fwd = vars(sub).get("forward")  # an instance attribute: OptimizedModule's, or model.forward = compile(...)
        if (isinstance(sub, OptimizedModule) or is_compiled(fwd)) and id(sub) not in out:
            # rebinding the instance's forward reroutes every call of the module
            out[id(sub)] = Site(name if isinstance(sub, OptimizedModule) else f"{name}.forward",
                                sub if isinstance(sub, OptimizedModule) else fwd, lambda s=sub: vars(s)["forward"],
                                lambda v, s=sub: vars(s).__setitem__("forward", v))


def sites(fn: Any, roots: Iterable[tuple[str, Any]]) -> list[Site]:
    """Every compiled callable reachable from ``roots`` (as ``effects.roots_of`` gives them): compiled
    modules anywhere in the module trees and attributes, compiled functions held in attributes,
    containers, closure cells and named globals. ``fn`` itself is not a site (the runner calls it)."""
    out: dict[int, Site] = {}
    seen: set[int] = set()

    def visit(path: str, v: Any, depth: int, get: Callable[[], Any], put: Callable[[Any], None] | None) -> None:
        if depth > _MAX_DEPTH or id(v) in seen or v is fn:
            return
        if isinstance(v, types.FunctionType) and _ORIG in vars(v):
            if put is not None and id(v) not in out:
                out[id(v)] = Site(path, v, get, put)
            return
        if isinstance(v, (str, bytes, int, float, bool, type(None), torch.Tensor, type, types.ModuleType,
                          types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            return
        seen.add(id(v))
        if isinstance(v, torch.nn.Module):
            _module_sites(path, v, out)
            return  # a module's plain attributes are its configuration, not compiled callables
        if isinstance(v, dict):
            for k, e in list(v.items())[:1024]:
                visit(f"{path}[{k!r}]", e, depth + 1, lambda d=v, k=k: d[k], lambda x, d=v, k=k: d.__setitem__(k, x))
        elif isinstance(v, (list, tuple)):
            for i, e in enumerate(v[:1024]):
                put = (lambda x, seq=v, i=i: seq.__setitem__(i, x)) if isinstance(v, list) else None
                visit(f"{path}[{i}]", e, depth + 1, lambda seq=v, i=i: seq[i], put)
        try:
            attrs = vars(v)
        except TypeError:
            return
        if type(v).__module__.startswith(("graphctl.graphs.", "graphctl.state.", "torch.")):
            return  # graphctl's machinery and torch's internals hold no user callables
        for k, e in list(attrs.items()):
            if not k.startswith("__"):
                visit(f"{path}.{k}", e, depth + 1, lambda o=v, k=k: getattr(o, k),
                      lambda x, o=v, k=k: setattr(o, k, x))

    for name, root, get, put in _holders(fn, roots):
        visit(name, root, 0, get, put)
    visit = None  # noqa: F841 - break the function <-> cell cycle, as the other walkers do
    return list(out.values())


def _holders(fn: Any, roots: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any, Callable, Callable | None]]:
    """The roots with a way to rebind each: closure cells and globals of the user's function can
    be rebound; arguments and ``self`` cannot (only what they hold)."""
    target = unwrap(fn)
    if inspect.ismethod(target):
        target = target.__func__
    code = getattr(target, "__code__", None)  # builtins and callables without Python code have none
    cells = dict(zip(code.co_freevars, target.__closure__ or ())) if code is not None else {}
    g = getattr(target, "__globals__", {})
    for name, value in roots:
        if name in cells:
            cell = cells[name]
            yield name, value, (lambda c=cell: c.cell_contents), (lambda x, c=cell: setattr(c, "cell_contents", x))
        elif code is not None and name in code.co_names and g.get(name) is value:
            yield name, value, (lambda n=name: g[n]), (lambda x, n=name: g.__setitem__(n, x))
        else:
            yield name, value, (lambda v=value: v), None


def refuse_inductor_graphs(fn: Any, found: Iterable[Site]) -> None:
    """``mode="reduce-overhead"`` (Inductor's CUDA graphs) cannot run inside graphctl's capture:
    a ``DeclarationError`` naming the compiled callable, before anything runs."""
    for path, obj in [("the forward", fn), *((s.path, s.obj) for s in found)]:
        if not is_compiled(obj):
            continue
        call = obj.forward if isinstance(obj, OptimizedModule) else obj
        try:
            config = call.get_compiler_config() or {}
        except Exception:  # a backend without a config (aot_eager, a custom callable): no Inductor graphs
            config = {}
        if config.get("triton.cudagraphs"):
            raise DeclarationError("a compiled callable records its own CUDA graphs", buffer=path,
                                   expected="torch.compile without Inductor CUDA graphs (graphctl owns the graphs)",
                                   found="mode='reduce-overhead' (triton.cudagraphs=True)",
                                   fix="compile with mode='default' or mode='max-autotune-no-cudagraphs'")


def never_compiled(fn: Any, found: Iterable[Site]) -> list[str]:
    """Paths of compiled functions whose user code dynamo holds no compiled entry for (after the
    warmups ran them): dynamo skipped them, and skips them at every later call. Seen on torch 2.11
    once a compiled frame ran under any dispatch mode: its code is marked skipped for good, so no
    later call asks dynamo again and :class:`Counters` sees nothing. Compiled modules are not
    checked here (their entries sit on ``nn.Module``'s shared call code)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    out = []
    for path, obj in [("forward", fn), *((s.path, s.obj) for s in found)]:
        if not (isinstance(obj, types.FunctionType) and _ORIG in vars(obj)):
            continue
        user = unwrap(obj)
        code = getattr(user.__func__ if inspect.ismethod(user) else user, "__code__", None)
        if code is not None and not _debug_get_cache_entry_list(code):
            out.append(path)
    return out


@dataclasses.dataclass
class Counters:
    """Dynamo's work during graphctl's passes, from its global counters: frames it was asked to
    convert (each a cache miss: a first compile, a recompile, or a frame it then ran
    uncompiled), graphs it compiled, graph breaks."""

    frames: int = 0
    graphs: int = 0
    breaks: int = 0

    @staticmethod
    def now() -> Counters:
        return Counters(counters["frames"]["total"], counters["stats"]["unique_graphs"],
                        sum(counters["graph_break"].values()))

    def since(self, before: Counters) -> Counters:
        return Counters(self.frames - before.frames, self.graphs - before.graphs, self.breaks - before.breaks)

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
  and the emulated recorder runs every compiled callable it can reach (``graphs/findings/reach.py`` finds
  them) as one opaque recorded call, with the recorder popped and the stance restored, and everything else
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
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

from graphctl.errors import DeclarationError
from graphctl.knobs import knobs

__all__ = ["unwrap", "is_compiled", "is_optimized_module", "eager", "Counters", "refuse_inductor_graphs",
           "never_compiled", "use_compile_cache"]

_ORIG = "_torchdynamo_orig_callable"  # set by torch.compile on the function it returns
_DISABLED = "_torchdynamo_disable"  # set by torch.compiler.disable (which sets _ORIG too)
_CALLS = (torch.nn.Module.__call__, torch.nn.Module._wrapped_call_impl, torch.nn.Module._call_impl)


def is_optimized_module(obj: Any) -> bool:
    """``obj`` is a compiled module (dynamo's ``OptimizedModule``), asked without importing dynamo,
    two thirds of ``import graphctl``'s time otherwise (issue 54): before anything imported
    ``torch._dynamo``, nothing can have made one."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    return frame is not None and isinstance(obj, frame.OptimizedModule)


def is_compiled(obj: Any) -> bool:
    """A compiled module, or a function ``torch.compile`` returned (not one ``torch.compiler.disable``
    returned, such as an ``@graphctl.eager`` region: dynamo never compiles it)."""
    return is_optimized_module(obj) or (isinstance(obj, types.FunctionType) and _ORIG in vars(obj)
                                                and not vars(obj).get(_DISABLED))


def unwrap(fn: Any) -> Any:
    """The user's code behind compile wrappers: a compiled function's original, a compiled
    module's original ``forward``; a module (or its bound ``__call__``) becomes its ``forward``."""
    for _ in range(8):  # wrappers nest (a compiled compiled function); a cycle would be a torch bug
        if is_optimized_module(fn):
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


def refuse_inductor_graphs(fn: Any, found: Iterable[Any]) -> None:
    """``mode="reduce-overhead"`` (Inductor's CUDA graphs) cannot run inside graphctl's capture:
    a ``DeclarationError`` naming the compiled callable, before anything runs."""
    for path, obj in [("the forward", fn), *((s.path, s.obj) for s in found)]:
        if not is_compiled(obj):
            continue
        call: Any = obj.forward if is_optimized_module(obj) else obj
        try:
            config = call.get_compiler_config() or {}
        except Exception:  # a backend without a config (aot_eager, a custom callable): no Inductor graphs
            config = {}
        if config.get("triton.cudagraphs"):
            raise DeclarationError("a compiled callable records its own CUDA graphs", buffer=path,
                                   expected="torch.compile without Inductor CUDA graphs (graphctl owns the graphs)",
                                   found="mode='reduce-overhead' (triton.cudagraphs=True)",
                                   fix="compile with mode='default' or mode='max-autotune-no-cudagraphs'")


def never_compiled(fn: Any, found: Iterable[Any]) -> list[str]:
    """Paths of compiled functions whose user code dynamo holds no compiled entry for (after the
    warmups ran them): dynamo skipped them, and skips them at every later call. Seen on torch 2.11
    once a compiled frame ran under any dispatch mode: its code is marked skipped for good, so no
    later call asks dynamo again and :class:`Counters` sees nothing. Compiled modules are not
    checked here (their entries sit on ``nn.Module``'s shared call code)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    out = []
    for path, obj in [("forward", fn), *((s.path, s.obj) for s in found)]:
        if not is_compiled(obj) or is_optimized_module(obj):
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
    uncompiled), graphs it compiled, graph breaks; and Inductor's FX-graph cache: graphs loaded
    from it (``cache_hits``) and compiled afresh (``cache_misses``)."""

    frames: int = 0
    graphs: int = 0
    breaks: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

    @staticmethod
    def now() -> Counters:
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:  # dynamo never imported: nothing was compiled (and its import is not paid here)
            return Counters()
        c = utils.counters
        return Counters(c["frames"]["total"], c["stats"]["unique_graphs"], sum(c["graph_break"].values()),
                        c["inductor"]["fxgraph_cache_hit"], c["inductor"]["fxgraph_cache_miss"])

    def since(self, before: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(before))))


def use_compile_cache() -> str | None:
    """``GRAPHCTL_COMPILE_CACHE``, where set, as torch's compile-cache directories (Inductor's and
    Triton's): torch reads them at each cache lookup, so this comes before a compiled forward's
    first call. It overrides ``TORCHINDUCTOR_CACHE_DIR``, which torch itself fills with its
    default on first use (a set-if-unset would lose to that). The directory, or None."""
    where = knobs.compile_cache
    if not where:
        return None
    where = os.path.abspath(where)
    os.makedirs(where, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    os.environ["TRITON_CACHE_DIR"] = os.path.join(where, "triton")
    return where

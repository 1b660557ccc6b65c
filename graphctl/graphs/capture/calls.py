"""How a forward's call binds: argument names, defaults and positions, put back together into
a call, and the frozen (non-input) arguments compared at every replay.

A graph bakes every argument that is not a static input into itself: the object and what it
held at capture. :func:`frozen_change` says which one changed since (an in-place edit of a
``dict`` of settings, another tensor at another address), so a replay never runs on
capture-time values silently.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphctl.errors import ReplayError
from graphctl.graphs.capture.compiled import unwrap
from graphctl.graphs.capture.frozen import first_change, freeze

__all__ = ["Signature", "frozen_change", "name_of", "wraps"]


def name_of(fn: Any) -> str:
    """How graphctl names a forward in messages: its qualified name; a module (compiled or not)
    by its class and ``forward``."""
    if isinstance(fn, torch.nn.Module):
        return f"{type(unwrap(fn).__self__).__qualname__}.forward"
    return getattr(fn, "__qualname__", None) or repr(fn)


def wraps(wrapper: Any, fn: Callable[..., Any]) -> None:
    """``functools.update_wrapper`` for a runner: a module's state never copied into it."""
    functools.update_wrapper(wrapper, fn, updated=() if isinstance(fn, torch.nn.Module) else ("__dict__",))


class Signature:
    """A forward's parameters: binding a call by name, reading one argument fast, and putting
    named values back into ``(args, kwargs)``."""

    __slots__ = ("fn", "sig", "names", "position", "simple", "n_required")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        # a module's parameters are its forward's (its __call__ takes *args, **kwargs)
        self.sig = inspect.signature(unwrap(fn) if isinstance(fn, torch.nn.Module) else fn)
        self.names = list(self.sig.parameters)
        self.position = {p: i for i, p in enumerate(self.names)}
        # With *args/**kwargs in the signature an argument's position is not fixed: bind fully.
        self.simple = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in self.sig.parameters.values())
        self.n_required = sum(1 for p in self.sig.parameters.values() if p.default is p.empty)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Name -> value of every parameter (defaults applied); a missing, extra or unknown
        argument raises ``TypeError`` as Python would, naming the forward."""
        try:
            ba = self.sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{name_of(self.fn)}(): {exc}") from None
        ba.apply_defaults()
        return ba.arguments

    def get(self, args: tuple, kwargs: dict, name: str) -> Any:
        """One argument, without binding the whole call when positions are fixed."""
        if not self.simple:
            return self.bind(args, kwargs).get(name)
        i = self.position[name]
        if i < len(args):
            return args[i]
        if name in kwargs:
            return kwargs[name]
        return self.sig.parameters[name].default

    def positional(self, args: tuple, kwargs: dict, positions: Sequence[int]) -> list[Any] | None:
        """The arguments at ``positions`` of the usual call (positional, every required one
        given), or None when the call must be bound fully."""
        if kwargs or not self.simple or not self.n_required <= len(args) <= len(self.names):
            return None
        return [args[i] if i < len(args) else self.sig.parameters[self.names[i]].default for i in positions]

    def assemble(self, values: dict[str, Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` calling the forward with ``values`` (name -> value)."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for name, p in self.sig.parameters.items():
            if name not in values:
                continue
            v = values[name]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                args.append(v)
            elif p.kind is p.VAR_POSITIONAL:
                args.extend(v)
            elif p.kind is p.VAR_KEYWORD:
                kwargs.update(v)
            else:
                kwargs[name] = v
        return tuple(args), kwargs


def frozen_change(frozen: dict[str, tuple[Any, Any]], sig: Signature, args: tuple, kwargs: dict) -> ReplayError | None:
    """The first frozen argument (name -> (object, structural copy at capture)) that this call
    passes changed, as a ``ReplayError`` naming the entry; None when all are as captured."""
    for name, (want, copy) in frozen.items():
        live = sig.get(args, kwargs, name)
        if live is want and copy[0] in ("scalar", "object", "value"):  # nothing inside it can have changed
            continue
        where = first_change(freeze(live), copy, name)
        if where is None:
            continue
        what = ("a frozen argument was changed in place since the capture" if live is want
                else "a frozen argument differs from the capture")
        return ReplayError(what, buffer=where[0], expected=f"{where[1]} (baked into the graph)", found=where[2],
                           fix="pass the captured object unchanged, declare the argument in inputs=, or reset() "
                               "and capture again")
    return None

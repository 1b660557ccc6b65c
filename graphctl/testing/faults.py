"""Faults injected *inside* graphctl's steps, for the state machines: an op that writes half its
buffers and raises (:func:`partial_op`), and a raise at the k-th op dispatched anywhere
(:func:`fault_at_op`). Both reach the native switch table too: its C++ calls go through the
dispatcher, where a ``TorchDispatchMode`` sees them, so a fault lands between two of its puts,
inside a recompute it launches, or inside a Python ``Recompute`` fn it calls back."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphctl import ops

__all__ = ["InjectedFault", "InjectedInterrupt", "partial_op", "fault_at_op"]


class InjectedFault(Exception):
    """A fault the machine raised on purpose."""


class InjectedInterrupt(BaseException):
    """A ``KeyboardInterrupt``-like fault: not an ``Exception``."""


@contextlib.contextmanager
def partial_op(name: str, fired: list[str], stage: str) -> Iterator[None]:
    """Make the next call of ``ops.<name>`` write its first half of the buffers, then raise."""
    real = getattr(ops, name)
    armed = [True]

    def half_then_raise(statics, arenas, *rest, validate=True):
        if not armed[0]:  # fire once
            return real(statics, arenas, *rest, validate=validate)
        armed[0] = False
        k = len(statics) // 2
        if k:
            real(statics[:k], arenas[:k], *(r[:k] for r in rest), validate=validate)
        fired.append(stage)
        raise InjectedFault(f"{name} failed after {k} of {len(statics)} buffers")

    class HalfThenRaise(TorchDispatchMode):
        """The same fault where the native switch table calls the op (through the dispatcher, no
        Python wrapper): the in-op fault reaches inside the native step too."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if armed[0] and func is getattr(torch.ops.graphctl, name).default:
                armed[0] = False
                statics, arenas, *rest = args
                k = len(statics) // 2
                if k:
                    func(statics[:k], arenas[:k], *(r[:k] for r in rest))
                fired.append(stage)
                raise InjectedFault(f"{name} (native) failed after {k} of {len(statics)} buffers")
            return func(*args, **(kwargs or {}))

    setattr(ops, name, half_then_raise)
    try:
        with HalfThenRaise() if ops.uses_extension() else contextlib.nullcontext():
            yield
    finally:
        setattr(ops, name, real)


@contextlib.contextmanager
def fault_at_op(k: int, kind: type[BaseException], fired: list[str], stage: str) -> Iterator[list[str]]:
    """Raise ``kind`` instead of running the ``k``-th op (0-based) dispatched inside the block,
    once; yields the names of the ops dispatched in the block (element ``k``: where it fired; the
    ones after it are the caller's recovery, an undo or a restore). Views
    count like any other op: every dispatcher call is a place a real failure can come from."""
    seen: list[str] = []

    class RaiseAt(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            if len(seen) == k + 1:
                fired.append(stage)
                raise kind(f"injected at op {k} ({func}) of {stage}")
            return func(*args, **(kwargs or {}))

    with RaiseAt():
        yield seen

"""Outputs read after a later call overwrote them, made loud (a debug knob).

A graphed call returns views of the graph's static outputs: the next replay of the same bucket
writes into the same memory (PyTorch #122192 is this bug in user code; its cudagraph trees raise
on such an access). Under ``GRAPHCTL_CHECK_OUTPUTS=1`` every returned tensor is a
:class:`Watched` view that remembers which bucket produced it, at which replay, from which line;
any torch operation on it after that bucket replayed again raises ``ReplayError`` naming both
calls' lines; a view taken of it (``out[0][1:]``, ``.view``, ``.T``) is watched the same way,
since it reads the same memory. Merely keeping the old name alive (``logits = step(x)`` in a
loop) is no access, so it never raises. ``copy_outputs=True`` on the runner returns fresh tensors instead.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from graphctl.errors import ReplayError

__all__ = ["Watched", "watch"]


class Watched(torch.Tensor):
    """A view of a static output that checks, at every torch operation on it, that its bucket
    has not replayed since it was returned."""

    _gc_cap: Any
    _gc_replay: int
    _gc_where: str

    @staticmethod
    def __new__(cls, t: torch.Tensor, cap: Any, where: str) -> Watched:
        r = torch.Tensor._make_subclass(cls, t, t.requires_grad)  # shares t's storage
        r._gc_cap, r._gc_replay, r._gc_where = cap, cap.replays, where
        return r

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        watched = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Watched)]
        for a in watched:
            if a._gc_cap.replays != a._gc_replay:
                cap = a._gc_cap
                raise ReplayError(
                    "an output was read after a later call overwrote it", buffer=f"output of bucket {cap.bucket}",
                    expected="outputs used before the next call of the same bucket, or cloned",
                    found=f"returned by the call at {a._gc_where}, overwritten by the call at {cap.last_where} "
                          f"({cap.replays - a._gc_replay} replay(s) later)",
                    fix="clone what you keep (out.clone()), or pass copy_outputs=True to get fresh tensors")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            # a result sharing a watched output's memory (a view: out[0][1:], .view, .T, an in-place
            # op's return) reads the bytes the next replay overwrites: it stays watched, as its source
            homes = {a.untyped_storage().data_ptr(): a for a in watched if a.numel()}

            def rewrap(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                plain = t.as_subclass(torch.Tensor) if isinstance(t, Watched) else t
                src = homes.get(plain.untyped_storage().data_ptr()) if plain.numel() else None
                return plain if src is None else Watched._of(plain, src)

            return tree_map(rewrap, out)

    @staticmethod
    def _of(t: torch.Tensor, src: Watched) -> Watched:
        r = torch.Tensor._make_subclass(Watched, t, t.requires_grad)
        r._gc_cap, r._gc_replay, r._gc_where = src._gc_cap, src._gc_replay, src._gc_where
        return r


def watch(out: Any, cap: Any, where: str) -> Any:
    """``out`` (a pytree of the call's outputs) with each tensor a :class:`Watched` view."""
    return tree_map(lambda t: Watched(t, cap, where) if isinstance(t, torch.Tensor) else t, out)

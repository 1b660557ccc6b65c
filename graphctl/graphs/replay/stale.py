"""Outputs read after a later call overwrote them, made loud (a debug knob).

A graphed call returns views of the graph's static outputs: the next replay of the same bucket
writes into the same memory (PyTorch #122192 is this bug in user code; its cudagraph trees raise
on such an access). Under ``GRAPHCTL_CHECK_OUTPUTS=1`` every returned tensor is a
:class:`Watched` view that remembers which bucket produced it, at which replay, from which line;
any torch operation on it after that bucket replayed again raises ``ReplayError`` naming both
calls' lines; a view taken of it (``out[0][1:]``, ``.view``, ``.T``) is watched the same way,
since it reads the same memory. Merely keeping the old name alive (``logits = step(x)`` in a
loop) is no access, so it never raises. ``copy_outputs=True`` on the runner returns fresh tensors instead.

Without the knob, :class:`Held` warns once (``OutputsHeldWarning``) where a caller keeps outputs
past the call that overwrote them. Two sets of views of the static outputs alternate between
calls, so "returned two calls ago" is a distinct set of Python objects: if any of them is still
referenced beyond graphctl's own references when the call after next returns, the caller kept
it (``prev = step(x)``, ``outs.append(step(x))``). Views the caller takes of an output
(``out[0][1:]``) are new tensors on the output's storage; they are seen by the storage's use
count (as PyTorch's cudagraph trees count them), which cannot say which call a view came from:
only views accumulating over calls warn (``kept.append(out[:, -1])``). One view kept for a long
time reads as the loop's ``last = logits[:, -1]``; ``GRAPHCTL_CHECK_OUTPUTS=1`` catches its read.
The common ``logits = step(x)`` loop holds only the last call's outputs and never warns.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from graphctl.errors import OutputsHeldWarning, ReplayError
from graphctl.graphs.findings.frames import user_frame

__all__ = ["Held", "Watched", "refs", "watch"]

_USE_COUNT = torch._C._storage_Use_Count  # tensors (and Python storage objects) on a storage


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


def refs(objs: tuple) -> tuple[int, ...]:
    """Each object's reference count (one code path for the baseline and the check, so both
    count the same temporaries)."""
    return tuple(map(sys.getrefcount, objs))


class Held:
    """One bucket's check that callers do not keep its outputs past a replay (see the module
    docstring). ``given(rec)`` at each default-path call, before its outputs are returned:
    ``rec`` = (the objects it returns: the container and its tensors, their reference counts
    when graphctl alone held them). Costs a reference count per returned object and a use count
    per output storage, about 0.3 us a call."""

    __slots__ = ("_older", "_newer", "_roots", "_own", "_views", "_trend", "warned")

    def __init__(self, outs: list[Any], manifest: dict[str, int]) -> None:
        self._older: tuple | None = None  # rec of the call before the last
        self._newer: tuple | None = None  # rec of the last call
        # the outputs' own storages (an output aliasing an input or a state buffer shares it with
        # tensors the engine makes and drops as it likes)
        roots: dict[int, None] = {}  # an ordered set
        for t in outs:
            if isinstance(t, torch.Tensor) and t.numel():
                st = t.untyped_storage()
                lo = st.data_ptr()
                if not any(lo <= a < lo + st.nbytes() for a in manifest.values()):
                    roots[st._cdata] = None
        self._roots = list(roots)
        self._own = self.uses()  # graphctl's own tensors on those storages
        self._views = -1  # other tensors on those storages at the last call, or -1
        self._trend = 0  # calls in a row at which that count grew
        self.warned = False

    def uses(self) -> int:
        return sum(map(_USE_COUNT, self._roots))

    def built(self, before: int) -> None:
        """graphctl made views of the outputs since ``before = uses()``: they are its own."""
        self._own += self.uses() - before

    def given(self, rec: tuple, bucket: int) -> None:
        older, self._older, self._newer = self._older, self._newer, rec
        if self.warned:
            return
        # the caller's own references to what it got two calls ago (the same objects this call returns)
        if older is not None and refs(older[0]) != older[1]:  # never below: graphctl's references stay
            self._warn(bucket, "an output returned two calls ago is still held",
                       "keep only the last call's outputs (logits = step(x))")
            return
        views = self.uses() - self._own
        self._trend = self._trend + 1 if 0 <= self._views < views else 0
        self._views = views
        if self._trend >= 2:
            self._warn(bucket, f"views of its outputs pile up across calls ({views} held now)",
                       "keep no view of an output past the next call")

    def _warn(self, bucket: int, what: str, keep: str) -> None:
        self.warned = True
        warnings.warn(f"graphctl: bucket {bucket}: {what} (call at {user_frame()}); the replays since have "
                      f"overwritten it, so it reads the newest call's values. Fix: {keep}, clone what you keep "
                      f"(out.clone()), or pass copy_outputs=True; GRAPHCTL_CHECK_OUTPUTS=1 raises at the read.",
                      OutputsHeldWarning, stacklevel=5)  # _warn, given, result, __call__, caller

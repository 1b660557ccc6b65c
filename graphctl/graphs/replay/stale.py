"""Outputs read after a later call overwrote them: an error at the read, by default.

A graphed call returns views of the graph's static outputs: the next replay of the same bucket
writes into the same memory (PyTorch #122192 is this bug in user code). By default
(:class:`Handouts`) each call's outputs live on storage objects of their own that alias the static
memory (DLPack: the alias keeps the static output alive), and before each replay of the bucket the
outputs handed out at the last call, if anything still holds them or a view of them, have their
storages marked (``torch._C._set_storage_data_ptr_access_error_msg``, what PyTorch's cudagraph trees
use): any later read of them, or of a view taken of them, raises ``RuntimeError`` naming the call
that returned them, the call that overwrote them and the fix. Nothing is paid per op. Two sets of
outputs alternate between calls, so ``logits = step(x)`` in a loop (the old outputs still named
during the next call, dropped right after) gets its set back unmarked at the call after next,
with no new tensor made; a set still held then stays marked for good and a fresh one is made.
An output that aliases a declared state buffer (the caller's own memory) is handed out as a
plain view, unchecked (one aliasing a static input is checked like any output, against its own
bucket's replays: a call at another bucket loads the shared static input unseen); one that
DLPack cannot carry (quantized, conjugated) is marked on its own tensor (views taken of it
earlier are not caught).

Under ``GRAPHCTL_CHECK_OUTPUTS=1`` every returned tensor is a :class:`Watched` view instead that
remembers which bucket produced it, at which replay, from which line; any torch operation on it
after that bucket replayed again raises ``ReplayError`` naming both calls' lines (a debug knob: a
Python check per op). ``copy_outputs=True`` on the runner returns fresh tensors.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.dlpack import from_dlpack, to_dlpack

from graphctl import ops
from graphctl.errors import ReplayError
from graphctl.graphs.findings.frames import caller_fn, shown

__all__ = ["Handouts", "Watched", "watch"]



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


_USE_COUNT = torch._C._storage_Use_Count  # tensors (and Python storage objects) on a storage
_MARK = torch._C._set_storage_data_ptr_access_error_msg
# newer than torch 2.11 (graphctl's floor): without it a marked set is never unmarked, so a call after a
# marked one takes a fresh set (new aliases: a few microseconds) instead of clearing the mark
_CLEAR = getattr(torch._C, "_clear_storage_data_ptr_access_error_msg", None)
_RELEASE = torch._C._set_storage_access_error_msg  # one tensor's: it lets go of its storage for good


def _alias(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` on a storage object of its own over the same memory, holding ``t``'s alive (the
    DLPack capsule owns a reference); None where DLPack cannot carry it."""
    try:
        return from_dlpack(to_dlpack(t))
    except (RuntimeError, BufferError, TypeError):
        return None


class _Set:
    """The outputs handed out at one parity: per ``n``, the container and the sliced views."""

    __slots__ = ("bases", "cdatas", "released", "by_n", "objs", "counts", "own", "where", "marked")

    def __init__(self, bases: list[tuple[torch.Tensor, int]]) -> None:
        self.bases = bases  # per output leaf: (what its views are taken of, how it is checked: _ALIAS, ...)
        self.cdatas = tuple(b.untyped_storage()._cdata for b, how in bases if how == _ALIAS)
        self.released = any(how == _OWN for _, how in bases)  # marked tensor by tensor: never reused once marked
        self.by_n: dict[int, Any] = {}
        self.objs: tuple = ()  # everything handed out at any n: containers and tensors
        self.counts: tuple[int, ...] = ()
        self.own = 0  # graphctl's tensors on the aliases' storages
        self.where: tuple[Any, int] = (None, 0)
        self.marked = False

_ALIAS, _OWN, _PLAIN = 0, 1, 2  # storage-level mark; tensor-level mark; unchecked (the caller's own memory)


class Handouts:
    """One bucket's outputs as calls hand them out, and their marking when a replay overwrites
    them (see the module docstring). ``overwriting()`` before every replay of the bucket,
    ``give(n)`` for a call's result."""

    __slots__ = ("_cap", "_kinds", "_sets", "_last", "_calls", "_msg", "_now", "_count", "_held", "_where")

    def __init__(self, cap: Any) -> None:
        self._cap = cap  # the BucketGraph: bucket, static outputs, slicing, manifest
        self._count, self._held = ops.handed_checks()  # one C call each (the Python reference without _C)
        self._where = caller_fn()  # the user's line of a call
        kinds = []
        for t in cap.out_flat:
            if not isinstance(t, torch.Tensor):
                kinds.append(_PLAIN)
                continue
            st = t.untyped_storage()
            lo = st.data_ptr()
            # a declared state buffer is the caller's own memory; a static input is graphctl's (each call loads it)
            caller_memory = any(lo <= a < lo + st.nbytes() for n, a in cap.manifest.items()
                                if not n.startswith("input:"))
            kinds.append(_PLAIN if caller_memory else _ALIAS)
        self._kinds = kinds
        self._sets: list[_Set | None] = [None, None]
        self._last: _Set | None = None
        self._calls = 0
        self._msg: tuple[Any, Any, str] = ((None, -1), (None, -1), "")  # the last message and both calls' lines
        self._now: tuple[Any, int] | None = None  # the caller of the replay running now, found by overwriting()

    def _new_set(self) -> _Set:
        bases: list[tuple[Any, int]] = []
        for t, kind in zip(self._cap.out_flat, self._kinds):
            if kind == _ALIAS:
                a = _alias(t)
                bases.append((a, _ALIAS) if a is not None else (t, _OWN))
            else:
                bases.append((t, kind))
        return _Set(bases)

    def _add(self, s: _Set, n: int) -> None:
        cap = self._cap
        leaves = [b if not isinstance(b, torch.Tensor) else (b[: n * r] if r is not None else b.view(b.shape))
                  for (b, _), r in zip(s.bases, cap.out_rows)]
        out = leaves[0] if cap.single else tree_unflatten(leaves, cap.out_spec)
        s.by_n[n] = out
        new = (out,) if cap.single else (out, *(t for t in leaves if isinstance(t, torch.Tensor)))
        del leaves, out
        s.objs = s.objs + new
        del new
        s.counts = self._count(s.objs)
        s.own = sum(map(_USE_COUNT, s.cdatas))

    def overwriting(self) -> None:
        """Before a replay of the bucket: the outputs the last call handed out, if still held, are
        marked (their reads raise from now on)."""
        s = self._last
        if s is None:
            return
        self._last = None
        now = self._now = self._where()
        if not self._held(s.objs, s.counts, s.cdatas, s.own):
            return
        then, last = s.where, self._msg
        if then == last[0] and now == last[1]:  # a loop: the same two lines as the last time
            msg = last[2]
        else:
            msg = self._message(then, now)
            self._msg = (then, now, msg)
        for cd in s.cdatas:
            _MARK(cd, msg)
        if s.released:
            for out in s.by_n.values():
                for t, (_, how) in zip([out] if self._cap.single else tree_flatten(out)[0], s.bases):
                    if how == _OWN:
                        _RELEASE(t, msg)
        s.marked = True

    def _message(self, then: tuple[Any, int], now: tuple[Any, int]) -> str:
        return (f"graphctl: this tensor is an output of bucket {self._cap.bucket}'s graph returned by the call at "
                f"{shown(then)}, overwritten since by the call at {shown(now)} (a replay writes the same memory); "
                f"read now it would hold that call's values. Fix: use outputs before the next call of the same "
                f"bucket, clone what you keep (out.clone()), or pass copy_outputs=True to the runner.")

    def give(self, n: int) -> Any:
        """The outputs sliced to ``n``, from the set of this call's parity."""
        self._calls += 1
        p = self._calls & 1
        s = self._sets[p]
        if s is not None and s.marked:
            if s.released or _CLEAR is None or self._held(s.objs, s.counts, s.cdatas, s.own):
                s = None  # the caller keeps them: stale for good, and a fresh set for this call
            else:
                for cd in s.cdatas:
                    _CLEAR(cd)
                s.marked = False
        if s is None:
            s = self._sets[p] = self._new_set()
        out = s.by_n.get(n)
        if out is None:
            self._add(s, n)
            out = s.by_n[n]
        now, self._now = self._now, None
        s.where = now if now is not None else self._where()  # the code objects stay alive: the messages' keys hold
        self._last = s
        return out

"""Undo of a warmup's writes into declared lasting state by the rows they touched.

A ``Persistent`` buffer (``graphctl/state/spec.py``) is state the forward itself writes, such as
a KV-cache pool: warmups are undone on it. A copy of each whole pool taken before the passes
(what the runner did) costs a second KV cache for the length of ``capture_all``, 2 GiB for
llama-1b's two caches at 64 sequences of 512 tokens, where a hand capture costs nothing: it writes
a warmup's K/V into slots nobody reads yet. A :class:`Journal` keeps instead, op by op under the
write tracker (``graphs/findings/stream.py``), the pre-image of what each write is about to change, and
puts them back newest first:

- an indexed write (``index_copy_``, ``index_put_``, ``index_fill_``, ``index_add_``, the
  ``scatter`` family) keeps the rows its index selects (duplicates read the same old row, so
  the order they are put back in does not matter);
- any other in-place or ``out=`` write keeps the view it writes (the whole tensor if it is one);
- past half a storage's size in pre-images, or for an op whose index it cannot read, the whole
  storage once, after which that storage's later writes need nothing (putting the whole copy
  back, in its turn, undoes them).

Only runs a tracker watches can be undone so: the runner uses a journal where every warmup is
tracked (an eager forward) and takes a whole copy anyway before a capture that executes the
forward (the emulated recorder, a CUDA capture with eager regions).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Journal", "storage_bytes", "arguments", "op_tensors", "fresh_results"]


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the whole storage under ``t``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def op_tensors(*values: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results: bare, in a list or tuple (``Tensor[]``,
    ``Tensor?[]``, a tuple of results) or a dict's values. What pytree's ``tree_flatten`` finds in
    them, at a fraction of its cost: the tracker calls it for every op of a tracked warmup."""
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += op_tensors(*v)
        elif isinstance(v, dict):
            out += op_tensors(*v.values())
    return out


def fresh_results(func: Any, out: Any) -> list[tuple[int, torch.Tensor]]:
    """``(position, tensor)`` of an op's results with storage of their own, positions counted as
    pytree's ``tree_flatten`` counts the result's leaves. A return the schema marks as aliasing an
    input (in-place, ``out=``, a view) is not fresh; a ``Tensor[]`` return is aliased or not as a
    whole. The write tracker (new tensors are no side effect) and the emulated recorder (fresh
    results are copied into the capture-time outputs on replay) share this one rule."""
    rets = func._schema.returns
    if not isinstance(out, (list, tuple)):  # a Tensor, None (no returns) or a Python number
        return [(0, out)] if isinstance(out, torch.Tensor) and rets[0].alias_info is None else []
    fresh, i = [], 0
    for r, value in zip(rets, (out,) if len(rets) == 1 else out):
        for leaf in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(leaf, torch.Tensor) and r.alias_info is None:
                fresh.append((i, leaf))
            i += 1
    return fresh


_BY_INDEX = {"aten::index_copy_", "aten::index_fill_", "aten::index_add_"}
_BY_INDICES = {"aten::index_put_", "aten::_index_put_impl_"}
_SCATTER = {"aten::scatter_", "aten::scatter_add_", "aten::scatter_reduce_"}


def arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op call's arguments by their schema names (positional or keyword; absent ones None)."""
    return {a.name: (args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(func._schema.arguments)}


def _region(func: Any, args: tuple, kwargs: dict, written: torch.Tensor) -> tuple[Callable[[], object], int] | None:
    """How to put back what ``func`` is about to write into ``written``, and the bytes kept for it."""
    name = func._schema.name
    a = arguments(func, args, kwargs)
    target = a.get("self")
    if target is written and name in _BY_INDEX | _SCATTER:
        dim, index = a["dim"], a["index"].clone()
        if name in _BY_INDEX:
            pre = target.index_select(dim, index)
            return (lambda: target.index_copy_(dim, index, pre)), pre.nbytes
        pre = target.gather(dim, index)
        return (lambda: target.scatter_(dim, index, pre)), pre.nbytes
    if target is written and name in _BY_INDICES:
        indices = [i.clone() if isinstance(i, torch.Tensor) else i for i in a["indices"]]
        pre = torch.ops.aten.index.Tensor(target, indices)
        return (lambda: torch.ops.aten.index_put_(target, indices, pre)), pre.nbytes
    if name in _BY_INDEX | _SCATTER | _BY_INDICES:
        return None  # an out= variant of an indexed write: the whole storage
    pre = written.clone()
    return (lambda: written.copy_(pre)), pre.nbytes


class Journal:
    """Pre-images of one run's writes into ``storages`` (storage key -> a tensor on it)."""

    def __init__(self, storages: dict[tuple[str, int], torch.Tensor]) -> None:
        self.storages = storages
        self._undo: list[Callable[[], object]] = []
        self._kept: dict[tuple[str, int], int] = {}
        self._whole: set[tuple[str, int]] = set()

    def record(self, func: Any, args: tuple, kwargs: dict, written: torch.Tensor, key: tuple[str, int]) -> None:
        """Keep what ``func`` (not yet run) is about to overwrite in ``written`` (a tensor on ``key``)."""
        if key in self._whole:
            return
        size = written.untyped_storage().nbytes()
        with torch.no_grad():
            got = _region(func, args, kwargs, written)
            if got is not None and self._kept.get(key, 0) + got[1] <= size // 2:
                self._undo.append(got[0])
                self._kept[key] = self._kept.get(key, 0) + got[1]
                return
            whole = storage_bytes(written)
            copy = whole.clone()
        self._undo.append(lambda: whole.copy_(copy))
        self._whole.add(key)
        self._kept[key] = self._kept.get(key, 0) + size

    @property
    def nbytes(self) -> int:
        """Bytes of pre-images kept (what the run's undo costs in memory)."""
        return sum(self._kept.values())

    def undo(self) -> None:
        """Put every recorded region back, newest first; the journal is empty afterwards."""
        with torch.no_grad():
            for fn in reversed(self._undo):
                fn()
        self._undo.clear()
        self._kept.clear()
        self._whole.clear()

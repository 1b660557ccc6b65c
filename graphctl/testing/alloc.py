"""Allocation accounting that works on a CPU: a dispatch mode that records every op whose
output lives in a storage none of its inputs owned (a fresh allocation), with the op name.

Views and in-place ops reuse their inputs' storage and are not counted. Work done inside a
C++ kernel without going through the dispatcher is invisible here; on CUDA, pair this with
``torch.cuda.memory_stats`` (see tests/cuda)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationTracker"]


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class AllocationTracker(TorchDispatchMode):
    """``with AllocationTracker() as a: ...; assert not a.allocations``."""

    def __init__(self, where: Callable[[], str | None] | None = None) -> None:
        super().__init__()
        self.allocations: list[str] = []
        self.where = where  # names the user callable running, if any (the state's Recompute fn, its source)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = _storages((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and \
                    t.untyped_storage().data_ptr() not in seen:
                who = self.where() if self.where is not None else None
                self.allocations.append(f"{func} -> {tuple(t.shape)} {t.dtype}" + (f" in {who}" if who else ""))
        return out

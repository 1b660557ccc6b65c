"""Allocation accounting that works on a CPU: a dispatch mode that records every op whose
output lives in a storage none of its inputs owned (a fresh allocation), with the op name.

Views and in-place ops reuse their inputs' storage and are not counted. Work done inside a
C++ kernel without going through the dispatcher is invisible here; on CUDA, pair this with
``torch.cuda.memory_stats`` (see tests/cuda)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["AllocationTracker"]


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class AllocationTracker(TorchDispatchMode):
    """``with AllocationTracker() as a: ...; assert not a.allocations``."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = _storages((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and \
                    t.untyped_storage().data_ptr() not in seen:
                self.allocations.append(f"{func} -> {tuple(t.shape)} {t.dtype}")
        return out

"""Random buffer sets for op-equivalence tests, shared by tests/unit (CPU) and tests/cuda.

Each set mixes dtypes, odd and zero sizes, and views that start at storage offsets (so data
pointers are not aligned to the element or vector size)."""
from __future__ import annotations

import torch

from graphctl.testing import DTYPES, random_tensor


def buffer_set(n: int, gen: torch.Generator, device="cpu", max_numel: int = 300):
    """n triples (static, arena, source) with per-index equal byte sizes and random dtypes."""
    statics, arenas, sources = [], [], []
    for _ in range(n):
        dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=gen))]
        numel = int(torch.randint(0, max_numel, (1,), generator=gen))
        if int(torch.randint(5, (1,), generator=gen)) == 0:
            numel = 0
        statics.append(_maybe_offset(numel, dtype, gen, device))
        arenas.append(_maybe_offset(numel, dtype, gen, device).fill_(13))  # poison the arena
        sources.append(_maybe_offset(numel, dtype, gen, device))
    return statics, arenas, sources


def _maybe_offset(numel: int, dtype: torch.dtype, gen: torch.Generator, device) -> torch.Tensor:
    off = int(torch.randint(0, 3, (1,), generator=gen))  # a view into a larger storage
    base = random_tensor((numel + off + 1,), dtype, gen, device)
    return base[off:off + numel]


def clones(ts):
    return [t.clone() for t in ts]


def bytes_equal(a, b) -> bool:
    """Bitwise equality of two tensor lists (on the CPU), whatever their dtypes."""
    return all(torch.equal(x.reshape(-1).view(torch.uint8).cpu(), y.reshape(-1).view(torch.uint8).cpu())
               for x, y in zip(a, b))

"""The DeepSeek-V4 family (TensorRT-LLM's DeepSeek-V4 attention metadata), on DSA.

Adds:

- ``sliding_block_tables`` ``[L, S, B]`` (per sliding-attention layer), swapped to a draft twin
  that ``prepare()`` fills from the draft manager;
- the SWA and sparse-MLA pool base pointers as *device pointer tables* (``swa_buffer_ptrs``
  ``[L]``, ``sparse_mla_base_ptrs`` ``[R]``, int64 addresses) instead of host scalars baked into
  each launch: a kernel reads its base from the table, so moving to the draft's pools is a
  table write (``CopyInPlace`` from the draft tables), which works eagerly and, recorded, in a
  graph. TensorRT-LLM passes them as kernel scalars, which a capture bakes in.

The draft must be SWA-only: compressed pools are not swapped. :func:`not_supported_reasons`
says so as data for a configuration whose draft uses compression.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from graphctl.families.dsa import DSAKVCacheManager, DSAMetadata, dsa_spec
from graphctl.state import CopyInPlace, Pad, StateSpec, Swap

__all__ = ["DSv4KVCacheManager", "DeepseekV4Metadata", "deepseek_v4_spec", "not_supported_reasons"]


class DSv4KVCacheManager(DSAKVCacheManager):
    """Adds per-layer sliding-window pools and per-ratio sparse-MLA pools (their base addresses
    are what the pointer tables hold)."""

    def __init__(self, name: str, *, swa_layers: int = 2, ratios: Sequence[int] = (4, 128), **kw) -> None:
        super().__init__(name, **kw)
        dev, head = self.block_ids.device, self.k[0].shape[-1]
        self.swa_pools = [torch.zeros(self.num_blocks, self.block_size, head, device=dev) for _ in range(swa_layers)]
        self.sparse_pools = {r: torch.zeros(self.num_blocks, head, device=dev) for r in ratios}
        self.swa_ptrs = torch.tensor([p.data_ptr() for p in self.swa_pools], dtype=torch.int64, device=dev)
        self.sparse_ptrs = torch.tensor([self.sparse_pools[r].data_ptr() for r in ratios], dtype=torch.int64,
                                        device=dev)

    def sliding_block_tables(self, out: torch.Tensor) -> torch.Tensor:
        """Each sliding layer's table: the last blocks of each sequence, rotated per layer."""
        for layer in range(out.shape[0]):
            out[layer].copy_(torch.roll(self.block_ids, shifts=layer, dims=1))
        return out


def not_supported_reasons(*, draft_compress_ratios: Sequence[int] = (1,)) -> list[str]:
    """Why this backend cannot run a draft configuration (empty when it can)."""
    reasons = []
    if draft_compress_ratios and draft_compress_ratios[-1] != 1:
        reasons.append(f"the draft must be SWA-only (last compress ratio 1), found {list(draft_compress_ratios)}: "
                       "compressed pools are not swapped to the draft's")
    return reasons


def deepseek_v4_spec(name: str = "deepseek_v4", *, block_size: int, base: StateSpec | None = None) -> StateSpec:
    spec = StateSpec(name, extends=base or dsa_spec(block_size=block_size))
    spec.buffer("sliding_block_tables", shape=("LS", "S", "B"), dtype=torch.int32, axis="seq", axis_dim=1,
                pad=Pad.clamp(0), readers={"target"},
                draft=Swap(twin="draft_sliding_block_tables"))
    spec.buffer("draft_sliding_block_tables", shape=("LS", "S", "B"), dtype=torch.int32, axis="seq", axis_dim=1,
                pad=Pad.clamp(0), readers={"draft"})
    spec.buffer("swa_buffer_ptrs", shape=("LS",), dtype=torch.int64,
                draft=CopyInPlace(source=lambda m: m.draft_kv_cache_manager.swa_ptrs))
    spec.buffer("sparse_mla_base_ptrs", shape=("R",), dtype=torch.int64,
                draft=CopyInPlace(source=lambda m: m.draft_kv_cache_manager.sparse_ptrs))
    return spec


class DeepseekV4Metadata(DSAMetadata):
    kv_cache_manager: DSv4KVCacheManager
    draft_kv_cache_manager: DSv4KVCacheManager

    def __init__(self, *, kv_cache_manager: DSv4KVCacheManager, draft_kv_cache_manager: DSv4KVCacheManager,
                 **kw) -> None:
        super().__init__(kv_cache_manager=kv_cache_manager, draft_kv_cache_manager=draft_kv_cache_manager, **kw)
        S, B = self.block_table.shape
        L, dev = len(kv_cache_manager.swa_pools), self.block_table.device
        self.sliding_block_tables = torch.zeros(L, S, B, dtype=torch.int32, device=dev)
        self.draft_sliding_block_tables = torch.zeros(L, S, B, dtype=torch.int32, device=dev)
        self.swa_buffer_ptrs = kv_cache_manager.swa_ptrs.clone()
        self.sparse_mla_base_ptrs = kv_cache_manager.sparse_ptrs.clone()

    def prepare(self, state, seq_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
        self.kv_cache_manager.sliding_block_tables(self.sliding_block_tables)
        self.draft_kv_cache_manager.sliding_block_tables(self.draft_sliding_block_tables)
        super().prepare(state, seq_lens, kv_lens)

"""The TensorRT-LLM-style base family (TensorRT-LLM's ``TrtllmAttentionMetadata``), on the paged one.

Adds to :mod:`graphctl.families.paged`:

- ``kv_cache_block_offsets`` ``[P, S, 2, B]`` (per pool, sequence, K/V, block: the pool index
  of each block), swapped to ``draft_kv_cache_block_offsets``, which ``prepare()`` fills from the
  draft manager (TensorRT-LLM refreshes it there, not around replay);
- ``host_kv_cache_block_offsets``: the manager's own pinned tensor, swapped to the draft
  manager's (declared here as the twin entry ``host_draft_kv_cache_block_offsets``);
- the KV-cache manager object swap, inherited.
"""
from __future__ import annotations

import torch

from graphctl.families.paged import KVCacheManager, PagedMetadata, paged_spec
from graphctl.state import Pad, StateSpec, Swap

__all__ = ["TrtllmKVCacheManager", "TrtllmMetadata", "trtllm_spec"]


class TrtllmKVCacheManager(KVCacheManager):
    """A paged manager that also keeps TensorRT-LLM's host block offsets ``[P, S, 2, B]``."""

    def __init__(self, name: str, *, pools: int = 1, **kw) -> None:
        super().__init__(name, **kw)
        self.pools = pools
        pin = self.block_ids.device.type == "cuda"
        self.host_kv_cache_block_offsets = torch.zeros((pools,) + self.block_ids.shape[:1] + (2,)
                                                       + self.block_ids.shape[1:], dtype=torch.int32, pin_memory=pin)
        self.copy_block_offsets(self.host_kv_cache_block_offsets)

    def copy_block_offsets(self, out: torch.Tensor) -> torch.Tensor:
        """Pool indices of K (``2 * block``) and V (``2 * block + 1``) blocks, per pool."""
        ids = self.block_ids.to(out.device).long()
        for p in range(out.shape[0]):
            out[p, :, 0].copy_(ids * 2)
            out[p, :, 1].copy_(ids * 2 + 1)
        return out


def trtllm_spec(name: str = "trtllm", *, block_size: int, base: StateSpec | None = None) -> StateSpec:
    spec = StateSpec(name, extends=base or paged_spec(block_size=block_size))
    spec.buffer(
        "kv_cache_block_offsets",
        shape=("P", "S", 2, "B"),
        dtype=torch.int32,
        axis="seq",
        axis_dim=1,
        pad=Pad.clamp(0),
        readers={"target"},
        draft=Swap(twin="draft_kv_cache_block_offsets"),
    )
    spec.buffer(
        "draft_kv_cache_block_offsets",
        shape=("P", "S", 2, "B"),
        dtype=torch.int32,
        axis="seq",
        axis_dim=1,
        pad=Pad.clamp(0),
        readers={"draft"},
    )
    spec.buffer(
        "host_kv_cache_block_offsets",
        shape=("P", "S", 2, "B"),
        dtype=torch.int32,
        axis="seq",
        axis_dim=1,
        pad=Pad.clamp(0),
        host=True,
        readers={"target"},
        draft=Swap(twin="host_draft_kv_cache_block_offsets"),
    )
    spec.buffer(
        "host_draft_kv_cache_block_offsets",
        shape=("P", "S", 2, "B"),
        dtype=torch.int32,
        axis="seq",
        axis_dim=1,
        pad=Pad.clamp(0),
        host=True,
        readers={"draft"},
    )
    return spec


class TrtllmMetadata(PagedMetadata):
    kv_cache_manager: TrtllmKVCacheManager
    draft_kv_cache_manager: TrtllmKVCacheManager

    def __init__(self, *, kv_cache_manager: TrtllmKVCacheManager, draft_kv_cache_manager: TrtllmKVCacheManager,
                 **kw) -> None:
        super().__init__(kv_cache_manager=kv_cache_manager, draft_kv_cache_manager=draft_kv_cache_manager, **kw)
        dev = self.block_table.device
        shape = kv_cache_manager.host_kv_cache_block_offsets.shape
        self.kv_cache_block_offsets = torch.zeros(shape, dtype=torch.int32, device=dev)
        self.draft_kv_cache_block_offsets = torch.zeros(shape, dtype=torch.int32, device=dev)
        # the managers' own tensors, as TensorRT-LLM binds them
        self.host_kv_cache_block_offsets = kv_cache_manager.host_kv_cache_block_offsets
        self.host_draft_kv_cache_block_offsets = draft_kv_cache_manager.host_kv_cache_block_offsets

    def prepare(self, state, seq_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """Lengths as the paged family, plus both block-offset tables from their managers."""
        self.kv_cache_manager.copy_block_offsets(self.kv_cache_block_offsets)
        self.draft_kv_cache_manager.copy_block_offsets(self.draft_kv_cache_block_offsets)
        super().prepare(state, seq_lens, kv_lens)

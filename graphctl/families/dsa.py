"""The DSA family (TensorRT-LLM's DSA sparse-attention metadata), on the TensorRT-LLM base.

Adds:

- ``indexer_k_cache_block_offsets`` ``[S, B]`` and its pinned host mirror, swapped to draft twins
  that are refreshed from the draft manager before eager drafts and replays (pool indices times
  the page scale, clamped at 0, as ``_update_indexer_k_cache_block_offsets`` does);
- ``slot_mapping_fp8`` / ``slot_mapping_scale`` ``[T]`` recomputed from ``seq_lens``,
  ``kv_lens``, ``req_idx_per_token`` and the *bound* indexer offsets, so the draft's slot
  mappings follow the swapped offsets (the in-graph ``on_update_kv_lens`` dependency list);
- ``block_table_expanded`` ``[S(1+D), B]`` swapped to a draft twin that is recomputed from the
  (refreshed) draft block table;
- ``gen_kv_indptr`` and ``gen_cached_token_indptr`` ``[S+1]`` recomputed from the lengths;
- ``topk_indices_buffer`` ``[T, K]``: large scratch, ``Stable`` (never snapshotted).
"""
from __future__ import annotations

import functools

import torch

from graphctl.families.paged import cumulative_lengths_, page_and_offset
from graphctl.families.trtllm import TrtllmKVCacheManager, TrtllmMetadata, trtllm_spec
from graphctl.state import CopyInPlace, Pad, Recompute, Stable, StateSpec, Swap

__all__ = ["DSAKVCacheManager", "DSAMetadata", "dsa_spec", "INDEXER_HEAD_DIM", "expand_table_", "slot_mapping_fp8_"]

INDEXER_HEAD_DIM = 128  # bytes of one fp8 indexer key; the scale follows the keys in each page


class DSAKVCacheManager(TrtllmKVCacheManager):
    """Adds the indexer K-cache pool indices (``page_scale`` indexer pages per KV block)."""

    def __init__(self, name: str, *, page_scale: int = 2, **kw) -> None:
        super().__init__(name, **kw)
        self.page_scale = page_scale
        self._staged_indexer = torch.empty_like(self.block_ids)

    def indexer_pool_indices(self) -> torch.Tensor:
        """Pool indices times the page scale, clamped at 0, staged (a refresh source)."""
        torch.mul(self.block_ids, self.page_scale, out=self._staged_indexer)
        return self._staged_indexer.clamp_(min=0)


def expand_table_(out: torch.Tensor, table: torch.Tensor) -> None:
    """Each sequence's row repeated once per token of a (1 + D)-token request."""
    per = out.shape[0] // table.shape[0]
    out.view(table.shape[0], per, table.shape[1]).copy_(table[:, None, :])


def _gen_cached(out: torch.Tensor, kv_lens: torch.Tensor, seq_lens: torch.Tensor, s32: torch.Tensor) -> None:
    out[0].zero_()
    n = kv_lens.numel()
    torch.cumsum(torch.sub(kv_lens, seq_lens, out=s32[:n]), 0, out=out[1:])


def slot_mapping_fp8_(out, token_positions, req_idx, offsets, s64, s32, *, block_size: int, scale_part: bool) -> None:
    """Byte offset of each token's indexer key (or of its scale) through the bound offsets:
    pages of ``block_size`` keys of ``INDEXER_HEAD_DIM`` bytes, then their 4-byte scales."""
    page, offset = page_and_offset(offsets, token_positions, req_idx, block_size, s64, s32)
    out.copy_(page).mul_(block_size * (INDEXER_HEAD_DIM + 4))
    if scale_part:
        out.add_(block_size * INDEXER_HEAD_DIM).add_(offset.mul_(4))
    else:
        out.add_(offset.mul_(INDEXER_HEAD_DIM))


def dsa_spec(name: str = "dsa", *, block_size: int, base: StateSpec | None = None) -> StateSpec:
    spec = StateSpec(name, extends=base or trtllm_spec(block_size=block_size))
    src = CopyInPlace(source=lambda m: m.draft_kv_cache_manager.indexer_pool_indices())
    spec.buffer(
        "indexer_k_cache_block_offsets",
        shape=("S", "B"),
        dtype=torch.int32,
        axis="seq",
        pad=Pad.clamp(0),
        readers={"target"},
        draft=Swap(twin="draft_indexer_k_cache_block_offsets"),
    )
    spec.buffer(
        "draft_indexer_k_cache_block_offsets",
        shape=("S", "B"),
        dtype=torch.int32,
        axis="seq",
        pad=Pad.clamp(0),
        readers={"draft"},
        refresh=src,
    )
    spec.buffer(
        "host_indexer_k_cache_block_offsets",
        shape=("S", "B"),
        dtype=torch.int32,
        axis="seq",
        pad=Pad.clamp(0),
        host=True,
        readers={"target"},
        draft=Swap(twin="host_draft_indexer_k_cache_block_offsets"),
    )
    spec.buffer(
        "host_draft_indexer_k_cache_block_offsets",
        shape=("S", "B"),
        dtype=torch.int32,
        axis="seq",
        pad=Pad.clamp(0),
        host=True,
        readers={"draft"},
    )
    # positions already follow seq_lens, kv_lens and req_idx_per_token (the in-graph dependency list)
    inputs = ("token_positions", "req_idx_per_token", "indexer_k_cache_block_offsets", "scratch_i64", "scratch_i32")
    for part, scale in (("fp8", False), ("scale", True)):
        spec.buffer(f"slot_mapping_{part}", shape=("T",), dtype=torch.int64, derive=Recompute(
            inputs, functools.partial(slot_mapping_fp8_, block_size=block_size, scale_part=scale)))
    spec.buffer("block_table_expanded", shape=("TE", "B"), dtype=torch.int32, axis="token", pad=Pad.clamp(0),
                readers={"target"},
                draft=Swap(twin="draft_block_table_expanded"))
    spec.buffer("draft_block_table_expanded", shape=("TE", "B"), dtype=torch.int32, readers={"draft"},
                derive=Recompute(("draft_block_table",), expand_table_))
    spec.buffer("gen_kv_indptr", shape=("S1",), dtype=torch.int64, derive=Recompute(("kv_lens",), cumulative_lengths_))
    spec.buffer("gen_cached_token_indptr", shape=("S1",), dtype=torch.int64,
                derive=Recompute(("kv_lens", "seq_lens", "scratch_i32"), _gen_cached))
    spec.buffer("topk_indices_buffer", shape=("T", "K"), dtype=torch.int32, draft=Stable())
    return spec


class DSAMetadata(TrtllmMetadata):
    kv_cache_manager: DSAKVCacheManager
    draft_kv_cache_manager: DSAKVCacheManager

    def __init__(self, *, kv_cache_manager: DSAKVCacheManager, draft_kv_cache_manager: DSAKVCacheManager,
                 topk: int = 64, **kw) -> None:
        super().__init__(kv_cache_manager=kv_cache_manager, draft_kv_cache_manager=draft_kv_cache_manager, **kw)
        S, B = self.block_table.shape
        T, dev = self.max_tokens, self.block_table.device
        pin = dev.type == "cuda"
        self.indexer_k_cache_block_offsets = torch.zeros(S, B, dtype=torch.int32, device=dev)
        self.draft_indexer_k_cache_block_offsets = torch.zeros(S, B, dtype=torch.int32, device=dev)
        self.host_indexer_k_cache_block_offsets = torch.zeros(S, B, dtype=torch.int32, pin_memory=pin)
        self.host_draft_indexer_k_cache_block_offsets = torch.zeros(S, B, dtype=torch.int32, pin_memory=pin)
        self.slot_mapping_fp8 = torch.zeros(T, dtype=torch.int64, device=dev)
        self.slot_mapping_scale = torch.zeros(T, dtype=torch.int64, device=dev)
        self.block_table_expanded = torch.zeros(T, B, dtype=torch.int32, device=dev)
        self.draft_block_table_expanded = torch.zeros(T, B, dtype=torch.int32, device=dev)
        expand_table_(self.draft_block_table_expanded, self.draft_block_table)  # derived: consistent from the start
        self.gen_kv_indptr = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.gen_cached_token_indptr = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.topk_indices_buffer = torch.zeros(T, topk, dtype=torch.int32, device=dev)

    def prepare(self, state, seq_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """TensorRT-LLM's prepare plus the indexer offsets (target's from its manager, the
        draft's from the draft manager) and the expanded target table."""
        state.write("indexer_k_cache_block_offsets", self.kv_cache_manager.indexer_pool_indices())  # maps follow
        self.host_indexer_k_cache_block_offsets.copy_(self.indexer_k_cache_block_offsets)
        self.draft_indexer_k_cache_block_offsets.copy_(self.draft_kv_cache_manager.indexer_pool_indices())
        self.host_draft_indexer_k_cache_block_offsets.copy_(self.draft_indexer_k_cache_block_offsets)
        expand_table_(self.block_table_expanded, self.block_table)
        super().prepare(state, seq_lens, kv_lens)

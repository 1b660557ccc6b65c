"""Declarations for attention-metadata families, each a spec and a reference metadata class,
declared as data in :data:`FAMILIES`.

What they model, and what they leave out. Each family declares the graph-static buffers of
TensorRT-LLM's draft switch that carry the bug classes graphctl exists for (the tables of
TensorRT-LLM's attention metadata): the swapped KV manager and block tables/offsets, the
mutable lengths and their runtime view, the derived token map, positions, slot mappings and
indptrs, pinned host mirrors, and ``Stable`` top-k scratch. Every buffer with a batch
(``seq``) or token axis has a padding policy: lengths pad with zero (padded requests are empty),
block tables and offsets clamp into the pool. They leave out what no kernel of theirs reads:
FlashMLA block ids and tile-scheduler metadata, the MLA cumulative-row buffers, the DSA
paged-MQA scheduler buffers, ``kv_lens_cuda_2d``, expanded KV lengths, the ``_fullkv``
slot-mapping aliases, the heuristic/radix feedback scratch, DSv4's compressed-attention
buffers, host scalars frozen at capture, and spec-decoding masks and offsets. Their managers
are synthetic (pool indices drawn at random); the reference engine in ``graphctl.models`` is
the only forward that reads them.

- ``paged``: block tables, lengths (mutable, runtime view), cumulative lengths, token map,
  positions, slot mapping, pinned mirrors, the KV manager swap.
- ``trtllm`` (extends paged): ``kv_cache_block_offsets [P,S,2,B]`` and the host offsets, swapped
  to the draft's.
- ``dsa`` (extends trtllm): indexer offsets refreshed from the draft manager (clamped), fp8/scale
  slot mappings from the bound offsets, expanded block tables, generation indptrs, ``Stable``
  top-k scratch.
- ``deepseek_v4`` (extends dsa): sliding block tables swapped; SWA and sparse-MLA base pointers
  as device tables written in place.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from graphctl.families.deepseek_v4 import DeepseekV4Metadata, DSv4KVCacheManager, deepseek_v4_spec
from graphctl.families.deepseek_v4 import not_supported_reasons as _dsv4_reasons
from graphctl.families.dsa import DSAKVCacheManager, DSAMetadata, dsa_spec
from graphctl.families.paged import PAGED_SPEC, KVCacheManager, PagedMetadata, paged_spec
from graphctl.families.trtllm import TrtllmKVCacheManager, TrtllmMetadata, trtllm_spec
from graphctl.state import BoundState, Registry, StateSpec, bind

__all__ = ["FAMILIES", "FamilyDecl", "KVCacheManager", "PAGED_SPEC", "PagedMetadata", "TrtllmMetadata",
           "DSAMetadata", "DeepseekV4Metadata", "paged_spec", "trtllm_spec", "dsa_spec", "deepseek_v4_spec",
           "make_family", "not_supported_reasons"]


@dataclasses.dataclass(frozen=True, slots=True)
class FamilyDecl:
    name: str
    spec: Callable[..., StateSpec]  # spec(block_size=...)
    metadata: type
    manager: type
    reasons: Callable[..., list[str]]  # reasons(**config) -> why a configuration is unsupported
    doc: str


def _none(**config: Any) -> list[str]:
    return []


FAMILIES: dict[str, FamilyDecl] = {b.name: b for b in (
    FamilyDecl("paged", paged_spec, PagedMetadata, KVCacheManager, _none, "paged KV: block tables and lengths"),
    FamilyDecl("trtllm", trtllm_spec, TrtllmMetadata, TrtllmKVCacheManager, _none,
                "TensorRT-LLM base: per-pool block offsets and the manager swap"),
    FamilyDecl("dsa", dsa_spec, DSAMetadata, DSAKVCacheManager, _none,
                "DSA: indexer offsets, fp8 slot mappings, expanded tables, top-k scratch"),
    FamilyDecl("deepseek_v4", deepseek_v4_spec, DeepseekV4Metadata, DSv4KVCacheManager, _dsv4_reasons,
                "DeepSeek-V4: sliding tables and device pointer tables"),
)}


def not_supported_reasons(name: str, **config: Any) -> list[str]:
    """Why family ``name`` cannot run ``config`` (empty when it can)."""
    return FAMILIES[name].reasons(**config)


def make_family(name: str, *, seqs: int, blocks: int, draft_len: int, block_size: int = 8, head_dim: int = 16,
                 layers: int = 1, device="cpu", seed: int = 0, **config: Any) -> tuple[Any, BoundState]:
    """A metadata object of family ``name`` with its target and draft managers, bound to its
    spec in a registry of its own. Raises ``ValueError`` with the reasons for an unsupported
    configuration."""
    b = FAMILIES[name]
    reasons = b.reasons(**config)
    if reasons:
        raise ValueError(f"family {name} does not support this configuration: {'; '.join(reasons)}")
    mk = lambda tag, s: b.manager(tag, layers=layers, seqs=seqs, blocks=blocks, block_size=block_size,  # noqa: E731
                                  head_dim=head_dim, dtype=torch.float32, device=device, seed=s)
    meta = b.metadata(seqs=seqs, blocks=blocks, draft_len=draft_len, kv_cache_manager=mk("target", seed + 1),
                      draft_kv_cache_manager=mk("draft", seed + 2), device=device)
    reg = Registry()
    reg.register(b.metadata, b.spec(block_size=block_size))
    return meta, bind(meta, registry=reg)

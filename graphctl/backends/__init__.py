"""Declarations for attention-metadata families, each a spec and a reference metadata class
that owns the same buffer set as the real engine."""
from graphctl.backends.paged import PAGED_SPEC, KVCacheManager, PagedMetadata, paged_spec

__all__ = ["KVCacheManager", "PAGED_SPEC", "PagedMetadata", "paged_spec"]

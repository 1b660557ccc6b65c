"""Hugging Face transformers models on graphctl's paged KV cache, with speculative decoding
(``docs/transformers.md``). Importing this package does not import transformers; building an
engine does."""
from graphctl.integrations.hf.attention import ATTENTION, PagedBatch, paged_attention, register
from graphctl.integrations.hf.engine import GenerateResult, HFEngine, oracle_draft

__all__ = ["ATTENTION", "PagedBatch", "paged_attention", "register", "HFEngine", "GenerateResult", "oracle_draft"]

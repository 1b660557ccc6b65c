"""Paged attention for unchanged Hugging Face models: one function registered in transformers'
attention registry (``AttentionInterface``) under :data:`ATTENTION`.

A model built with ``attn_implementation="graphctl_paged"`` calls :func:`paged_attention` in every
layer with the layer's query, key and value states (RoPE applied) and the keyword arguments of
the model call; graphctl passes one, ``graphctl_batch``: a :class:`PagedBatch` built once per
forward from the ``paged`` family's metadata. The function writes the step's K/V into the bound
KV-cache manager's pools through ``slot_mapping`` (``PAD_SLOT`` lanes write nothing live) and
attends each token over its own request's pages (``block_table``) up to its position
(``token_positions``): per-request lengths, so ragged batches and per-request acceptance work.

Why not a ``transformers.Cache``: a cache's ``update`` must hand back the layer's whole K/V as
dense tensors, so a paged cache would gather every page there and attend in a second place;
writing and attending in the attention function keeps both on the declared metadata (as vLLM's
transformers backend does). The model runs with ``use_cache=False``; no mask is built (a custom
implementation without a mask function makes transformers skip mask creation, and the
positions decide causality here).

Math: the step's queries are scattered into ``[rows, q, heads, head_dim]`` (rows = requests in
the forward, q = tokens a request at most), each request's pages gathered into
``[rows, kv_heads, context, head_dim]``, and ``scaled_dot_product_attention`` runs with a boolean
mask ``key position <= query position`` and grouped-query heads. Everything is tensor code with
shapes fixed by (rows, q): capturable, no host sync.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphctl.families.paged import KVCacheManager, PagedMetadata

__all__ = ["ATTENTION", "PagedBatch", "paged_attention", "register"]

ATTENTION = "graphctl_paged"


@dataclasses.dataclass(frozen=True, eq=False)
class PagedBatch:
    """What every layer of one forward reads, computed once per forward (:meth:`build`)."""

    manager: KVCacheManager  # the bound manager: the draft's inside a draft switch
    slots: torch.Tensor  # [T] int64 slot of each token (PAD_SLOT for none)
    index: torch.Tensor  # [T] int64 row * q + offset of each token; rows * q for a token of no request
    key_slots: torch.Tensor  # [rows, C] int64 cache slot of each key position of each request
    mask: torch.Tensor  # [rows, 1, q, C] bool: key position <= query position
    rows: int
    q: int

    @staticmethod
    def build(meta: PagedMetadata, tokens: int, q: int, rows: int) -> PagedBatch:
        """The batch of ``tokens`` tokens laid out by ``meta`` now, ``q`` tokens a request at most,
        ``rows`` request rows (a bucket's padded rows included)."""
        mgr: KVCacheManager = meta.kv_cache_manager
        bs = mgr.block_size
        req = meta.req_idx_per_token[:tokens].long()
        live = req < rows
        r = req.clamp(max=rows - 1)
        offset = meta.token_index[:tokens] - meta.cu_seq_lens[r]  # token_index: the family's constant 0..T-1
        index = torch.where(live, r * q + offset.clamp(0, q - 1), rows * q)
        pos = meta.token_positions[:tokens].clamp(min=0)  # a padded request's -1: key 0 stays visible
        qpos = torch.zeros(rows * q + 1, dtype=pos.dtype, device=pos.device).index_copy_(0, index, pos)
        table = meta.block_table[:rows].long()
        j = torch.arange(table.shape[1] * bs, device=table.device)
        key_slots = table[:, j // bs] * bs + j % bs
        mask = (j[None, None, :] <= qpos[:-1].view(rows, q)[:, :, None])[:, None]
        return PagedBatch(mgr, meta.slot_mapping[:tokens], index, key_slots, mask, rows, q)


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    graphctl_batch: PagedBatch | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``query`` [1, heads, T, d], ``key``/``value``
    [1, kv_heads, T, d] (one packed sequence of T tokens); returns [1, T, heads, d]."""
    b = graphctl_batch
    if b is None:
        raise RuntimeError("graphctl_paged attention needs graphctl_batch=PagedBatch(...) in the model call; "
                           "run the model through graphctl.integrations.hf.HFEngine")
    H, T, d = query.shape[1:]
    kvh = key.shape[1]
    layer = module.layer_idx
    k_tok = key[0].transpose(0, 1).reshape(T, kvh * d)
    v_tok = value[0].transpose(0, 1).reshape(T, kvh * d)
    b.manager.write(layer, b.slots, k_tok, v_tok)
    kc = b.manager.k[layer].view(-1, kvh * d)[b.key_slots].view(b.rows, -1, kvh, d).transpose(1, 2)
    vc = b.manager.v[layer].view(-1, kvh * d)[b.key_slots].view(b.rows, -1, kvh, d).transpose(1, 2)
    q = query[0].transpose(0, 1)  # [T, H, d]
    qr = torch.zeros(b.rows * b.q + 1, H, d, dtype=q.dtype, device=q.device).index_copy_(0, b.index, q)
    qr = qr[:-1].view(b.rows, b.q, H, d).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(qr, kc, vc, attn_mask=b.mask, scale=scaling,
                                                           enable_gqa=H != kvh)
    flat = torch.cat([out.transpose(1, 2).reshape(b.rows * b.q, H, d), out.new_zeros(1, H, d)])
    return flat.index_select(0, b.index)[None], None


def register() -> None:
    """Register :func:`paged_attention` in transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)

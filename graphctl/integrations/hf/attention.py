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

Math: ``torch.ops.graphctl.paged_attention`` (``graphctl/ops/attention.py``): each token attends
its request's keys ``0 .. position`` through ``block_table``, grouped-query heads, pages read in
place by a Triton kernel on CUDA (the pure-PyTorch reference, which gathers the pages and runs
under a mask, elsewhere and under ``GRAPHCTL_PAGED_ATTENTION=reference``). Shapes are fixed by
the token count: capturable, no host sync, and a compiled model traces the op whole. Run eagerly
with nothing watching the ops (``ops.attention.direct``: an uncompiled model's prefill, or its
steps outside a graph), a layer's write and attention are two Triton launches, called directly:
the eager path is host-bound, and the ops cost a dozen PyTorch calls and the dispatcher a layer.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphctl.families.paged import KVCacheManager, PagedMetadata
from graphctl.graphs.capture.pieces import eager
from graphctl.ops import attention as ops  # registers torch.ops.graphctl.paged_attention

__all__ = ["ATTENTION", "PagedBatch", "paged_attention", "register"]

ATTENTION = "graphctl_paged"


@dataclasses.dataclass(frozen=True, eq=False)
class PagedBatch:
    """What every layer of one forward reads, taken once per forward (:meth:`build`): views of
    the declared metadata, so a captured forward reads what each step wrote there."""

    manager: KVCacheManager  # the bound manager: the draft's inside a draft switch
    slots: torch.Tensor  # [T] int64 slot of each token (PAD_SLOT for none)
    table: torch.Tensor  # [rows, B] int32 each request row's pages
    req: torch.Tensor  # [T] int32 each token's row; rows or more for a token of no request
    positions: torch.Tensor  # [T] int64 each token's position: it attends its row's keys 0..position
    rows: int
    q: int
    # KVCacheManager.lanes(slots), made once a forward; None: each layer's write makes its own (a compiled
    # model fuses them into the write, where lanes made outside it would be two launches more)
    lanes: tuple[torch.Tensor, torch.Tensor] | None
    eager: bool = False  # attention as an @graphctl.eager region: a graphed forward is captured in pieces
    direct: bool = False  # the write and attention kernels launched directly (ops.attention.direct)

    @staticmethod
    def build(meta: PagedMetadata, tokens: int, q: int, rows: int, eager: bool = False,
              lanes: bool = True) -> PagedBatch:
        """The batch of ``tokens`` tokens laid out by ``meta`` now, ``q`` tokens a request at most,
        ``rows`` request rows (a bucket's padded rows included); ``lanes``: the write lanes made
        here, once (uncompiled models), or by each layer (compiled ones); an uncompiled model run
        with nothing watching its ops (``ops.attention.direct``) needs none: its kernels write."""
        mgr, slots = meta.kv_cache_manager, meta.slot_mapping[:tokens]
        direct = lanes and not eager and ops.direct(slots)  # decided once: it holds for every layer
        return PagedBatch(mgr, slots, meta.block_table[:rows], meta.req_idx_per_token[:tokens],
                          meta.token_positions[:tokens], rows, q,
                          mgr.lanes(slots) if lanes and not direct else None, eager, direct)


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
    scale = scaling if scaling is not None else d ** -0.5
    if b.direct:  # [T, heads, d] views: the kernels read the strides, nothing is copied
        k_cache, v_cache = b.manager.k[layer], b.manager.v[layer]
        ops.write_kv(k_cache, v_cache, b.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
        out = ops.attend(query[0].transpose(0, 1), k_cache, v_cache, b.table, b.req, b.positions, scale)
        return out[None], None
    k_tok = key[0].transpose(0, 1).reshape(T, kvh * d)
    v_tok = value[0].transpose(0, 1).reshape(T, kvh * d)
    b.manager.write(layer, b.slots, k_tok, v_tok, b.lanes)  # first: the step's own keys are attended at their positions
    out = (_attend_eager if b.eager else _attend)(query[0].transpose(0, 1), b.manager.k[layer], b.manager.v[layer],
                                                  b.table, b.req, b.positions, scale)
    return out[None], None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, req: torch.Tensor,
            positions: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.ops.graphctl.paged_attention(q, k, v, table, req, positions, scale)


# the same call as a region between captured pieces (graphs/capture/pieces.py); every tensor it reads is an
# argument (the draft's manager and tables under a draft switch), so it may sit inside one
_attend_eager = eager(in_switch=True)(_attend)


def register() -> None:
    """Register :func:`paged_attention` in transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention)

"""The paged-KV family: block tables, sequence and KV lengths, the maps derived from them.

:class:`PagedMetadata` owns the buffer set a paged attention kernel reads by address (sized
at the maximum: ``S`` sequences, ``B`` blocks a sequence, ``T = S * (1 + D)`` tokens) and a
``prepare()`` that fills it for a batch; :data:`PAGED_SPEC` declares what the draft role does
to each buffer:

- ``block_table`` is swapped to ``draft_block_table``, which is refreshed from the draft
  KV-cache manager (clamped into the pool, TensorRT-LLM #13124) before eager drafts and replays;
- the ``kv_cache_manager`` object is swapped to the draft manager, so kernels recorded in the
  draft segment bake the draft caches' addresses;
- ``seq_lens`` and ``kv_lens`` are ``mutable`` (the draft loop writes them); ``kv_lens_runtime``
  is their declared runtime view;
- ``cu_seq_lens``, ``cu_kv_lens``, ``req_idx_per_token``, ``token_positions`` and
  ``slot_mapping`` are recomputed on the device whenever an input is written or swapped, so
  a layout change from ``1 + D`` tokens a request to 1 can never leave them stale (#16925);
  ``slot_mapping`` is :data:`PAD_SLOT` (-1) for the tokens of padded requests, which a cache
  write must skip (:meth:`KVCacheManager.write` does);
- pinned host mirrors of the lengths are mutable host buffers;
- each request's sampling settings (``temperature``, ``top_k``, ``top_p``) and ``seed`` are plain
  buffers along the request axis, written by :meth:`PagedMetadata.set_sampling` (a padded row is
  greedy: temperature 0), so one captured step serves greedy, sampled and mixed batches.
"""
from __future__ import annotations

import functools

import torch

from graphctl import ops
from graphctl.state import CopyInPlace, OpCall, Pad, Persistent, Recompute, Stable, StateSpec, Swap

__all__ = [
    "KVCacheManager",
    "PagedMetadata",
    "PAGED_SPEC",
    "SCRATCH",
    "paged_spec",
    "cumulative_lengths_",
    "token_map_",
    "positions_",
    "page_and_offset",
    "slot_mapping_",
    "PAD_SLOT",
]

# Stable scratch of the derived maps (never snapshotted; contents meaningless between calls
# except token_index, the constant 0..T-1)
SCRATCH = (("token_index", ("T",), torch.int64), ("scratch_i64", (3, "T"), torch.int64),
           ("scratch_i32", ("T",), torch.int32))


class KVCacheManager:
    """A paged KV cache: per layer ``k``/``v`` of ``[num_blocks, block_size, head_dim]``, and
    the block ids each sequence slot owns (a fixed, shuffled allocation: tables are not the
    identity, so a wrong table reads wrong memory)."""

    def __init__(self, name: str, *, layers: int, seqs: int, blocks: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device, seed: int) -> None:
        self.name, self.block_size = name, block_size
        self.num_blocks = seqs * blocks
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(self.num_blocks, generator=g).to(torch.int32)
        self.block_ids = perm.view(seqs, blocks).to(device)
        # one block past the pool: where writes of PAD_SLOT lanes go (no table points there)
        shape = (self.num_blocks + 1, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._staged = torch.empty_like(self.block_ids)

    def lanes(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(at, live)`` of a forward's ``slots``: where each token writes (the spare slot for a
        :data:`PAD_SLOT` lane) and which lanes are live; one pair for every layer's :meth:`write`."""
        live = slots >= 0
        return torch.where(live, slots, self.num_blocks * self.block_size), live

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              lanes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Write one layer's K/V of each token at its slot; a :data:`PAD_SLOT` token writes the
        spare slot's own value back into it: a padded lane changes no byte of any cache (no
        other sequence's blocks, no spare block) and never collides with a live lane. The live
        lanes' values are the forward's; computed at the bucket's row count they may differ in
        the last bits from an eager run of the live rows alone (matmul rounding depends on the
        row count on some CPUs). ``lanes``: :meth:`lanes` of ``slots``, made once a forward (two
        launches a layer fewer)."""
        spare = self.num_blocks * self.block_size
        at, live = lanes if lanes is not None else self.lanes(slots)
        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            flat = cache.view(-1, x.shape[-1])
            flat.index_copy_(0, at, torch.where(live[:, None], x, flat[spare]))

    def pool_block_ids(self) -> torch.Tensor:
        """The block ids clamped into the pool, staged in a preallocated tensor (a refresh
        source: an index past the pool would read or write another pool's memory, #13124)."""
        return torch.clamp(self.block_ids, 0, self.num_blocks - 1, out=self._staged)


def cumulative_lengths_(out: torch.Tensor, lens: torch.Tensor) -> None:
    out[0].zero_()
    torch.cumsum(lens, 0, out=out[1:])


def token_map_(out: torch.Tensor, seq_lens: torch.Tensor) -> None:
    # tokens past the batch map to len(seq_lens); readers clamp them onto a dead slot
    ops.token_to_request_(out, seq_lens, out.numel(), seq_lens.numel())


# The derived maps below run inside switches, which allocate nothing (DESIGN invariant 4): every
# temporary lives in the Stable scratch entries ``token_index`` (0..T-1), ``scratch_i64`` [3, T]
# and ``scratch_i32`` [T], passed in as inputs.

def positions_(out, seq_lens, kv_lens, req_idx, cu_seq_lens, token_index, s64, s32) -> None:
    """Position of each token: its request's cached length plus its offset in the request."""
    r = s64[0].copy_(req_idx).clamp_(max=seq_lens.numel() - 1)
    out.copy_(torch.index_select(kv_lens, 0, r, out=s32))
    out.sub_(torch.index_select(seq_lens, 0, r, out=s32))
    out.add_(token_index)
    out.sub_(torch.index_select(cu_seq_lens, 0, r, out=s64[1]))


def page_and_offset(block_table, token_positions, req_idx, block_size, s64, s32):
    """(page of each token through ``block_table``, its offset in the page): s32 and s64[1]."""
    S, B = block_table.shape
    r = s64[0].copy_(req_idx).clamp_(max=S - 1)
    pos = torch.clamp(token_positions, 0, B * block_size - 1, out=s64[1])
    flat = torch.floor_divide(pos, block_size, out=s64[2]).add_(r.mul_(B))
    page = torch.index_select(block_table.view(-1), 0, flat, out=s32)
    return page, pos.remainder_(block_size)


#: ``slot_mapping`` of a token that belongs to no live request: a cache write must skip it
PAD_SLOT = -1


def slot_mapping_(out, block_table, token_positions, req_idx, kv_lens, s64, s32, *, block_size: int) -> None:
    """KV slot of each token through the bound block table; :data:`PAD_SLOT` for a token of no
    live request (past the batch, or of a padded request, whose ``kv_lens`` is 0). A padded
    lane's slot computed like a live one's is a valid slot of some other sequence, and a cache
    write through it corrupts that sequence's K/V (SGLang #25529, xLLM #1939)."""
    S = kv_lens.numel()
    page, offset = page_and_offset(block_table, token_positions, req_idx, block_size, s64, s32)
    out.copy_(page).mul_(block_size).add_(offset)
    # alive = (req_idx < S) * (kv_lens[req] > 0), in the scratch rows (a switch allocates nothing)
    r = s64[0].copy_(req_idx).clamp_(max=S - 1)
    alive = s64[2].copy_(torch.index_select(kv_lens, 0, r, out=s32)).clamp_(0, 1)
    alive.mul_(s64[1].copy_(req_idx).neg_().add_(S).clamp_(0, 1))
    out.sub_(PAD_SLOT).mul_(alive).add_(PAD_SLOT)  # live: the slot; dead: PAD_SLOT


def paged_spec(name: str = "paged", *, block_size: int) -> StateSpec:
    """The paged spec for a block size (``slot_mapping``'s recompute bakes it in)."""
    spec = StateSpec(name)
    spec.object("kv_cache_manager", draft=Swap(twin="draft_kv_cache_manager"))
    spec.object("draft_kv_cache_manager")
    # the KV pools: the forward's own lasting writes, graphctl's to guard around warmups and capture
    for mgr in ("kv_cache_manager", "draft_kv_cache_manager"):
        for pool in ("k", "v"):
            spec.buffer(f"{mgr}.{pool}[*]", draft=Persistent())
    spec.buffer("draft_kv_cache_manager._staged", draft=Stable())  # the refresh source's staging: scratch
    spec.buffer("block_table", shape=("S", "B"), dtype=torch.int32, axis="seq", pad=Pad.clamp(0),
                readers={"target"}, draft=Swap(twin="draft_block_table"))
    spec.buffer(
        "draft_block_table",
        shape=("S", "B"),
        dtype=torch.int32,
        axis="seq",
        pad=Pad.clamp(0),
        readers={"draft"},
        refresh=CopyInPlace(source=lambda m: m.draft_kv_cache_manager.pool_block_ids()),
    )
    spec.buffer("seq_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True)
    spec.buffer("kv_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True,
                aliases=("kv_lens_runtime",))
    # per-request sampling (models/sampled.py): padded rows greedy, their draws never used
    spec.buffer("temperature", shape=("S",), dtype=torch.float32, axis="seq", pad=Pad.zero())
    spec.buffer("top_k", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero())
    spec.buffer("top_p", shape=("S",), dtype=torch.float32, axis="seq", pad=Pad.fill(1.0))
    spec.buffer("seed", shape=("S",), dtype=torch.int64, axis="seq", pad=Pad.zero())
    spec.buffer("host_seq_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), host=True, mutable=True)
    spec.buffer("host_kv_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), host=True, mutable=True)
    spec.buffer("cu_seq_lens", shape=("S1",), dtype=torch.int64, derive=Recompute(("seq_lens",), cumulative_lengths_))
    spec.buffer("cu_kv_lens", shape=("S1",), dtype=torch.int64, derive=Recompute(("kv_lens",), cumulative_lengths_))
    # token_map_ as one op call: the native switch launches it from C++ (tokens past the batch -> len(seq_lens))
    spec.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32, derive=Recompute(
        ("seq_lens",), OpCall("token_to_request_", ("out", "in0", "out.numel", "in0.numel"))))
    for name, shape, dtype in SCRATCH:
        spec.buffer(name, shape=shape, dtype=dtype, draft=Stable())
    spec.buffer("token_positions", shape=("T",), dtype=torch.int64, derive=Recompute(
        ("seq_lens", "kv_lens", "req_idx_per_token", "cu_seq_lens", "token_index", "scratch_i64", "scratch_i32"),
        positions_))
    spec.buffer("slot_mapping", shape=("T",), dtype=torch.int64, derive=Recompute(
        ("block_table", "token_positions", "req_idx_per_token", "kv_lens", "scratch_i64", "scratch_i32"),
        functools.partial(slot_mapping_, block_size=block_size)))
    return spec


PAGED_SPEC = paged_spec(block_size=8)


class PagedMetadata:
    """The paged buffer set for ``seqs`` sequences of up to ``blocks`` blocks, ``1 + draft_len``
    tokens a request in a step; ``kv_cache_manager``/``draft_kv_cache_manager`` own the caches.
    ``max_tokens``: the token buffers' length, when a forward may carry more tokens than a step
    does (a ragged prefill of whole prompts); at least ``seqs * (1 + draft_len)``."""

    def __init__(self, *, seqs: int, blocks: int, draft_len: int, kv_cache_manager: KVCacheManager,
                 draft_kv_cache_manager: KVCacheManager, device, max_tokens: int = 0) -> None:
        S, T = seqs, max(seqs * (1 + draft_len), max_tokens)
        dev = torch.device(device)
        pin = dev.type == "cuda"
        self.max_tokens = T
        self.kv_cache_manager, self.draft_kv_cache_manager = kv_cache_manager, draft_kv_cache_manager
        self.block_table = kv_cache_manager.block_ids.clone()
        self.draft_block_table = draft_kv_cache_manager.block_ids.clone()
        self.seq_lens = torch.zeros(S, dtype=torch.int32, device=dev)
        self.kv_lens = torch.zeros(S, dtype=torch.int32, device=dev)
        self.kv_lens_runtime = self.kv_lens[:S]
        self.temperature = torch.zeros(S, dtype=torch.float32, device=dev)  # greedy until set_sampling
        self.top_k = torch.zeros(S, dtype=torch.int32, device=dev)
        self.top_p = torch.ones(S, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(S, dtype=torch.int64, device=dev)
        self.host_seq_lens = torch.zeros(S, dtype=torch.int32, pin_memory=pin)
        self.host_kv_lens = torch.zeros(S, dtype=torch.int32, pin_memory=pin)
        self.cu_seq_lens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.cu_kv_lens = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self.req_idx_per_token = torch.zeros(T, dtype=torch.int32, device=dev)
        self.token_positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(T, dtype=torch.int64, device=dev)
        self.token_index = torch.arange(T, dtype=torch.int64, device=dev)
        self.scratch_i64 = torch.zeros(3, T, dtype=torch.int64, device=dev)
        self.scratch_i32 = torch.zeros(T, dtype=torch.int32, device=dev)

    def prepare(self, state, seq_lens: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """Fill the buffers for a batch of ``len(seq_lens)`` requests (host code before a
        forward): lengths and their host mirrors written through ``state`` (derived maps follow),
        tails padded by policy."""
        n = seq_lens.numel()
        # lengths kept on the device reach the (pinned) host mirrors asynchronously: no sync a step
        self.host_seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.host_kv_lens[:n].copy_(kv_lens, non_blocking=True)
        state.write_many({"seq_lens": seq_lens.to(self.seq_lens.device, torch.int32),  # maps recomputed once
                          "kv_lens": kv_lens.to(self.kv_lens.device, torch.int32)})

    def set_sampling(self, state, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     seed: torch.Tensor) -> None:
        """Each of the first ``n`` requests' sampling settings and seed (``[n]`` each, checked by the
        caller: ``graphctl.models.sampled.request_settings``), the rest padded greedy, through
        ``state`` in one write (a captured step reads them by address)."""
        dev = self.temperature.device
        state.write_many({"temperature": temperature.to(dev, torch.float32), "top_k": top_k.to(dev, torch.int32),
                          "top_p": top_p.to(dev, torch.float32), "seed": seed.to(dev, torch.int64)})

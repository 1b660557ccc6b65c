"""A small DSA-flavoured metadata family used across the unit and regression tests: every
kind of declaration (swap of tensors and objects, draft copy, replay refresh, recompute,
mutable with aliases, host mirror, Stable scratch) on buffers shaped like the real ones."""
from __future__ import annotations

import torch

from graphctl import CopyInPlace, Pad, Recompute, Registry, Stable, StateSpec, Swap, ops


class KVManager:
    """Stands in for a KV-cache manager: owns pool indices for S sequences x B blocks."""

    def __init__(self, name: str, S: int, B: int, gen: torch.Generator, device="cpu") -> None:
        self.name = name
        self.pool_indices = torch.randint(0, 1000, (S, B), generator=gen, dtype=torch.int32).to(device)


def token_map(out: torch.Tensor, seq_lens: torch.Tensor) -> None:
    ops.token_to_request_(out, seq_lens, out.numel(), -1)


def slots(out: torch.Tensor, offsets: torch.Tensor, kv_lens: torch.Tensor) -> None:
    # slot of each sequence's next token: its first block offset * 64 + kv_len (in place).
    out.copy_(offsets[:, 0]).mul_(64).add_(kv_lens)


def make_spec(name: str = "mini") -> StateSpec:
    spec = StateSpec(name)
    spec.object("kv_cache_manager", draft=Swap(twin="draft_kv_cache_manager"))
    spec.object("draft_kv_cache_manager")
    spec.buffer("seq_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True)
    spec.buffer("kv_lens", shape=("S",), dtype=torch.int32, axis="seq", pad=Pad.zero(), mutable=True,
                aliases=("kv_lens_runtime",))
    spec.buffer("block_offsets", shape=("S", "B"), dtype=torch.int32, axis="seq", pad=Pad.clamp(0),
                readers={"target"}, draft=Swap(twin="draft_block_offsets"))
    spec.buffer("draft_block_offsets", shape=("S", "B"), dtype=torch.int32, readers={"draft"},
                refresh=CopyInPlace(source=lambda m: m.draft_kv_cache_manager.pool_indices))
    spec.buffer("spec_positions", shape=("S",), dtype=torch.int64, draft=CopyInPlace(source="draft_positions"))
    spec.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32,
                derive=Recompute(inputs=["seq_lens"], fn=token_map))
    spec.buffer("slot_mapping", shape=("S",), dtype=torch.int64,
                derive=Recompute(inputs=["block_offsets", "kv_lens"], fn=slots))
    spec.buffer("host_seq_lens", shape=("S",), dtype=torch.int32, host=True, mutable=True)
    spec.buffer("topk_scratch", shape=("T", 8), dtype=torch.int32, draft=Stable())
    return spec


class MiniMetadata:
    def __init__(self, gen: torch.Generator, S: int = 5, B: int = 3, k: int = 2, device="cpu") -> None:
        T = S * (k + 1)
        pin = torch.device(device).type == "cuda"
        r = lambda *shape, hi=50: torch.randint(1, hi, shape, generator=gen, dtype=torch.int32).to(device)  # noqa: E731
        self.kv_cache_manager = KVManager("target", S, B, gen, device)
        self.draft_kv_cache_manager = KVManager("draft", S, B, gen, device)
        self.seq_lens = torch.full((S,), k + 1, dtype=torch.int32, device=device)
        self.kv_lens = r(S, hi=900)
        self.kv_lens_runtime = self.kv_lens[: S - 1]
        self.block_offsets = r(S, B, hi=1000)
        self.draft_block_offsets = r(S, B, hi=1000)
        self.spec_positions = r(S).to(torch.int64)
        self.draft_positions = r(S).to(torch.int64)
        self.req_idx_per_token = torch.empty(T, dtype=torch.int32, device=device)
        self.slot_mapping = torch.empty(S, dtype=torch.int64, device=device)
        self.host_seq_lens = torch.full((S,), k + 1, dtype=torch.int32).pin_memory() if pin else \
            torch.full((S,), k + 1, dtype=torch.int32)
        self.topk_scratch = r(T, 8)
        token_map(self.req_idx_per_token, self.seq_lens)
        slots(self.slot_mapping, self.block_offsets, self.kv_lens)


def make_registry(cls=MiniMetadata, spec: StateSpec | None = None) -> Registry:
    reg = Registry()
    reg.register(cls, spec or make_spec())
    return reg

"""Shared by the engine tests on the CPU (tests/engine) and on the H200 (tests/cuda): run the
reference MTP engine eagerly or graphed, and measure acceptance."""
from __future__ import annotations

import torch

import graphctl
from graphctl import StaticInput
from graphctl.models import EngineConfig, MTPEngine

STEPS = 4


def acceptance(history) -> float:
    """Mean accepted length over every request of every step after the first (whose drafts
    are placeholders, not the draft head's)."""
    return torch.cat(history[1:]).double().mean().item()


def run(k: int, bs: int, graph: bool, seed: int, device="cpu", backend="emulated", buckets=(1, 4, 8, 64)):
    eng = MTPEngine(EngineConfig(draft_len=k, max_seqs=max(buckets), seed=seed), device=device)
    forward = None
    if graph:
        forward = graphctl.graphed(eng.step, buckets=list(buckets), state=eng.state, backend=backend,
                                   inputs=[StaticInput("input_ids", per_item=k + 1)], progress=False)
    gen = torch.Generator().manual_seed(seed)
    return eng, eng.generate(eng.prompts(bs, gen), STEPS, forward=forward), forward

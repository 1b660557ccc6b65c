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


def trace(mode: str, *, k: int = 3, bs: int = 3, seed: int = 5, device="cpu", backend="emulated",
          buckets=(1, 2, 4, 8), steps: int = STEPS):
    """Accepted lengths and drafts of every step of a generation, with the step eager
    (``mode="eager"``) or graphed in a draft-loop mode (``graphctl.models.graphed_step``)."""
    from graphctl.models import graphed_step

    eng = MTPEngine(EngineConfig(draft_len=k, max_seqs=max(buckets), seed=seed), device=device)
    fwd = eng.step if mode == "eager" else graphed_step(eng, mode, buckets=buckets, backend=backend)
    drafts = []

    def step(ids, m):
        out = fwd(ids, m)
        drafts.append(out.drafts.to("cpu", copy=True))
        return out

    history = eng.generate(eng.prompts(bs, torch.Generator().manual_seed(seed)), steps, forward=step)
    return history, drafts


def dynamic_setup(k: int, bs: int, seed: int, device="cpu", max_seqs: int = 8):
    """An engine after prefill with one decode step's inputs prepared: ``(engine, input_ids)``."""
    eng = MTPEngine(EngineConfig(draft_len=k, max_seqs=max_seqs, seed=seed), device=device)
    prompts = eng.prompts(bs, torch.Generator().manual_seed(seed))
    context = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    token = eng.prefill(prompts)
    ids = torch.cat([token[:, None], token[:, None].repeat(1, k)], 1).reshape(-1)
    eng.meta.prepare(eng.state, torch.full((bs,), k + 1, dtype=torch.int32), context + k + 1)
    return eng, ids


def thresholds(conf: torch.Tensor, margin: float = 1e-3) -> list[float]:
    """Planted thresholds: 0, 1.01 and the midpoints between the step's distinct draft
    probabilities, each at least ``margin`` from every probability (a threshold equal to one
    would let rounding in the graph's kernels, which may differ from eager's, flip the stop)."""
    vals = sorted(set(conf.flatten().tolist()))
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:]) if b - a > 2 * margin]
    return [0.0, 1.01] + mids


def move_every_buffer(eng) -> graphctl.BoundState:
    """Reallocate every declared tensor of the metadata (same layout, same values), as a grown
    pool or a reallocated table does, and bind the object again."""
    m = eng.meta
    for name in list(eng.state.plan.buffers):
        old = getattr(m, name, None)
        if isinstance(old, torch.Tensor) and "." not in name:
            fresh = torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device=old.device,
                                        pin_memory=old.is_pinned() if old.device.type == "cpu" else False)
            fresh.copy_(old)
            setattr(m, name, fresh)
    m.kv_lens_runtime = m.kv_lens[: m.kv_lens.numel()]  # the declared alias follows its base
    return graphctl.bind(m, registry=eng.registry)

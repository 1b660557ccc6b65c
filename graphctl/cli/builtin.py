"""The built-in target of ``graphctl capture``: the reference engine's decode step."""
from __future__ import annotations

import torch

from graphctl.graphs import StaticInput
from graphctl.graphs.target import CaptureTarget
from graphctl.models import EngineConfig, MTPEngine

__all__ = ["capture_target"]


def capture_target(*, device: str = "cpu", max_batch: int = 64, draft_len: int = 3, seed: int = 0, **_: object):
    """The built-in target of ``graphctl capture``: one decode step of the reference engine
    (target forward, acceptance, k draft steps in the draft role) for up to ``max_batch``
    requests of ``draft_len + 1`` tokens, metadata prepared for ``max_batch`` requests."""
    eng = MTPEngine(EngineConfig(draft_len=draft_len, max_seqs=max_batch, seed=seed), device=device)
    g = torch.Generator().manual_seed(seed)
    k1 = draft_len + 1
    eng.meta.prepare(
        eng.state,
        torch.full((max_batch,), k1, dtype=torch.int32),
        torch.randint(k1, max(k1 + 1, eng.cfg.max_context - 2 * k1), (max_batch,), generator=g, dtype=torch.int32),
    )
    ids = torch.randint(0, eng.cfg.vocab, (max_batch * k1,), generator=g).to(eng.device)
    return CaptureTarget(forward=eng.step, example=(ids, eng.meta), state=eng.state,
                         inputs=(StaticInput("input_ids", per_item=k1),), params=eng.named_tensors(),
                         name=f"MTPEngine.step (k={draft_len})")

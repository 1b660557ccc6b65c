"""The built-in target of ``graphctl capture``: the reference engine's decode step."""
from __future__ import annotations

import torch

from graphctl.graphs import StaticInput
from graphctl.graphs.target import CaptureTarget
from graphctl.models import EngineConfig, MTPEngine

__all__ = ["capture_target", "step_target"]


def capture_target(*, device: str = "cpu", max_batch: int = 64, draft_len: int = 3, seed: int = 0,
                   draft_lens: tuple[int, ...] | None = None, **_: object):
    """The built-in target of ``graphctl capture``: one decode step of the reference engine
    (target forward, acceptance, k draft steps in the draft role) for up to ``max_batch``
    requests of ``draft_len + 1`` tokens, metadata prepared for ``max_batch`` requests;
    ``draft_lens`` (``--draft-len 1 3 7``): every listed draft length from one runner."""
    eng = MTPEngine(EngineConfig(draft_len=draft_len, max_seqs=max_batch, seed=seed), device=device)
    g = torch.Generator().manual_seed(seed)
    k1 = draft_len + 1
    eng.meta.prepare(
        eng.state,
        torch.full((max_batch,), k1, dtype=torch.int32),
        torch.randint(k1, max(k1 + 1, eng.cfg.max_context - 2 * k1), (max_batch,), generator=g, dtype=torch.int32),
    )
    ids = torch.randint(0, eng.cfg.vocab, (max_batch * k1,), generator=g).to(eng.device)
    return step_target(eng, ids, draft_len, draft_lens, "MTPEngine.step ({})")


def step_target(eng: MTPEngine, ids: torch.Tensor, draft_len: int, draft_lens: tuple[int, ...] | None,
                name: str) -> CaptureTarget:
    """An engine's ``step`` as a target: at ``draft_len``, or (``draft_lens``) one runner with a
    graph set per draft length (``variants={"k": draft_lens}``, called ``step(ids, meta, k)``);
    ``name`` gets the draft lengths at ``{}``."""
    if not draft_lens:
        return CaptureTarget(forward=eng.step, example=(ids, eng.meta), state=eng.state,
                             inputs=(StaticInput("input_ids", per_item=draft_len + 1),), params=eng.named_tensors(),
                             name=name.format(f"k={draft_len}"))
    return CaptureTarget(forward=eng.step, example=(ids, eng.meta, draft_len), state=eng.state,
                         inputs=(StaticInput("input_ids", per_item_of=lambda k: k + 1),), params=eng.named_tensors(),
                         variants={"k": tuple(draft_lens)}, name=name.format(f"k in {tuple(draft_lens)}"),
                         prepare=eng.prepare_for)

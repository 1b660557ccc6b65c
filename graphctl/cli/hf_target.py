"""``graphctl capture --hf-config NAME``: one speculative decode step of a transformers model
(random weights from a named config) on the paged family, with its oracle draft."""
from __future__ import annotations

import torch

from graphctl.cli.builtin import step_target
from graphctl.graphs.target import CaptureTarget

__all__ = ["capture_target"]


def capture_target(*, device: str = "cpu", max_batch: int = 64, draft_len: int = 3, seed: int = 0,
                   draft_lens: tuple[int, ...] | None = None,
                   hf_config: str = "tiny-llama", compile: bool = False, compile_mode: str = "static",
                   **_: object) -> CaptureTarget:
    """The HF engine's step for up to ``max_batch`` requests of ``draft_len + 1`` tokens (every
    one of ``draft_lens`` from one runner, when given)."""
    from graphctl.integrations.hf import HFEngine
    from graphctl.integrations.hf.configs import hf_config as load

    cfg = load(hf_config)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    eng = HFEngine.build(cfg, draft_len=draft_len, max_seqs=max_batch, max_context=256, block_size=16,
                         device=device, dtype=dtype, seed=seed, compile=compile, compile_mode=compile_mode)
    g = torch.Generator().manual_seed(seed)
    k1 = draft_len + 1
    eng.meta.prepare(eng.state, torch.full((max_batch,), k1, dtype=torch.int32),
                     torch.randint(k1, 200, (max_batch,), generator=g, dtype=torch.int32))
    ids = torch.randint(0, eng.cfg.vocab, (max_batch * k1,), generator=g).to(eng.device)
    return step_target(eng, ids, draft_len, draft_lens, f"HFEngine.step ({hf_config}, "
                       f"{type(eng.target_layers).__name__}, {{}}{', compiled' if compile else ''})")

"""The acceptance oracle on the H200: the reference MTP engine, eager and as one CUDA graph per
bucket, batch sizes 1, 3, 8, 64 and 256, draft lengths 1, 3 and 7."""
from __future__ import annotations

import pytest
import torch

from enginecases import STEPS, acceptance, run

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("bs", [1, 3, 8, 64, 256])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_every_draft_accepted_cuda(k, bs, graph, gen):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    _, history, forward = run(k, bs, graph, seed, device="cuda", backend="cuda", buckets=(1, 4, 8, 64, 256))
    got = acceptance(history)
    print(f"acceptance k={k} bs={bs} {'graph' if graph else 'eager'}: {got:.3f} (oracle {k + 1})")
    for step, acc in enumerate(history[1:], 1):
        assert torch.equal(acc, torch.full_like(acc, k + 1)), (step, acc.tolist())
    if graph:
        assert forward.report().backend == "cuda" and sum(b.replays for b in forward.report().buckets) == STEPS

"""Sampling's Triton filtering (issue 34, ``graphctl/ops/sampling_triton.py``): temperature and top-p to
probabilities in one program a row, top-p found by bisection, against the PyTorch reference
(``probs_from_logits`` under ``GRAPHCTL_SAMPLING=reference``): on the CPU through Triton's interpreter,
on the GPU directly and inside a CUDA graph."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from graphctl import knobs
from graphctl.ops import sampling
from graphctl.ops.sampling import probs_from_logits

CASES = [(1, 7), (3, 33), (5, 1000), (2, 4099), (4, 32000)]  # rows, vocab: odd sizes and llama-1b's
SETTINGS = [(1.0, 1.0), (0.8, 0.9), (1.7, 0.5), (0.5, 0.01), (2.0, 0.999)]  # temperature, top-p


def _logits(gen, rows, vocab, dtype):
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    x[0, : min(6, vocab)] = x[0].max()  # six tokens tied at the top: the boundary falls inside a tie
    return x


def _assert_same_law(got, want, logits, t, what) -> None:
    """The kernel's probabilities are the reference's but at the top-p boundary: on CUDA the reference's
    float32 running sum over a large vocabulary drifts by about sqrt(V) ulps of the mass (an H100 run: 4 x
    32,000 at top-p 0.999), more than a tail token holds, so either side may keep a boundary token the other
    drops. Still required: kept sets nested (both are thresholds), the tokens they differ by holding at most
    1e-4 of the mass, and the same probabilities elsewhere."""
    kg, kw = got > 0, want > 0
    nested = ((kg & ~kw).sum(-1) == 0) | ((kw & ~kg).sum(-1) == 0)
    assert bool(nested.all()), what
    differ = (torch.softmax(logits.float() / t, -1) * (kg ^ kw)).sum(-1)
    assert float(differ.max()) <= 1e-4, (what, float(differ.max()))
    both = kg & kw
    torch.testing.assert_close(got * both, want * both, rtol=2e-4, atol=1e-6)


_CHECK = r"""
import sys, torch
from graphctl.ops.sampling import probs_from_logits
from graphctl.ops.sampling_triton import probs
sys.path.insert(0, sys.argv[1])
from unit.test_sampling_triton import CASES, SETTINGS, _logits
gen = torch.Generator().manual_seed(int(sys.argv[2]))
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for rows, vocab in CASES[:4]:
        logits = _logits(gen, rows, vocab, dtype)
        for t, p in SETTINGS:
            got, want = probs(logits, t, p), probs_from_logits(logits, t, 0, p)  # CPU tensors: the reference
            assert torch.equal(got > 0, want > 0), (dtype, rows, vocab, t, p)
            err = (got - want).abs().max().item()
            assert err <= 2e-6, (dtype, rows, vocab, t, p, err)
assert probs(torch.randn(1, 40000), 1.0, 0.9) is None  # a row that does not fit: the PyTorch code runs
print("ok")
"""


def test_the_triton_filtering_equals_the_reference_in_triton_s_interpreter(gen):
    # Regression: issue 34, sampling's sort-and-scan filtering cost 1.1-1.3x a greedy step; its one-kernel
    # replacement must keep the same tokens (ties at the top-p boundary included), every dtype, odd vocabularies.
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.dirname(__file__))
    seed = str(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    res = subprocess.run([sys.executable, "-c", _CHECK, tests, seed], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


def test_settings_the_kernel_does_not_cover_run_the_reference(gen, monkeypatch):
    # Regression: issue 34, per-row device settings and top-k must never reach the host-settings kernel.
    calls = []
    monkeypatch.setattr(sampling.PICK, "kernel", lambda device: calls.append(device) or None)
    logits = _logits(gen, 3, 50, torch.float32)
    probs_from_logits(logits, torch.rand(3, generator=gen) + 0.5, 0, 0.9)
    probs_from_logits(logits, 0.8, 5, 0.9)
    probs_from_logits(logits, 0.8, torch.tensor([0, 2, 3]), 0.9)
    probs_from_logits(logits, 0.0, 0, 0.9)  # greedy: the one-hot
    assert calls == []
    probs_from_logits(logits, 0.8, 0, 0.9)
    probs_from_logits(logits, 0.8, 50, 0.9)  # top-k the whole vocabulary is off
    assert len(calls) == 2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_triton_filtering_equals_the_reference_on_cuda(gen, dtype):
    pytest.importorskip("triton")
    for rows, vocab in CASES:
        logits = _logits(gen, rows, vocab, dtype).cuda()
        for t, p in SETTINGS:
            with knobs.scope(sampling="triton"):
                got = probs_from_logits(logits, t, 0, p)
            assert sampling.PICK.state.get("kernel") is not None, "triton should pick the kernel on CUDA"
            with knobs.scope(sampling="reference"):
                want = probs_from_logits(logits, t, 0, p)
            _assert_same_law(got, want, logits, t, (dtype, rows, vocab, t, p))


@pytest.mark.cuda
def test_the_triton_filtering_replays_in_a_cuda_graph_with_new_logits(gen):
    pytest.importorskip("triton")
    logits = _logits(gen, 8, 32000, torch.bfloat16).cuda()
    with knobs.scope(sampling="triton"):
        probs_from_logits(logits, 0.8, 0, 0.9)  # Triton compiles on the first launch
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = probs_from_logits(logits, 0.8, 0, 0.9)
    logits.copy_(_logits(gen, 8, 32000, torch.bfloat16))  # fresh logits in place, then replay
    out.fill_(float("nan"))  # poison: the replay must write every element
    g.replay()
    with knobs.scope(sampling="reference"):
        want = probs_from_logits(logits, 0.8, 0, 0.9)
    _assert_same_law(out.clone(), want, logits, 0.8, "replay")

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
from graphctl.ops import draws, sampling
from graphctl.ops.sampling import probs_from_logits

CASES = [(1, 7), (3, 33), (5, 1000), (2, 4099), (4, 32000)]  # rows, vocab: odd sizes and llama-1b's
SETTINGS = [(1.0, 1.0), (0.8, 0.9), (1.7, 0.5), (0.5, 0.01), (2.0, 0.999)]  # temperature, top-p


def _logits(gen, rows, vocab, dtype):
    x = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    x[0, : min(6, vocab)] = x[0].max()  # six tokens tied at the top: the boundary falls inside a tie
    return x


def _assert_same_law(got, want, logits, t, what, top_p=None) -> None:
    """The kernel's probabilities are the reference's but at the top-p boundary: the kernel finds the threshold by
    bisection over float32 sums, the reference by a sorted float32 cumsum, and where the mass of the tokens more
    likely than a token is within float32 rounding of top_p (an H100 run: 4 x 32,000 at top-p 0.999; the
    interpreter: float16, 2 x 4,099 at top-p 0.9, a token of mass 0.0025 behind 0.8999995) either side may keep it.
    Still required: kept sets nested (both are thresholds); each token they differ by either holds at most 1e-4 of
    the mass or sits at the boundary (the mass before it within 2e-5 of top_p: ~sqrt(V) float32 roundings of the
    running sum); the same probabilities over the tokens both keep, renormalized there."""
    kg, kw = got > 0, want > 0
    nested = ((kg & ~kw).sum(-1) == 0) | ((kw & ~kg).sum(-1) == 0)
    assert bool(nested.all()), what
    x = logits.float() / t
    law = torch.softmax(x.double(), -1)
    for r, c in (kg ^ kw).nonzero().tolist():
        before = float(law[r][x[r] > x[r, c]].sum())
        at_boundary = top_p is not None and abs(before - top_p) <= 2e-5
        assert at_boundary or float(law[r, c]) <= 1e-4, (what, r, c, float(law[r, c]), before)
    both = kg & kw  # over the tokens both keep, renormalized there (a boundary token shifts the rest by its mass)
    g, w = got * both, want * both
    torch.testing.assert_close(g / g.sum(-1, keepdim=True), w / w.sum(-1, keepdim=True), rtol=2e-4, atol=1e-6)


_CHECK = r"""
import sys, torch
from graphctl.ops.sampling import probs_from_logits
from graphctl.ops.sampling_triton import probs
sys.path.insert(0, sys.argv[1])
from unit.test_sampling_triton import CASES, SETTINGS, _assert_same_law, _logits
gen = torch.Generator().manual_seed(int(sys.argv[2]))
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for rows, vocab in CASES[:4]:
        logits = _logits(gen, rows, vocab, dtype)
        for t, p in SETTINGS:
            got, want = probs(logits, t, p), probs_from_logits(logits, t, 0, p)  # CPU tensors: the reference
            what = ("seed", sys.argv[2], dtype, rows, vocab, t, p)
            if torch.equal(got > 0, want > 0):
                err = (got - want).abs().max().item()
                assert err <= 2e-6, (what, err)
            else:
                # The kernel finds the top-p threshold by bisection over float32 sums, the reference by a sorted
                # float32 cumsum: over 1000 tokens at temperature 2 the two sums differ by a few ulps of the mass
                # (~1e-6), more than a tail token holds near top-p 0.999, so either may keep a boundary token the
                # other drops (a seed failed at float32, 5 x 1000, t 2.0, p 0.999). As on CUDA: the same law.
                _assert_same_law(got, want, logits, t, what, p)
assert probs(torch.randn(1, 40000), 1.0, 0.9) is None  # a row that does not fit: the PyTorch code runs
print("ok")
"""

def _assert_same_rows(got, want, logits, t, k, p, what) -> None:
    """The per-row kernel's probabilities against the reference's, row by row: greedy rows the same one-hot; else
    the same kept set and probabilities within 1e-5, or nested sets differing only by tokens of mass <= 1e-4 in the
    top-k law or at the top-p boundary (as ``_assert_same_law``), equal over the tokens both keep, renormalized."""
    from graphctl.ops.sampling import TEMPERATURE_FLOOR

    for r in range(logits.shape[0]):
        g, w = got[r], want[r]
        if float(t[r]) < TEMPERATURE_FLOOR:
            assert torch.equal(g, w), (what, r, "greedy")
            continue
        kg, kw = g > 0, w > 0
        if torch.equal(kg, kw):
            assert (g - w).abs().max().item() <= 1e-5, (what, r)
            continue
        assert int((kg & ~kw).sum()) == 0 or int((kw & ~kg).sum()) == 0, (what, r, "not nested")
        x = logits[r].float()
        q = probs_from_logits(logits[r:r + 1], float(t[r]), int(k[r]), 1.0)[0].double()  # the top-k law
        for c in (kg ^ kw).nonzero()[:, 0].tolist():
            before = float(q[x > x[c]].sum())
            assert float(q[c]) <= 1e-4 or abs(before - float(p[r])) <= 2e-5, (what, r, c, float(q[c]), before)
        both = kg & kw
        gg, ww = g * both, w * both
        torch.testing.assert_close(gg / gg.sum(), ww / ww.sum(), rtol=2e-4, atol=1e-6)


_CHECK_ROWS = r"""
import sys, torch
from graphctl.ops.sampling import TEMPERATURE_FLOOR, probs_from_logits
from graphctl.ops.sampling_triton import probs_rows
sys.path.insert(0, sys.argv[1])
from unit.test_sampling_triton import CASES, _assert_same_rows, _logits
gen = torch.Generator().manual_seed(int(sys.argv[2]))
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for rows, vocab in CASES[:4]:
        rows = rows + 3  # greedy, top-k only, top-p only rows beside random mixes
        logits = _logits(gen, rows, vocab, dtype)
        t = torch.rand(rows, generator=gen) * 2 + 0.2
        k = torch.randint(0, 12, (rows,), generator=gen).to(torch.int32)
        p = torch.rand(rows, generator=gen) * 0.9 + 0.1
        t[0] = 0.0
        p[1], k[2] = 1.0, 0
        if rows > 4:
            k[3] = vocab  # top-k of the whole vocabulary: off
        got = probs_rows(logits, t, k, p, TEMPERATURE_FLOOR)
        want = probs_from_logits(logits, t, k, p)  # CPU tensors: the reference
        _assert_same_rows(got, want, logits, t, k, p, ("seed", sys.argv[2], dtype, rows, vocab))
print("ok")
"""

_CHECK_FAST = r"""
import sys, torch
from graphctl.ops import sampling_triton as st
from graphctl.ops import draws
from graphctl.ops.sampling import race, speculative_accept
sys.path.insert(0, sys.argv[1])
from unit.test_sampling_triton import SETTINGS, _logits
gen = torch.Generator().manual_seed(int(sys.argv[2]))


def noise(rows, vocab):
    seed = torch.randint(0, 2**62, (rows,), generator=gen)
    return draws.noise(seed, torch.randint(0, 999, (rows,), generator=gen), draws.TARGET, vocab)


# the keyed noise kernel: the reference's integers, its -log within float32 rounding
for rows, vocab in ((1, 7), (3, 4099), (2, 5000)):
    keys = draws.row_keys(torch.randint(0, 2**62, (rows,), generator=gen), torch.randint(-2, 999, (rows,),
                          generator=gen), draws.DRAFT)
    torch.testing.assert_close(st.keyed_noise(keys, vocab), draws._reference(keys, vocab), rtol=1e-6, atol=0)
# the search over 16-bit logits' patterns, and the start bound of the float32 one, change no bit of the full
# 31-step bisection over float32 probabilities
for rows, vocab in ((3, 33), (2, 4099), (2, 32000)):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = _logits(gen, rows, vocab, dtype)
        for t, p in SETTINGS + [(3.0, 0.95), (1.0, 0.99999)]:
            st.KEYED, st._FLOOR_TOP_P = False, -1.0
            full = st.probs(logits, t, p)
            st.KEYED, st._FLOOR_TOP_P = True, 0.9999
            fast = st.probs(logits, t, p)
            assert torch.equal(full, fast), (rows, vocab, dtype, t, p)
            e = noise(rows + 1, vocab)
            assert torch.equal(st.race(fast, e), race(full, e)), (rows, vocab, dtype, t, p)  # race(): CPU reference
# the race kernel takes rows of any strides (a view every other token here)
wide = torch.softmax(torch.randn(4, 74, generator=gen), -1)[:, ::2]
e = noise(5, 37)
assert torch.equal(st.race(wide, e), race(wide, e))
# the acceptance kernel draws what the reference draws from the same stream, q == p rows included
for n, k, vocab in ((1, 1, 7), (3, 3, 33), (2, 4, 9000)):
    for same in (False, True):
        p = torch.softmax(torch.randn(n, k + 1, vocab, generator=gen) * 2, -1)
        q = p[:, :k].clone() if same else torch.softmax(torch.randn(n, k, vocab, generator=gen) * 2, -1)
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(n, k)
        if same:  # a draft neither law can draw, rejected where p == q: the residual is zero, p is raced
            p[:, 0, 0] = 0.0
            p[:, 0] /= p[:, 0].sum(-1, keepdim=True)
            q[:, 0] = p[:, 0]
            drafts[:, 0] = 0
        seed, pos = torch.randint(0, 2**62, (n,), generator=gen), torch.randint(0, 999, (n,), generator=gen)
        a = speculative_accept(p, q, drafts, seed, pos)  # CPU: the reference
        u = draws.uniform(seed[:, None], pos[:, None] + torch.arange(k), draws.ACCEPT)
        b = st.accept(p, q, drafts, u, draws.noise(seed, pos, draws.TARGET, vocab))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (n, k, vocab, same, a, b)
        assert not same or bool((a[0] == 1).all()), "the zero-residual case was not reached"
print("ok")
"""


def _interpret(script: str, gen, timeout: int) -> None:
    """``script`` in a fresh process under Triton's interpreter (read when a kernel is first built), seeded
    from ``gen``; it must print "ok" last."""
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.dirname(__file__))
    seed = str(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    res = subprocess.run([sys.executable, "-c", script, tests, seed], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"the interpreter's check failed (its seed {seed}):\n" + res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


def test_the_triton_filtering_equals_the_reference_in_triton_s_interpreter(gen):
    # Regression: issue 34, sampling's sort-and-scan filtering cost 1.1-1.3x a greedy step; its one-kernel
    # replacement must keep the same tokens (ties at the top-p boundary included), every dtype, odd vocabularies.
    _interpret(_CHECK, gen, timeout=600)


def test_the_per_row_filtering_kernel_equals_the_reference_in_the_interpreter(gen):
    # Regression: issue 53, per-request settings (a tensor a row) ran PyTorch's sort and scan: a sampled step cost
    # 1.27-1.36x a greedy one on an H100; the per-row kernel must keep each row's law, greedy rows exactly greedy.
    _interpret(_CHECK_ROWS, gen, timeout=900)


def test_the_fast_search_race_and_acceptance_kernels_equal_their_references_in_the_interpreter(gen):
    # Regression: issue 34, sampling cost 1.07x greedy: 16-bit logits are searched in 16 steps, the race and
    # the acceptance are one kernel each; none may change a token.
    _interpret(_CHECK_FAST, gen, timeout=900)


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
            _assert_same_law(got, want, logits, t, (dtype, rows, vocab, t, p), p)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_per_row_triton_filtering_equals_the_reference_on_cuda(gen, dtype):
    # Regression: issue 53, per-request settings ran PyTorch's sort and scan on CUDA (1.27-1.36x a greedy step).
    pytest.importorskip("triton")
    for rows, vocab in CASES:
        rows += 3
        logits = _logits(gen, rows, vocab, dtype).cuda()
        t = torch.rand(rows, generator=gen) * 2 + 0.2
        k = torch.randint(0, 12, (rows,), generator=gen).to(torch.int32)
        p = torch.rand(rows, generator=gen) * 0.9 + 0.1
        t[0], p[1], k[2] = 0.0, 1.0, 0
        dev = [v.cuda() for v in (t, k, p)]
        with knobs.scope(sampling="triton"):
            got = probs_from_logits(logits, *dev)
        assert sampling.ROWS.state.get("ran"), "triton should have launched the per-row kernel"
        with knobs.scope(sampling="reference"):
            want = probs_from_logits(logits, *dev)
        _assert_same_rows(got.cpu(), want.cpu(), logits.cpu(), t, k, p, (dtype, rows, vocab))


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
    _assert_same_law(out.clone(), want, logits, 0.8, "replay", 0.9)


@pytest.mark.cuda
def test_the_acceptance_and_race_kernels_draw_the_reference_s_tokens_on_cuda(gen):
    pytest.importorskip("triton")
    for n, k, vocab in ((1, 3, 32000), (8, 3, 32000), (5, 2, 4099), (3, 1, 128256)):
        p = torch.softmax(torch.randn(n, k + 1, vocab, generator=gen) * 3, -1).cuda()
        q = torch.softmax(torch.randn(n, k, vocab, generator=gen) * 3, -1).cuda()
        drafts = torch.multinomial(q.reshape(-1, vocab), 1).view(n, k)
        p[0, 0, 0] = 0.0  # request 0 drafted a token neither law can draw, rejected where p == q: zero residual
        p[0, 0] /= p[0, 0].sum()
        q[0, 0] = p[0, 0]
        drafts[0, 0] = 0
        seed = torch.randint(0, 2**62, (n,), generator=gen).cuda()
        pos = torch.randint(0, 999, (n,), generator=gen).cuda()
        out = {}
        for choice in ("triton", "reference"):
            with knobs.scope(sampling=choice):
                out[choice] = sampling.speculative_accept(p, q, drafts, seed, pos)
        assert sampling.ACCEPT.state.get("ran"), "triton should have launched the acceptance kernel"
        assert torch.equal(out["triton"][0], out["reference"][0]), (n, k, vocab)
        assert torch.equal(out["triton"][1], out["reference"][1]), (n, k, vocab)
        with knobs.scope(sampling="reference"):
            e = draws.noise(seed, pos, draws.TARGET, vocab)
        with knobs.scope(sampling="triton"):
            torch.testing.assert_close(draws.noise(seed, pos, draws.TARGET, vocab), e, rtol=1e-6, atol=0)
        assert draws.NOISE.state.get("ran"), "triton should have launched the keyed noise kernel"
        with knobs.scope(sampling="triton"):
            tok = sampling.race(p[:, 0], e)
        assert sampling.RACE.state.get("ran"), "triton should have launched the race kernel"
        with knobs.scope(sampling="reference"):
            assert torch.equal(tok, sampling.race(p[:, 0], e)), (n, vocab)

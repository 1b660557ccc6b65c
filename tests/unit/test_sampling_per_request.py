"""Per-request sampling (issue 53, graphctl/models/sampled.py, graphctl/ops/draws.py): each request's settings
and seed on the metadata, its draws keyed by (seed, position, stream): the same token whatever its batch, its row,
its bucket's padding; speculative sampling keeps each request's own target law in a mixed batch.

Batch invariance is checked where the logits are the same by construction (fed to the sampler directly, or the
same request at the same row and batch shape with other companions): kernels may round differently across batch
shapes (docs/transformers.md, "Sampling"); the draws must not depend on the batch at all."""
from __future__ import annotations

import types

import pytest
import torch
from test_sampling import ALPHA, chi2_p

import graphctl
from graphctl.models import EngineConfig, MTPEngine, RequestSettings, graphed_step
from graphctl.models.sampled import laws
from graphctl.ops import draws
from graphctl.ops.sampling import probs_from_logits, sample, speculative_accept


def _meta(t, k, p, seed) -> types.SimpleNamespace:
    """The per-request buffers a step reads, as the metadata holds them."""
    return types.SimpleNamespace(temperature=torch.tensor(t, dtype=torch.float32),
                                 top_k=torch.tensor(k, dtype=torch.int32), top_p=torch.tensor(p, dtype=torch.float32),
                                 seed=torch.tensor(seed, dtype=torch.int64))


def _settings(gen, n: int) -> tuple[list, list, list, list]:
    t = [float(v) for v in (torch.rand(n, generator=gen) * 1.5)]
    t = [0.0 if i % 3 == 0 else v + 0.1 for i, v in enumerate(t)]  # every third greedy
    k = [int(v) for v in torch.randint(0, 6, (n,), generator=gen)]
    p = [float(v) for v in (0.5 + 0.5 * torch.rand(n, generator=gen))]
    seed = [int(v) for v in torch.randint(0, 2**62, (n,), generator=gen)]
    return t, k, p, seed


def test_a_request_draws_the_same_token_in_any_batch_row_or_padding(gen):
    # Regression: issue 53, draws came from one generator stream shared by the batch: a request's token depended on
    # how many rows drew before it, so the same request in another batch (or another bucket) got another token.
    n, vocab = 9, 37
    logits = torch.randn(n, vocab, generator=gen) * 2
    t, k, p, seed = _settings(gen, n)
    pos = torch.randint(0, 500, (n,), generator=gen)
    full = sample(laws(logits, _meta(t, k, p, seed), n), torch.tensor(seed), pos)
    for _ in range(4):
        rows = torch.randperm(n, generator=gen)[: int(torch.randint(1, n + 1, (1,), generator=gen))]
        pad = int(torch.randint(0, 4, (1,), generator=gen))  # a bucket's padded rows: greedy, seed 0
        sel = rows.tolist()
        meta = _meta([t[i] for i in sel] + [0.0] * pad, [k[i] for i in sel] + [0] * pad,
                     [p[i] for i in sel] + [1.0] * pad, [seed[i] for i in sel] + [0] * pad)
        lg = torch.cat([logits[rows], torch.randn(pad, vocab, generator=gen)])
        at = torch.cat([pos[rows], torch.zeros(pad, dtype=pos.dtype)])
        got = sample(laws(lg, meta, len(sel) + pad), meta.seed, at)
        assert torch.equal(got[: len(sel)], full[rows]), (sel, pad)
    greedy = [i for i in range(n) if t[i] == 0.0]
    assert torch.equal(full[greedy], logits[greedy].argmax(-1))  # greedy rows exactly greedy in a mixed batch


def test_speculative_acceptance_of_a_request_does_not_depend_on_its_batch(gen):
    # Regression: issue 53, the acceptance's uniforms and the resample's noise were drawn for the whole batch.
    n, k, vocab = 7, 3, 23
    target = torch.softmax(torch.randn(n, k + 1, vocab, generator=gen) * 2, -1)
    draft = torch.softmax(torch.randn(n, k, vocab, generator=gen) * 2, -1)
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    seed, pos = torch.randint(0, 2**62, (n,), generator=gen), torch.randint(0, 900, (n,), generator=gen)
    acc, tok = speculative_accept(target, draft, drafts, seed, pos)
    for rows in (torch.tensor([3]), torch.tensor([6, 0, 2]), torch.randperm(n, generator=gen)):
        a, b = speculative_accept(target[rows], draft[rows], drafts[rows], seed[rows], pos[rows])
        assert torch.equal(a, acc[rows]) and torch.equal(b, tok[rows])


@pytest.mark.parametrize("draft_kind", ["bad", "oracle"])
def test_speculative_sampling_keeps_each_request_s_own_law_in_a_mixed_batch(draft_kind, gen):
    # Regression: issue 53, settings were one per graph; in one batch now, requests at different settings must each
    # emit their own target law (chi-square per request group and position), whatever the draft, greedy rows greedy.
    k, vocab, per = 2, 6, 30_000
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5  # one prompt's target logits at each position
    groups = [(0.7, 0, 0.9), (1.6, 3, 1.0), (0.0, 0, 1.0)]
    t = [s[0] for s in groups for _ in range(per)]
    kk = [s[1] for s in groups for _ in range(per)]
    pp = [s[2] for s in groups for _ in range(per)]
    n = len(t)
    base = int(torch.randint(0, 2**40, (1,), generator=g))
    meta = _meta(t, kk, pp, [base + i for i in range(n)])
    target = laws(logits.repeat(n, 1), meta, n, k + 1).view(n, k + 1, vocab)
    if draft_kind == "oracle":
        q = target[:, :k]
    else:  # a deliberately bad draft, its own temperature per request
        q = laws(torch.randn(k, vocab, generator=g).repeat(n, 1) * 3, meta, n, k).view(n, k, vocab)
    pos = torch.full((n,), 40)
    at = (pos[:, None] + torch.arange(k)).reshape(-1)
    drafts = sample(q.reshape(-1, vocab), meta.seed.repeat_interleave(k), at, draws.DRAFT).view(n, k)
    accepted, token = speculative_accept(target, q, drafts, meta.seed, pos)
    for g_i, (temp, top_k, top_p) in enumerate(groups):
        rows = slice(g_i * per, (g_i + 1) * per)
        want = probs_from_logits(logits, temp, top_k, top_p)  # this group's law at each position
        acc, d, tk = accepted[rows], drafts[rows], token[rows]
        if draft_kind == "oracle" or temp == 0.0:
            assert bool((acc == k + 1).all()) or temp == 0.0 and bool((acc >= 1).all())
        for j in range(k + 1):
            reach = acc >= j + 1
            emitted = torch.where(acc[reach] - 1 > j, d[reach, min(j, k - 1)], tk[reach])
            if temp == 0.0:  # greedy inside the mixed batch: the argmax, exactly
                assert bool((emitted == logits[j].argmax()).all()), j
            elif int((want[j] > 0).sum()) == 1:  # top-p kept one token (a chi-square has no degree of freedom)
                assert bool((emitted == want[j].argmax()).all()), (draft_kind, g_i, j)
            elif emitted.numel() >= 2000:
                assert chi2_p(torch.bincount(emitted, minlength=vocab), want[j]) > ALPHA, (draft_kind, g_i, j)


def _engine(device: str = "cpu"):
    return MTPEngine(EngineConfig(draft_len=3, max_seqs=4, max_context=160), device=device, oracle=False)


@pytest.mark.parametrize("mode", ["unrolled", "per_step", "device_loop"])
def test_a_request_gets_the_same_tokens_with_any_companions_at_its_row(mode, backend, device, gen):
    # Regression: issue 53, a request sampled with a batch-shared stream got other tokens when its companions changed.
    # The same row and batch shape (the logits are then the same), other companions' prompts and settings.
    if mode == "device_loop" and backend != "cuda":
        pytest.skip("device_loop needs CUDA")
    eng = _engine(device)
    step = graphed_step(eng, mode, buckets=(4,), backend=backend, sampling=True)
    mine = eng.prompts(1, gen)[0]
    runs = []
    for _ in range(3):
        others = eng.prompts(2, gen)
        t, kk, p, seed = _settings(gen, 3)
        s = RequestSettings.of(3, temperature=[1.7] + t[1:], top_k=[0] + kk[1:], top_p=[0.95] + p[1:],
                               seed=[77] + seed[1:])
        runs.append(eng.sample([mine] + others, 5, s, forward=step)[0].tolist())
    assert runs[0] == runs[1] == runs[2]
    other_seed = RequestSettings.of(3, temperature=1.7, top_p=0.95, seed=[78, 1, 2])
    assert eng.sample([mine] + eng.prompts(2, gen), 5, other_seed, forward=step)[0].tolist() != runs[0]


def test_settings_are_checked_per_request_before_anything_is_written(gen):
    # Regression: issue 53, a per-prompt list of the wrong length or with one bad value must name the request and
    # leave the metadata as it was.
    eng = _engine()
    before = [b.clone() for b in (eng.meta.temperature, eng.meta.top_k, eng.meta.top_p, eng.meta.seed)]
    for kw, where in ((dict(temperature=[0.5, 0.7]), "3 values"), (dict(top_k=[0, 1.5, 0]), "request 1"),
                      (dict(top_p=[1.0, 1.0, 0.0]), "request 2"), (dict(seed=[1, 2, -3]), "seed"),
                      (dict(temperature=[0.8, float("nan"), 0.8]), "request 1"), (dict(seed=2**63 - 2), "seed")):
        with pytest.raises(graphctl.SamplingError, match=where):
            eng.sample(eng.prompts(3, gen), 1, RequestSettings.of(3, **kw))
    after = (eng.meta.temperature, eng.meta.top_k, eng.meta.top_p, eng.meta.seed)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_keyed_draws_are_uniform_and_independent_across_streams_positions_and_seeds(gen):
    # Regression: issue 53, the counter-based draws replace torch's generator: their uniforms must be uniform, and
    # nearby keys (the next position, the next seed, another stream) must not correlate.
    n = 200_000
    seed = int(torch.randint(0, 2**62, (1,), generator=gen)) + torch.arange(n)
    pos = torch.randint(0, 10_000, (n,), generator=gen)
    u = draws.uniform(seed, pos, draws.ACCEPT)
    bins = torch.histc(u, 20, 0, 1)
    assert chi2_p(bins.long(), torch.full((20,), 0.05)) > ALPHA
    assert float(u.min()) > 0 and float(u.max()) < 1
    for other in (draws.uniform(seed, pos + 1, draws.ACCEPT), draws.uniform(seed + 1, pos, draws.ACCEPT),
                  draws.uniform(seed, pos, draws.TARGET)):
        assert abs(float(torch.corrcoef(torch.stack([u, other]))[0, 1])) < 0.02
    e = draws.noise(seed[:64], pos[:64], draws.DRAFT, 4099)
    assert abs(float(e.mean()) - 1.0) < 0.01 and bool((e > 0).all())
    # a row's 32-bit hashes are a bijection of the index; of the 23 bits kept, a few of 4,099 may coincide
    assert all(row.unique().numel() >= 4090 for row in e[:4])

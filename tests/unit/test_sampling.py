"""Sampling ops (issue 34, graphctl/ops/sampling.py): temperature / top-k / top-p filtering against a
direct computation, exact draws (chi-square), and speculative sampling whose emitted tokens follow the
target's distribution for an oracle and a deliberately bad draft.

Statistical tests: each compares observed counts with the expected ones by Pearson's chi-square and
fails below a p-value of ``ALPHA`` = 1e-6: with a fresh seed, a correct implementation fails one such
check in a million (the seeds below are fixed, so a run is reproducible; the bound is what a new seed
risks). Draw counts make a wrong distribution fail by hundreds of standard deviations (checked by
breaking the acceptance rule on purpose)."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl.ops import draws
from graphctl.ops.sampling import probs_from_logits, race, sample, speculative_accept

ALPHA = 1e-6


def chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (cells of zero probability
    must have zero counts; they are left out, as are their degrees of freedom)."""
    counts, probs = counts.double(), probs.double()
    live = probs > 0
    assert int(counts[~live].sum()) == 0, f"draws where the probability is 0: {counts}"
    exp = probs[live] * counts.sum()
    stat = ((counts[live] - exp) ** 2 / exp).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 33), (13, 257)])
def test_filtering_equals_a_direct_computation(rows, vocab, dtype, gen):
    # Regression: issue 34, temperature/top-k/top-p filtering must equal the definitions, every dtype, odd sizes.
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    x = logits.float()
    for t, k, p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.8, 3, 0.5), (3.0, 6, 0.8)):
        got = probs_from_logits(logits, t, k, p)
        want = torch.zeros(rows, vocab)
        for r in range(rows):
            z = x[r] / t
            if k:
                keep = z >= z.topk(min(k, vocab)).values[-1]
                z = z.masked_fill(~keep, float("-inf"))
            q = torch.softmax(z, -1)
            if p < 1:
                order = q.argsort(descending=True)
                cum = q[order].cumsum(0) - q[order]
                least = q[order][cum < p][-1]  # the least likely kept token: its ties are kept with it
                q2 = torch.where(q >= least, q, 0.0)
                q = q2 / q2.sum()
            want[r] = q
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    greedy = probs_from_logits(logits, 0.0, 5, 0.3)
    assert torch.equal(greedy.argmax(-1), x.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(rows))
    # per-row device settings equal the same settings given row by row
    ts, ks, ps = torch.rand(rows, generator=gen) + 0.2, torch.randint(0, 6, (rows,), generator=gen), \
        torch.rand(rows, generator=gen) * 0.8 + 0.2
    ts[0], ps[-1] = 0.0, 1.0  # a greedy row and a row with top-p off, as a mixed batch holds them (issue 53)
    per_row = probs_from_logits(logits, ts, ks, ps)
    for r in range(rows):
        one = probs_from_logits(logits[r:r + 1], float(ts[r]), int(ks[r]), float(ps[r]))
        torch.testing.assert_close(per_row[r:r + 1], one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_keeps_every_token_tied_with_the_least_likely_kept_one(dtype, gen):
    # Regression: issue 34, top-p split tied tokens by sort order (an unstable sort: a different set per device).
    vocab = 41
    logits = torch.randn(3, vocab, generator=gen).to(dtype)
    logits[:, :6] = 4.0  # six tokens tied at the top: together about 0.9 of the mass
    p = torch.softmax(logits.float(), -1)
    one = float(p[0, 0])  # top_p inside the second tied token's share: the sort keeps two, all six must stay
    got = probs_from_logits(logits, 1.0, 0, 1.5 * one)
    assert torch.equal((got > 0).sum(-1), torch.full((3,), 6)), got
    torch.testing.assert_close(got[:, :6], torch.full((3, 6), 1 / 6))


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5},
                                 {"temperature": True}, {"top_k": "3"}])
def test_bad_settings_are_clear_errors(bad):
    # Regression: issue 34, a negative temperature or a top_p of 0 must not silently sample garbage.
    with pytest.raises(ValueError, match=next(iter(bad))):
        probs_from_logits(torch.randn(2, 5), **bad)


def test_noise_of_the_wrong_shape_is_a_clear_error(gen):
    # Regression: issue 34, the race kernel indexes the noise by row: too few rows or another vocabulary would
    # read past it (the reference's broadcast error named neither shape).
    p = torch.softmax(torch.randn(3, 10, generator=gen), -1)

    def noise(rows: int, vocab: int) -> torch.Tensor:
        return draws.noise(torch.randint(0, 99, (rows,), generator=gen), torch.arange(rows), draws.TARGET, vocab)

    for bad in (noise(2, 10), noise(3, 11), noise(3, 10)[:, 0]):
        with pytest.raises(ValueError, match=r"race: noise of shape .* expected \[>= 3, 10\]"):
            race(p, bad)
    assert race(p, noise(5, 10)).shape == (3,)  # more rows than needed: the first ones
    with pytest.raises(ValueError, match="race: noise on meta for probabilities on cpu"):
        race(p, torch.empty(3, 10, device="meta"))


def _keys(gen, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` requests' fresh seeds (distinct) and positions."""
    base = int(torch.randint(0, 2**40, (1,), generator=gen))
    return base + torch.arange(n), torch.randint(0, 4000, (n,), generator=gen)


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_sample_draws_from_the_distribution_and_is_keyed(over, gen):
    # Regression: issue 34 / 53, sample() must be an exact draw (chi-square), never a zero-probability token, and a
    # function of its keys: over many requests at one position, or one request over many positions.
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 40_000
    seed, pos = _keys(gen, n)
    if over == "positions":
        seed, pos = seed[:1].expand(n), pos[0] + torch.arange(n)
    else:
        pos = pos[:1].expand(n)
    tokens = sample(p.expand(n, 5), seed, pos)
    assert chi2_p(torch.bincount(tokens, minlength=5), p) > ALPHA
    a = sample(p.expand(64, 5), seed[:64], pos[:64])
    assert torch.equal(a, tokens[:64])
    assert not torch.equal(a, sample(p.expand(64, 5), seed[:64] + 1, pos[:64]))
    assert not torch.equal(a, sample(p.expand(64, 5), seed[:64], pos[:64], draws.DRAFT))  # another stream


def _speculative(target_p: torch.Tensor, draft_q: torch.Tensor, n: int, seed: int):
    """``n`` rows of one speculative step: the target's distribution ``target_p`` [k+1, V] at each
    position, the draft's ``draft_q`` [k, V]; drafts drawn from the draft."""
    k1, vocab = target_p.shape
    seeds, pos = seed * n + torch.arange(n), torch.full((n,), 50)
    # each draft keyed as the engine keys it: its request's seed, its own position, the draft stream
    at = (pos[:, None] + torch.arange(k1 - 1)).reshape(-1)
    drafts = sample(draft_q.expand(n, k1 - 1, vocab).reshape(-1, vocab), seeds.repeat_interleave(k1 - 1), at,
                    draws.DRAFT).view(n, k1 - 1)
    return drafts, *speculative_accept(target_p.expand(n, k1, vocab), draft_q.expand(n, k1 - 1, vocab), drafts, seeds,
                                      pos)


def _emitted_at(j: int, drafts, accepted, token):
    """The tokens emitted at position j, over the rows that emit one there."""
    rows = accepted >= j + 1
    return torch.where(accepted[rows] - 1 > j, drafts[rows, min(j, drafts.shape[1] - 1)], token[rows])


@pytest.mark.parametrize("draft", ["oracle", "bad", "disjoint"])
def test_speculative_sampling_keeps_the_targets_distribution(draft, gen):
    # Regression: issue 34, speculative sampling must emit the target's distribution at every position, for an oracle
    # draft (all accepted), a bad one (acceptance < k + 1) and one whose support misses the target's mass.
    k, vocab, n = 3, 5, 60_000
    g = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)  # a different law at each position
    q = {"oracle": target[:k],
         "bad": torch.softmax(torch.randn(k, vocab, generator=g) * 2.5, -1),
         "disjoint": torch.tensor([[0.0, 0.0, 0.1, 0.9, 0.0]] * k)}[draft]
    drafts, accepted, token = _speculative(target, q, n, seed=17)
    assert int(accepted.min()) >= 1 and int(accepted.max()) <= k + 1
    if draft == "oracle":
        assert bool((accepted == k + 1).all())  # min(1, p/q) = 1: every draft kept
    else:
        assert float(accepted.float().mean()) < k + 1 - 0.5
    for j in range(k + 1):
        at = _emitted_at(j, drafts, accepted, token)
        if at.numel() < 2000:
            continue  # too few rows reach position j (the disjoint draft rarely gets that far)
        assert chi2_p(torch.bincount(at, minlength=vocab), target[j]) > ALPHA, (draft, j)


def test_speculative_sampling_with_one_hot_laws_is_greedy_verification(gen):
    # Regression: issue 34, temperature 0 through the same code: exact greedy acceptance and the target's argmax.
    n, k, vocab = 50, 4, 11
    tl = torch.randn(n, k + 1, vocab, generator=gen)
    dl = tl[:, :k] + torch.randn(n, k, vocab, generator=gen) * 2  # the draft often disagrees
    t = probs_from_logits(tl.reshape(-1, vocab), 0.0).view(n, k + 1, vocab)
    q = probs_from_logits(dl.reshape(-1, vocab), 0.0).view(n, k, vocab)
    drafts = dl.argmax(-1)
    accepted, token = speculative_accept(t, q, drafts, *_keys(gen, n))
    best = tl.argmax(-1)
    want = 1 + (drafts == best[:, :k]).long().cumprod(1).sum(1)
    assert torch.equal(accepted, want)
    assert torch.equal(token, best.gather(1, (want - 1)[:, None])[:, 0])


def test_sampling_replays_from_a_graph_as_eager_from_the_same_keys(gen):
    # Regression: issue 34 / 53, a captured sampling step draws by its keys at every replay as eager does: the keys
    # are read from their buffers at each replay (no random offsets baked into the graph).
    w = torch.randn(6, 9, generator=gen) * 0.1  # flat logits: every row keeps several tokens after top-k/top-p
    seed, pos = _keys(gen, 4)

    def step(x):
        return sample(probs_from_logits(x @ w, 0.8, 4, 0.9), seed, pos)

    run = graphctl.graphed(step, buckets=[4], backend="emulated", progress=False)
    x = torch.randn(4, 6, generator=gen)
    run.capture_all(x)
    replayed, eager = [], []
    for _ in range(5):
        pos.add_(1)
        replayed.append(run(x).clone())
        eager.append(step(x))
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))
    assert len({tuple(t.tolist()) for t in eager}) > 1  # the draws do change from position to position


def _engine(device: str, oracle: bool):
    from graphctl.models import EngineConfig, MTPEngine

    return MTPEngine(EngineConfig(draft_len=3, max_seqs=4, max_context=160), device=device, oracle=oracle)


def _graphed_sample_step(eng, backend: str):
    from graphctl import StaticInput

    k = eng.k
    return graphctl.graphed(eng.sample_step, buckets=[1, 2, 4], state=eng.state, backend=backend, progress=False,
                            inputs=[StaticInput("input_ids", per_item=k + 1), StaticInput("draft_probs", per_item=k)],
                            params=eng.named_tensors())


@pytest.mark.parametrize("oracle", [True, False])
def test_seeded_sampling_is_the_same_eager_and_graphed(oracle, backend, gen):
    # Regression: issue 34, the engines decoded greedily only: sampling in the captured step, the same tokens eager
    # and graphed for one seed (bucket-padded batch of 3), other tokens for another seed.
    from graphctl.models import Sampling

    dev = "cuda" if backend == "cuda" else "cpu"
    eng = _engine(dev, oracle)
    s = Sampling(temperature=0.8, top_p=0.9)
    prompts = eng.prompts(3, gen)
    step = _graphed_sample_step(eng, backend)
    eager = eng.sample(prompts, 6, s, seed=7)
    graphed = eng.sample(prompts, 6, s, forward=step, seed=7)
    assert [t.tolist() for t in graphed] == [t.tolist() for t in eager]
    assert [t.tolist() for t in eng.sample(prompts, 6, s, seed=8)] != [t.tolist() for t in eager]
    assert sum(b.replays for b in step.report().buckets) == 6 and step.report().random_state == ()


@pytest.mark.parametrize("mode", ["unrolled", "per_step", "device_loop"])
def test_seeded_sampling_is_the_same_in_every_loop_mode(mode, backend, gen):
    # Regression: issue 34 / 53, per_step and device_loop drafted greedily only; a WHILE body replays the same kernels
    # each iteration, so a draw inside it must be keyed by the position, not taken from a generator's offsets.
    from graphctl.models import RequestSettings, graphed_step

    if mode == "device_loop" and backend != "cuda":
        pytest.skip("device_loop needs CUDA")
    eng = _engine("cuda" if backend == "cuda" else "cpu", oracle=False)
    prompts = eng.prompts(3, gen)
    step = graphed_step(eng, mode, buckets=(1, 2, 4), backend=backend, sampling=True)
    # the engine's wide margins: at 0.8 the draws hardly vary
    hot = RequestSettings.of(3, temperature=2.0, top_p=0.95, seed=7)
    eager = eng.sample(prompts, 6, hot)
    graphed = eng.sample(prompts, 6, hot, forward=step)
    assert [t.tolist() for t in graphed] == [t.tolist() for t in eager]
    other = RequestSettings.of(3, temperature=[2.0, 0.0, 1.5], top_k=[0, 0, 5], top_p=0.95, seed=8)  # one graph
    again = eng.sample(prompts, 6, other, forward=step)
    assert [t.tolist() for t in again] == [t.tolist() for t in eng.sample(prompts, 6, other)]
    assert [t.tolist() for t in again] != [t.tolist() for t in eager]


@pytest.mark.parametrize("mode", ["unrolled", "per_step"])
def test_the_deprecated_baked_setting_warns_works_and_refuses_another_value(mode, gen):
    # Regression: issue 53, graphed_step(sampling=Sampling(...)) baked its settings; it keeps working (deprecated),
    # draws the same tokens as eager, and a call with other settings is refused rather than silently served.
    from graphctl.models import Sampling, graphed_step

    eng = _engine("cpu", oracle=False)
    prompts = eng.prompts(3, gen)
    s = Sampling(temperature=2.0, top_p=0.95)
    with pytest.warns(DeprecationWarning, match="sampling=True"):
        step = graphed_step(eng, mode, buckets=(1, 2, 4), backend="emulated", sampling=s)
    assert [t.tolist() for t in eng.sample(prompts, 4, s, forward=step, seed=7)] == \
        [t.tolist() for t in eng.sample(prompts, 4, s, seed=7)]
    with pytest.raises(graphctl.ReplayError if mode == "unrolled" else graphctl.SamplingError, match="sampling"):
        eng.sample(prompts, 1, Sampling(temperature=0.5), forward=step, seed=7)


def test_a_greedy_per_step_loop_called_like_a_sampled_step_is_a_clear_error(gen):
    # Regression: issue 34, a per_step loop takes (input_ids, meta) greedy and (input_ids, draft_probs, meta,
    # sampling) sampled; the other form must name what it expects, not fail inside the head's binding.
    from graphctl.models import Sampling, graphed_step

    eng = _engine("cpu", oracle=False)
    loop = graphed_step(eng, "per_step", buckets=(4,), backend="emulated")
    with pytest.raises(TypeError, match="input_ids, meta"):
        eng.sample(eng.prompts(2, gen), 1, Sampling(0.8), forward=loop, seed=1)
    with pytest.raises(graphctl.DeclarationError, match="sampling=True"):
        graphed_step(eng, "per_step", sampling=0.8)


def test_sampling_at_temperature_zero_is_the_greedy_decode(gen):
    # Regression: issue 34, temperature 0 must be today's greedy tokens through the sampled path.
    from graphctl.models import Sampling

    eng = _engine("cpu", oracle=False)
    prompts = eng.prompts(3, gen)
    greedy = eng.sample(prompts, 5, Sampling(0.0), forward=lambda ids, laws, m, s: eng.step(ids, m)._replace(
        draft_probs=laws))
    sampled = eng.sample(prompts, 5, Sampling(0.0), seed=3)
    assert [t.tolist() for t in sampled] == [t.tolist() for t in greedy]


def test_the_oracle_draft_is_always_accepted_when_sampling_and_a_bad_draft_is_not(gen):
    # Regression: issue 34, with p == q every draft is kept (min(1, p/q) = 1); a different draft loses some.
    from graphctl.models import Sampling

    s = Sampling(temperature=1.0)
    for oracle in (True, False):
        eng = _engine("cpu", oracle)
        prompts = eng.prompts(4, gen)
        first = sum(len(t) for t in eng.sample(prompts, 1, s, seed=1))  # the first step's drafts are placeholders
        emitted = sum(len(t) for t in eng.sample(prompts, 6, s, seed=1)) - first
        full = 5 * (eng.k + 1) * len(prompts)
        assert (emitted == full) if oracle else (emitted < full), (oracle, emitted, full)


def test_sampling_settings_are_checked():
    # Regression: issue 34, a bad setting is a clear error where the Sampling is made, not garbage later.
    from graphctl.models import Sampling

    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)


def test_a_frozen_settings_record_is_a_frozen_argument_compared_by_value(gen):
    # Regression: issue 34, generate() makes a new Sampling per call: compared by identity, the second call's equal
    # settings were refused as "a frozen argument differs" (found by bench/hf_speculative.py).
    from graphctl.models import Sampling

    def fwd(x, s):
        return probs_from_logits(x, s.temperature, s.top_k, s.top_p)

    run = graphctl.graphed(fwd, buckets=[2], backend="emulated", progress=False, inputs=["x"])
    x = torch.randn(2, 7, generator=gen)
    run.capture_all(x, Sampling(0.8, 3, 0.9))
    torch.testing.assert_close(run(x, Sampling(0.8, 3, 0.9)).clone(), fwd(x, Sampling(0.8, 3, 0.9)))
    with pytest.raises(graphctl.ReplayError, match="frozen argument differs") as err:
        run(x, Sampling(0.5, 3, 0.9))
    assert "temperature=0.8" in err.value.expected and "temperature=0.5" in str(err.value.found)


@pytest.mark.parametrize("bad, name", [({"temperature": float("inf"), "top_k": 2}, "temperature"),
                                       ({"temperature": float("nan")}, "temperature"),
                                       ({"top_k": 2.7}, "top_k"), ({"top_p": float("nan")}, "top_p")])
def test_edge_settings_are_typed_errors_not_silent_garbage(bad, name):
    # Regression: issue 53, temperature inf with top_k=2 kept every token; top_k=2.7 was taken as 2.
    import graphctl

    with pytest.raises(graphctl.SamplingError) as ei:
        probs_from_logits(torch.randn(2, 5), **bad)
    assert ei.value.buffer == name and isinstance(ei.value, ValueError) and "Fix:" in str(ei.value)


@pytest.mark.parametrize("t", [1e-39, 1e-30, 9e-6])
def test_a_temperature_below_the_floor_is_greedy_not_nan(t, gen):
    # Regression: issue 53, temperature 1e-39 turned every row into NaN and drew token 0.
    from graphctl.ops.sampling import TEMPERATURE_FLOOR, sample

    logits = torch.randn(4, 33, generator=gen) * 5
    got = probs_from_logits(logits, t)
    assert t < TEMPERATURE_FLOOR and not got.isnan().any()
    assert torch.equal(got, torch.nn.functional.one_hot(logits.argmax(-1), 33).float())
    assert torch.equal(sample(got, *_keys(gen, 4)), logits.argmax(-1))
    per_row = probs_from_logits(logits, torch.tensor([t, 0.0, 1.0, t]))  # per-row device settings: the same floor
    assert not per_row.isnan().any() and torch.equal(per_row[0], got[0]) and torch.equal(per_row[3], got[3])

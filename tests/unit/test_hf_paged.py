"""Unchanged Hugging Face models on graphctl's paged backend (graphctl/integrations/hf): greedy
tokens equal transformers' own eager ``generate`` token for token, plain and speculative, eager and
graphed; the acceptance oracle in every CPU loop mode; verify and audit clean; the seeded stale
map caught and costing acceptance as the batch grows. CPU, fp32, tiny random configs (the H200
runs ``tests/cuda/test_hf_paged_cuda.py``)."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import Recompute, StaleBufferError, StateSpec, StaticInput
from graphctl.families.paged import paged_spec, token_map_

transformers = pytest.importorskip("transformers")

from graphctl.integrations.hf import HFEngine  # noqa: E402
from graphctl.integrations.hf.configs import hf_config  # noqa: E402
from graphctl.models import graphed_step  # noqa: E402
from support import hf  # noqa: E402

NEW = 10


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2"])
@pytest.mark.parametrize("k", [0, 3])
def test_tokens_equal_transformers_generate(name, k, gen):
    # Issue 18: graphctl's paged attention must reproduce transformers' own greedy tokens, ragged batch of 3.
    seed = hf.seed_of(gen)
    eng = hf.engine(name, k, seed)
    prompts = hf.prompts(3, gen)
    got = eng.generate(prompts, NEW)
    assert [t.tolist() for t in got.tokens] == hf.reference(eng, name, prompts, NEW)
    if k:
        assert all(torch.equal(a, torch.full_like(a, k + 1)) for a in got.accepted[1:]), got.accepted
        # Regression: issue 55, mean_accepted counted the first step's placeholder drafts (3.25 with an oracle that
        # accepts every draft): only steps whose drafts a draft proposed count.
        assert got.placeholder_steps == 1 and got.mean_accepted == k + 1, (got.mean_accepted, got.accepted)


@pytest.mark.parametrize("bs", [1, 3, 8])
def test_graphed_decode_and_speculative_equal_transformers(bs, gen):
    # Issue 18: the graphed steps (emulated recorder here, CUDA graphs under -m cuda) at bucket and non-bucket
    # batch sizes give transformers' tokens too.
    seed = hf.seed_of(gen)
    prompts = hf.prompts(bs, gen)
    want = None
    for k in (0, 3):
        eng = hf.engine("tiny-llama", k, seed)
        if want is None:
            want = hf.reference(eng, "tiny-llama", prompts, NEW)
        if k == 0:
            step = graphctl.graphed(eng.decode_step, buckets=[1, 2, 4, 8], state=eng.state, backend="emulated",
                                    inputs=[StaticInput("input_ids")], progress=False, params=eng.named_tensors())
        else:
            step = graphed_step(eng, "unrolled", buckets=(1, 2, 4, 8), backend="emulated")
        got = eng.generate(prompts, NEW, forward=step)
        assert [t.tolist() for t in got.tokens] == want, k
        # every step replayed, and one more: launched before the last one's results were read (issue 32), dropped
        assert sum(b.replays for b in step.report().buckets) == got.steps + 1


@pytest.mark.parametrize("name,mode,k", [("tiny-llama", m, k) for m in ("unrolled", "per_step") for k in (1, 3, 7)]
                         + [("tiny-qwen3", "unrolled", 3), ("tiny-qwen2", "per_step", 3)])
def test_every_draft_accepted_with_the_oracle_draft(name, mode, k, gen):
    # Issue 18 acceptance oracle: the target's own first layers as the draft accept k+1 tokens every step, at
    # every batch size (one set of graphs serves 1, 3 and 8).
    hf.assert_oracle(name, k, mode, gen, backend="emulated")


def test_verify_and_audit_clean_on_the_hf_step(gen):
    # Issue 18: eager vs replay on fresh token ids at every bucket (every cache write compared), and no audit
    # finding: the HF model's weights and both paged caches are known params, nothing dangling or unregistered.
    seed = hf.seed_of(gen)
    eng = hf.engine("tiny-qwen3", 3, seed)
    m, st = eng.meta, eng.state
    m.prepare(st, torch.full((5,), 4, dtype=torch.int32), torch.randint(4, 40, (5,), generator=gen, dtype=torch.int32))
    f = graphed_step(eng, "unrolled", buckets=(2, 4, 8), backend="emulated")
    f.capture_all(torch.randint(0, 128, (20,), generator=gen), m)
    results = f.verify(gen=gen, writes="error")
    assert len(results) >= 3 and all(r.ok for r in results), [str(r) for r in results]
    audits = f.audit(params=eng.named_tensors())
    findings = [str(x) for a in audits.values() for x in a.findings]
    assert set(audits) == {2, 4, 8} and not findings, findings
    rep = f.report()
    assert not rep.padding_hazards and not rep.host_changes and not rep.unreached, rep


def _stale_engine(k: int, seed: int) -> HFEngine:
    holder: dict = {}
    spec = StateSpec("paged-stale-map-hf", extends=paged_spec(block_size=8))
    spec.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32, override=True,
                derive=Recompute(["kv_cache_manager"], lambda out, _mgr: token_map_(out, holder["meta"].seq_lens)
                                 if "meta" in holder else out.zero_()))  # reads seq_lens behind graphctl's back
    eng = hf.engine("tiny-llama", k, seed, spec=spec)
    holder["meta"] = eng.meta
    return eng


def test_seeded_stale_map_is_caught_and_costs_acceptance_as_batch_grows(gen):
    # Issue 18 (TensorRT-LLM #16925 on real model code): a token map not recomputed after the k+1 -> 1 layout
    # write is caught by the debug check, and without it acceptance falls once several requests share a batch.
    seed = hf.seed_of(gen)
    eng = _stale_engine(3, seed)
    with graphctl.knobs.scope(check_stale=True), pytest.raises(StaleBufferError, match="req_idx_per_token"):
        eng.generate(hf.prompts(8, gen), 9)
    by_bs = {}
    for bs in (1, 8):
        eng = _stale_engine(3, seed)
        got = eng.generate(hf.prompts(bs, torch.Generator().manual_seed(seed)), 9)
        by_bs[bs] = float(torch.cat(got.accepted[1:]).float().mean())
    assert by_bs[1] == 4.0, by_bs  # one request: every token maps to request 0, the bug hides
    assert by_bs[8] < 4.0, by_bs


def test_eos_and_max_length_per_request(gen):
    # Issue 18 generate loop: a request that emits EOS stops there (EOS kept), the others run to max_new_tokens.
    seed = hf.seed_of(gen)
    eng = hf.engine("tiny-llama", 3, seed)
    prompts = hf.prompts(3, gen)
    free = eng.generate(prompts, NEW)
    eos = int(free.tokens[1][4])  # request 1's fifth token
    got = eng.generate(prompts, NEW, eos_token_id=eos)
    for r, (a, b) in enumerate(zip(free.tokens, got.tokens)):
        cut = a.tolist().index(eos) + 1 if eos in a.tolist() else NEW
        assert b.tolist() == a.tolist()[:cut], r


def test_generate_reports_prefill_and_decode_time(gen):
    # Issue 18 generate loop: per-step latency for users (the benchmark reads it): both phases timed, apart.
    import time

    eng = hf.engine("tiny-llama", 3, hf.seed_of(gen))
    t0 = time.perf_counter()
    res = eng.generate(hf.prompts(2, gen), NEW)
    wall = time.perf_counter() - t0
    assert res.prefill_s > 0 and res.decode_s > 0 and res.steps > 0
    assert res.prefill_s + res.decode_s <= wall


def test_models_without_paged_attention_are_refused():
    # Issue 18: an HF model built with another attention would read no paged cache; refused with the fix.
    cfg = hf_config("tiny-llama")
    plain = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with pytest.raises(ValueError, match="attn_implementation='graphctl_paged'"):
        HFEngine(plain, plain)


@pytest.mark.parametrize("prompts,max_new,err,why", [
    (torch.tensor([1, 2, 3]), 4, TypeError, "non-empty list"),
    ([], 4, TypeError, "non-empty list"),
    ([torch.tensor([1.0, 2.0])], 4, TypeError, "prompt 0: expected a 1-D integer tensor"),
    ([torch.tensor([[1, 2]])], 4, TypeError, "prompt 0: expected a 1-D integer tensor"),
    ([torch.tensor([1]), torch.tensor([], dtype=torch.int64)], 4, ValueError, "prompt 1 is empty"),
    ([torch.tensor([1, 500])], 4, ValueError, r"token ids must be in \[0, 128\)"),
    ([torch.tensor([1, 2]), torch.tensor([3, -1]), torch.tensor([200])], 4, ValueError,
     r"prompt 1: token ids must be in \[0, 128\), found \[-1, 3\]"),
    ([torch.tensor([1])] * 9, 4, ValueError, "max_seqs=8"),
    ([torch.tensor([1])], 0, ValueError, "max_new_tokens"),
    ([torch.tensor([1])], 60, ValueError, "max_context=64 too small"),
])
def test_bad_generate_input_is_a_clear_error_and_leaves_the_engine_usable(prompts, max_new, err, why, gen):
    # Issue 18: what a user passes by mistake gets a typed error naming it, before anything runs.
    eng = hf.engine("tiny-llama", 3, hf.seed_of(gen))
    with pytest.raises(err, match=why):
        eng.generate(prompts, max_new)
    assert eng.state.poisoned is None and eng.state.active_phase is None
    ps = hf.prompts(2, gen)
    assert [t.tolist() for t in eng.generate(ps, 4).tokens] == hf.reference(eng, "tiny-llama", ps, 4)


def test_buckets_larger_than_the_engine_are_a_clear_error_before_anything_runs(gen):
    # Regression (issue 18): graphed_step with buckets up to 8 on an engine of max_seqs 4 failed inside the model
    # with "The size of tensor a (32) must match the size of tensor b (16)"; it must name the buffer and the fix.
    eng = HFEngine.build(hf_config("tiny-llama"), draft_len=3, max_seqs=4, max_context=64, block_size=8,
                         seed=hf.seed_of(gen))
    step = graphed_step(eng, "unrolled", buckets=(1, 2, 4, 8), backend="emulated")
    with pytest.raises(graphctl.DeclarationError, match="largest bucket does not fit") as info:
        eng.generate(hf.prompts(3, gen), 6, forward=step)
    assert "capture buckets up to 4" in str(info.value) and not step.captured


def test_compiled_engine_graphed_equals_eager_and_reports_no_weight(gen):
    # Regression: issue 28, a compiled HF model under graphctl ran uncompiled, and its unreached-tensor report listed
    # every weight (one ~100 kB warning line).
    torch._dynamo.reset()
    eng = HFEngine.build(hf_config("tiny-llama"), draft_len=1, max_seqs=2, device="cpu", compile="aot_eager")
    ref = HFEngine.build(hf_config("tiny-llama"), draft_len=1, max_seqs=2, device="cpu")
    prompts = [torch.randint(3, eng.cfg.vocab, (n,), generator=gen) for n in (5, 7)]
    step = graphed_step(eng, mode="unrolled", buckets=[2], backend="emulated")
    got = eng.generate(prompts, 4, forward=step)
    want = ref.generate(prompts, 4)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    rep = step.report()
    assert set(rep.compiled) == {"self.target_layers.forward", "self.draft_layers.forward"}, rep.compiled
    assert rep.uncompiled == 0 and rep.unreached == () and rep.host_changes == (), rep
    names = step.graph(2).op_names()  # each compiled model recorded as the code it compiles (issue 51), op by op
    assert not any(n.startswith("compiled:") for n in names) and names.count("graphctl::paged_attention") >= 2, names
    torch._dynamo.reset()


@pytest.mark.parametrize("budget", [2048, 7])
def test_prefill_is_one_ragged_pass_chunked_only_above_its_token_budget(budget, gen, monkeypatch):
    # Issue 32: a prompt of L tokens was prefilled k + 1 tokens a pass (L / (k + 1) eager passes of both models);
    # now every prompt goes in one ragged forward, and only a budget smaller than the prompts chunks it (never
    # below a step's tokens, max_seqs * (k + 1) = 32 here: those buffers exist anyway).
    eng = hf.engine("tiny-qwen3", 3, hf.seed_of(gen), prefill_tokens=budget)
    budget = eng.meta.max_tokens
    ps = [torch.randint(0, 128, (n,), generator=gen) for n in (13, 9, 12, 11, 7)]
    total = sum(len(p) for p in ps)
    passes = []
    real = eng.run_layers
    monkeypatch.setattr(eng, "run_layers", lambda tokens, model, *a, **k: passes.append(
        (model is eng.target_layers, tokens.shape[0])) or real(tokens, model, *a, **k))
    first = eng.prefill(ps)
    target = [n for is_target, n in passes if is_target]
    assert sum(target) == total and max(target) <= budget
    assert len(target) == (1 if budget >= total else -(-total // budget)), target
    monkeypatch.undo()
    want = hf.reference(eng, "tiny-qwen3", ps, 6)
    assert first.tolist() == [w[0] for w in want]
    assert [t.tolist() for t in eng.generate(ps, 6).tokens] == want  # both caches filled right: drafts all accepted


def test_prefill_tokens_is_checked():
    # Issue 32: the budget sizes the metadata's token buffers; a bad one is named before anything is built.
    with pytest.raises(ValueError, match="prefill_tokens"):
        hf.engine("tiny-llama", 3, 0, prefill_tokens=0)


@pytest.mark.parametrize("k", [0, 3])
def test_lengths_advanced_on_the_device_equal_the_host_path(k, gen):
    # Issue 32: the loop advanced lengths on the host from accepted counts read back every step; now the device
    # adds them. Each step must see kv_lens = prompt + every earlier step's accepted count + this step's tokens.
    eng = hf.engine("tiny-qwen3", k, hf.seed_of(gen))
    ps = hf.prompts(4, gen)
    seen = []

    def forward(ids, meta):
        seen.append(meta.kv_lens[:len(ps)].clone())
        return (eng.decode_step if k == 0 else eng.step)(ids, meta)

    got = eng.generate(ps, 8, forward=forward)
    context = torch.tensor([len(p) for p in ps], dtype=torch.int32)
    assert len(seen) == got.steps + 1  # the step past the last one ran, dropped
    for step, kv in enumerate(seen[:got.steps]):
        assert torch.equal(kv, context + k + 1), (step, kv, context)
        context = context + got.accepted[step].to(torch.int32)
    assert [t.tolist() for t in got.tokens] == hf.reference(eng, "tiny-qwen3", ps, 8)


@pytest.mark.parametrize("piecewise", [False, True])
def test_graphed_prefill_at_token_buckets_gives_transformers_tokens(piecewise, backend, gen):
    # Regression: issue 33, the HF engine's prefill ran eagerly only; graphed at token buckets (attention in the graph,
    # or piecewise: each layer's attention an eager region, the draft's inside its switch) it gives the same tokens.
    seed = hf.seed_of(gen)
    dev = "cuda" if backend == "cuda" else "cpu"
    eng = HFEngine.build(hf_config("tiny-llama"), draft_len=3, max_seqs=4, max_context=96, block_size=8, seed=seed,
                         device=dev, prefill_tokens=32)
    pre = eng.graphed_prefill(backend=backend, piecewise=piecewise)  # captured at its first call
    for lens in ((5, 11, 3), (20, 19)):  # one pass at a padded bucket; chunked past prefill_tokens (39 > 32)
        prompts = [torch.randint(3, eng.cfg.vocab, (n,), generator=gen).to(dev) for n in lens]
        got = eng.generate(prompts, 5, prefill=pre)
        assert [t.tolist() for t in got.tokens] == hf.reference(eng, "tiny-llama", prompts, 5), lens
    rep = pre.report()
    assert pre.captured == (16, 32) and all(b.replays > 0 for b in rep.buckets) and pre.fallbacks == {}
    layers = eng.target_layers.config.num_hidden_layers + eng.draft_layers.config.num_hidden_layers
    assert {b.pieces for b in rep.buckets} == ({layers + 1} if piecewise else {1})


def test_piecewise_prefill_of_a_compiled_model_splits_at_its_attention(backend, gen):
    # Regression: issue 51, dynamo traced through an eager region inside a compiled model, so piecewise=True was refused
    # by name; now each attention call is a graph break and the compiled models are captured as pieces around them.
    torch._dynamo.reset()
    dev = "cuda" if backend == "cuda" else "cpu"
    eng = HFEngine.build(hf_config("tiny-llama"), draft_len=1, max_seqs=2, max_context=64, device=dev,
                         compile="aot_eager", prefill_tokens=16, seed=hf.seed_of(gen))
    prompts = [torch.randint(3, eng.cfg.vocab, (n,), generator=gen).to(dev) for n in (5, 7)]
    want = eng.generate(prompts, 3)
    for piecewise in (True, False):
        pre = eng.graphed_prefill(buckets=[16], backend=backend, piecewise=piecewise)
        got = eng.generate(prompts, 3, prefill=pre)
        assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens], piecewise
        rep = pre.report()
        layers = eng.target_layers.config.num_hidden_layers + eng.draft_layers.config.num_hidden_layers
        assert rep.uncompiled == 0 and [b.pieces for b in rep.buckets] == [layers + 1 if piecewise else 1], str(rep)
        assert (rep.compile[16]["breaks"] >= layers) == piecewise, rep.compile
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("k, mode", [(0, ""), (3, "unrolled"), (3, "per_step"), (3, "device_loop")])
def test_seeded_sampling_gives_the_same_tokens_eager_and_graphed(name, k, mode, backend, gen):
    # Regression: issue 34, the HF engine decoded greedily only: sampled at temperature 0.8, top-p 0.9, one seed gives
    # the same tokens eager and graphed in every loop mode (a padded bucket: 3 requests in bucket 4), another seed
    # other tokens.
    if mode == "device_loop" and backend != "cuda":
        pytest.skip("device_loop needs CUDA")
    dev = "cuda" if backend == "cuda" else "cpu"
    eng = HFEngine.build(hf_config(name), draft_len=k, max_seqs=4, max_context=96, block_size=8,
                         seed=hf.seed_of(gen), device=dev)
    prompts = [p.to(dev) for p in hf.prompts(3, gen)]
    if k:
        step = graphed_step(eng, mode, buckets=(1, 2, 4), backend=backend, sampling=True)
    else:
        step = graphctl.graphed(eng.sample_decode_step, buckets=[1, 2, 4], state=eng.state, backend=backend,
                                inputs=[StaticInput("input_ids")], progress=False, params=eng.named_tensors())
    kw = dict(temperature=0.8, top_p=0.9)
    eager = eng.generate(prompts, 8, seed=5, **kw)
    graphed = eng.generate(prompts, 8, forward=step, seed=5, **kw)
    assert [t.tolist() for t in graphed.tokens] == [t.tolist() for t in eager.tokens]
    other = eng.generate(prompts, 8, seed=6, **kw)
    assert [t.tolist() for t in other.tokens] != [t.tolist() for t in eager.tokens]
    greedy = eng.generate(prompts, 8)
    assert [t.tolist() for t in eng.generate(prompts, 8, temperature=0.0, seed=5).tokens] == \
        [t.tolist() for t in greedy.tokens]
    head = step.head if mode == "per_step" else step
    assert head.report().random_state == ()  # keyed draws: no generator drawn from
    with pytest.raises(ValueError, match="top_p"):
        eng.generate(prompts, 2, temperature=0.8, top_p=0.0)


def test_the_direct_eager_path_writes_and_attends_as_the_ops_do(gen, monkeypatch):
    # Issue 32: the eager path's direct launches (CUDA only) are wired through the HF layer's views, its layer index
    # and the manager bound under the draft switch; here they run their references, forced on, against the ops.
    from graphctl.integrations.hf import attention as hf_attention
    from graphctl.ops import attention as ops

    eng = hf.engine("tiny-llama", 3, hf.seed_of(gen))
    ps = hf.prompts(5, gen)
    taken, build = [], hf_attention.PagedBatch.build
    monkeypatch.setattr(hf_attention.PagedBatch, "build", staticmethod(
        lambda *a, **k: taken.append(build(*a, **k)) or taken[-1]))
    runs = []
    for direct in (True, False):
        monkeypatch.setattr(ops, "direct", lambda t, on=direct: on)
        runs.append(hf.prefill_and_caches(eng, ps, gen))
        assert [b.direct for b in taken[-2:]] == [direct, direct]
    (a_first, a_logits, a_kv), (b_first, b_logits, b_kv) = runs
    assert torch.equal(a_first, b_first) and torch.equal(a_logits, b_logits)
    assert all(torch.equal(x, y) for x, y in zip(a_kv, b_kv))
    assert torch.equal(a_kv[0][:2], a_kv[1][:2])  # the oracle draft's layers are the target's first two: same keys


def test_per_step_capture_warns_about_nothing_it_cannot_act_on(caplog, gen):
    # Regression: issue 55, per_step printed "the reach walk left state out: 8 objects past depth 8", with nothing the
    # user could do about it (the forward read nothing past that depth).
    import logging

    with caplog.at_level(logging.INFO, logger="graphctl"):
        hf.assert_oracle("tiny-llama", 3, "per_step", gen, backend="emulated")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and "reach walk" in r.getMessage()]
    assert said == [], said


def test_a_refused_generate_changes_nothing_and_a_greedy_step_asked_to_sample_says_how(gen):
    # Regression: issue 53, a generate refused for a bad max_new_tokens had already reseeded both generators; the
    # natural call `generate(prompts, n, graphed_step(eng), temperature=0.8)` failed with a raw TypeError after the
    # prefill had drawn.
    import graphctl

    eng = hf.engine("tiny-llama", 3, hf.seed_of(gen))
    prompts = hf.prompts(3, gen)
    eng.generate(prompts, 2, temperature=[0.5, 0.9, 1.3], top_k=[0, 3, 0], top_p=[1.0, 1.0, 0.8], seed=11)
    meta = eng.meta

    def state():  # every per-request buffer, the caches and torch's default generator
        return [t.clone() for t in (meta.temperature, meta.top_k, meta.top_p, meta.seed, meta.kv_lens,
                                    meta.kv_cache_manager.k[0], torch.default_generator.get_state())]

    before = state()
    greedy = graphed_step(eng, "unrolled", buckets=(1, 2, 4), backend="emulated")
    refused = [dict(max_new_tokens=0, seed=5), dict(max_new_tokens=4, seed=-1, temperature=0.8),
               dict(max_new_tokens=4, top_k=2.7, seed=5), dict(max_new_tokens=4, temperature=float("inf"), seed=5),
               dict(max_new_tokens=4, temperature=[0.8, 0.8], seed=5),  # one value short
               dict(max_new_tokens=4, temperature=[0.8, -1.0, 0.8]),  # request 1's
               dict(max_new_tokens=4, temperature=[0.8, float("inf"), 0.8], top_k=2),
               dict(max_new_tokens=4, temperature=0.8, seed=[1, None, 3]),
               dict(max_new_tokens=0, temperature=0.8),  # a drawn seed: refused before it is drawn
               dict(max_new_tokens=4, forward=greedy, temperature=0.8)]
    for kw in refused:
        with pytest.raises(ValueError) as ei:  # SamplingError is a ValueError too
            eng.generate(prompts, **kw)
        assert all(torch.equal(a, b) for a, b in zip(before, state())), kw  # nothing written, nothing drawn
    assert isinstance(ei.value, graphctl.SamplingError) and "graphed_step(eng, sampling=True)" in str(ei.value)
    with pytest.raises(graphctl.SamplingError, match="request 1"):
        eng.generate(prompts, 4, temperature=[0.8, -1.0, 0.8])
    sampled = graphed_step(eng, "unrolled", buckets=(1, 2, 4), backend="emulated", sampling=True)
    got = eng.generate(prompts, 4, sampled, temperature=0.8, seed=5)  # the fix
    want = eng.generate(prompts, 4, temperature=0.8, seed=5)  # eager, the same seed: the same tokens
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]


@pytest.mark.parametrize("mode", ["unrolled", "per_step", "device_loop"])
def test_a_mixed_batch_is_each_request_s_own_run_and_greedy_rows_stay_greedy(mode, backend, device, gen):
    # Regression: issue 53, settings were baked per graph, so a batch could not mix greedy and sampled requests; one
    # graph now serves every mix, each request's tokens those it gets with its settings whatever its companions'
    # (compared at the same batch shape: only the other rows' settings change).
    if mode == "device_loop" and backend != "cuda":
        pytest.skip("device_loop needs CUDA")
    eng = hf.engine("tiny-llama", 3, hf.seed_of(gen), device=device)
    prompts = [p.to(device) for p in hf.prompts(3, gen)]
    step = graphed_step(eng, mode, buckets=(1, 2, 4), backend=backend, sampling=True)
    temps, seeds = [0.0, 1.3, 0.9], [21, 22, 23]
    mixed = eng.generate(prompts, 8, step, temperature=temps, top_p=[1.0, 0.9, 1.0], seed=seeds)
    greedy = eng.generate(prompts, 8)  # the greedy step, all rows greedy
    assert mixed.tokens[0].tolist() == greedy.tokens[0].tolist()
    # an all-greedy batch through the sampled graph (an H100 bench's bs 1 "mixed" run was refused as not greedy)
    assert [t.tolist() for t in eng.generate(prompts, 8, step).tokens] == [t.tolist() for t in greedy.tokens]
    for r in (1, 2):  # the same request with every other row greedy, or every row at its settings
        alone = [temps[r] if i == r else 0.0 for i in range(3)]
        solo = eng.generate(prompts, 8, step, temperature=alone, top_p=[1.0, 0.9, 1.0], seed=seeds)
        assert solo.tokens[r].tolist() == mixed.tokens[r].tolist(), r
    eager = eng.generate(prompts, 8, temperature=temps, top_p=[1.0, 0.9, 1.0], seed=seeds)
    assert [t.tolist() for t in eager.tokens] == [t.tolist() for t in mixed.tokens]
    assert mixed.tokens[1].tolist() != greedy.tokens[1].tolist() or mixed.tokens[2].tolist() != \
        greedy.tokens[2].tolist()  # the sampled rows did sample


def test_a_dynamic_compile_serves_every_bucket_of_two_or_more_from_one_graph_a_model(gen):
    # Regression: issue 54, each bucket compiled both models again (dynamic=False): 22-25 s a bucket for llama-1b on
    # an H100. compile_mode="dynamic": one graph a model for buckets 8, 4, 2 (duck sizing off: bucket 8 equal to the
    # block size had made dynamo compile again at 4), bucket 1 its own (sizes 0 and 1 are specialized).
    torch._dynamo.reset()
    # put back after the engine's change (not monkeypatch: its undo deletes a config module's entry)
    duck = torch.fx.experimental._config.use_duck_shape
    try:
        _dynamic_compile(gen)
    finally:
        torch.fx.experimental._config.use_duck_shape = duck
        torch._dynamo.reset()


def _dynamic_compile(gen) -> None:
    seed = hf.seed_of(gen)
    eng = hf.engine("tiny-llama", 3, seed, compile="eager", compile_mode="dynamic")
    prompts = hf.prompts(3, gen)
    step = graphed_step(eng, "unrolled", buckets=(1, 2, 4, 8), backend="emulated")
    got = eng.generate(prompts, 6, step)
    per = {b: st["warmup_graphs"] for b, st in step.report().compile.items()}
    assert per[8] == 2 and per[4] == 0 and per[2] == 0, per  # the target and the draft, once each
    assert step.report().uncompiled == 0
    want = hf.engine("tiny-llama", 3, seed).generate(prompts, 6)  # eager, uncompiled
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    with pytest.raises(ValueError, match="compile_mode"):
        hf.engine("tiny-llama", 3, 0, compile="eager", compile_mode="symbolic")

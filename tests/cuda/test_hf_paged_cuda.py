"""The Hugging Face integration on real CUDA graphs (issue 18): tokens equal transformers' eager
generate in fp32 and, under the bf16 tolerance policy below, in bf16; the acceptance oracle in all
three loop modes (``device_loop`` is CUDA only); verify and audit clean.

bf16 tolerance policy: graphctl's paged attention and transformers' eager attention sum in
different orders, so in bf16 a greedy choice can flip where the two best logits are within
rounding of each other. graphctl's tokens must equal transformers' up to the first step whose
top-two margin (transformers' own logits) is below ``BF16_MARGIN`` of the top logit's magnitude;
from that step on a request is no longer compared (the sequences legitimately part there). A
divergence at any step with a wider margin fails."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

import graphctl  # noqa: E402
from graphctl import StaticInput  # noqa: E402
from graphctl.models import graphed_step  # noqa: E402
from support.hf import assert_oracle, engine, prefill_and_caches, prompts, reference, reference_model, seed_of  # noqa: E402

NEW = 12
BF16_MARGIN = 2 ** -6  # a few bf16 ulps of the top logit


@pytest.mark.parametrize("bs", [3, 8])
def test_graphed_speculative_equals_transformers_fp32_on_cuda(bs, gen):
    seed = seed_of(gen)
    eng = engine("tiny-llama", 3, seed, device="cuda")
    ps = prompts(bs, gen)
    step = graphed_step(eng, "unrolled", buckets=(1, 2, 4, 8), backend="cuda")
    got = eng.generate(ps, NEW, forward=step)
    assert step.report().backend == "cuda"
    assert [t.tolist() for t in got.tokens] == reference(eng, "tiny-llama", ps, NEW)


def test_graphed_decode_bf16_within_the_tolerance_policy(gen):
    seed = seed_of(gen)
    eng = engine("tiny-qwen3", 0, seed, device="cuda", dtype=torch.bfloat16)
    ps = prompts(8, gen)
    step = graphctl.graphed(eng.decode_step, buckets=[1, 2, 4, 8], state=eng.state, backend="cuda",
                            inputs=[StaticInput("input_ids")], progress=False, params=eng.named_tensors())
    got = eng.generate(ps, NEW, forward=step)
    ref = reference_model(eng, "tiny-qwen3")
    compared = 0
    for p, tokens in zip(ps, got.tokens):
        with torch.no_grad():
            ids = p[None].cuda()
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        want = out.sequences[0, len(p):].tolist()
        for i, (a, b) in enumerate(zip(tokens.tolist(), want)):
            top2 = out.logits[i][0].float().topk(2).values
            if float(top2[0] - top2[1]) < BF16_MARGIN * float(top2[0].abs()):
                break  # a near-tie: the policy stops comparing this request here
            assert a == b, (i, tokens.tolist(), want)
            compared += 1
    # The policy must not excuse the whole run. Regression: the floor was NEW * 4 (48 of 96 tokens), which the
    # reference's own near-ties miss for 13 of 30 seeds (26-72 tokens compared, transformers' bf16 logits alone on
    # a CPU): a flaky bound on transformers, not a check of graphctl's tokens, which are compared above.
    assert compared >= NEW, compared


@pytest.mark.parametrize("mode", ["unrolled", "per_step", "device_loop"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_oracle_acceptance_in_every_loop_mode_on_cuda(mode, k, gen):
    assert_oracle("tiny-llama", k, mode, gen, backend="cuda", device="cuda")


def test_verify_and_audit_clean_on_cuda(gen):
    seed = seed_of(gen)
    eng = engine("tiny-qwen3", 3, seed, device="cuda", dtype=torch.bfloat16)
    m, st = eng.meta, eng.state
    m.prepare(st, torch.full((5,), 4, dtype=torch.int32), torch.randint(4, 40, (5,), generator=gen, dtype=torch.int32))
    f = graphed_step(eng, "unrolled", buckets=(2, 4, 8), backend="cuda")
    f.capture_all(torch.randint(0, 128, (20,), generator=gen).cuda(), m)
    results = f.verify(gen=gen)
    assert len(results) >= 3 and all(r.ok for r in results), [str(r) for r in results]
    audits = f.audit(params=eng.named_tensors())
    findings = [str(x) for a in audits.values() for x in a.findings]
    assert set(audits) == {2, 4, 8} and not findings, findings


def test_the_decode_loop_never_waits_for_the_gpu_but_on_last_step_s_copy(gen):
    # Issue 32: the host read the accepted lengths back with a sync every step and rebuilt lengths on the host;
    # now lengths advance on the device and results come back one step late through pinned memory: no implicit
    # synchronization inside the loop (torch's sync debug mode raises on one).
    eng = engine("tiny-llama", 3, seed_of(gen), device="cuda")
    ps = prompts(3, gen)
    step = graphed_step(eng, "unrolled", buckets=(1, 2, 4), backend="cuda")
    want = [t.tolist() for t in eng.generate(ps, NEW, forward=step).tokens]  # captures and warms everything
    real = eng.meta.prepare

    def prepare(state, seq_lens, kv_lens):  # the loop's prepares take device lengths; the prefill's host ones
        if seq_lens.is_cuda:
            torch.cuda.set_sync_debug_mode("error")
        real(state, seq_lens, kv_lens)

    eng.meta.prepare = prepare
    try:
        got = eng.generate(ps, NEW, forward=step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        del eng.meta.prepare
    assert [t.tolist() for t in got.tokens] == want


def test_one_runner_serves_draft_len_1_3_7_on_cuda_graphs(gen):
    # Regression: issue 33, the HF engine's draft length as a variant: one runner, one pool, every k replayed.
    seed = seed_of(gen)
    from graphctl.integrations.hf import HFEngine
    from graphctl.integrations.hf.configs import hf_config

    eng = HFEngine.build(hf_config("tiny-llama"), draft_len=7, max_seqs=4, max_context=128, block_size=8, seed=seed,
                         device="cuda")
    ps = prompts(4, gen)
    step = graphed_step(eng, draft_lens=(1, 3, 7), buckets=(1, 2, 4), backend="cuda")
    for k in (7, 1, 3):
        got = eng.generate(ps, NEW, forward=step, k=k)
        want = eng.generate(ps, NEW, k=k)
        assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens], k
    rep = step.report()
    assert {b.variant for b in rep.buckets} == {"k=1", "k=3", "k=7"} and step.fallbacks == {}
    assert len({v.runner.options.pool.handle for v in step.variants}) == 1


def test_the_eager_prefill_s_direct_kernels_equal_the_ops_bitwise(gen, monkeypatch):
    # Issue 32: the eager path launches the write and attention kernels directly (the dispatcher and a dozen small
    # ops a layer skipped); logits and both caches must be the ops' to the bit, and the path must be the one taken.
    from graphctl.integrations.hf import attention as hf_attention

    eng = engine("tiny-llama", 3, seed_of(gen), device="cuda", dtype=torch.bfloat16)
    ps = prompts(5, gen)
    taken, build = [], hf_attention.PagedBatch.build
    monkeypatch.setattr(hf_attention.PagedBatch, "build", staticmethod(
        lambda *a, **k: taken.append(build(*a, **k)) or taken[-1]))
    runs = []
    for direct in (True, False):
        with graphctl.knobs.scope(eager_kernels=direct):
            runs.append(prefill_and_caches(eng, ps, gen))
        assert all(b.direct is direct for b in taken[-2:]), "the eager prefill took the other path"
    (a_first, a_logits, a_kv), (b_first, b_logits, b_kv) = runs
    assert torch.equal(a_first, b_first) and torch.equal(a_logits, b_logits)
    assert all(torch.equal(x, y) for x, y in zip(a_kv, b_kv))

"""Graph variants (issue 33): ``graphed(..., variants={"k": (1, 3, 7)})`` serves every listed host
value from its own graphs at every bucket, in one pool; an unlisted value is refused naming it (or
runs eagerly under ``fallback="eager"``, counted); per-value buckets; report rows, verify, audit and
coverage per variant; the reference and HF engines serve k = 1, 3, 7 from one runner. Both
backends (the emulated recorder on the CPU, CUDA graphs under ``-m cuda``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import graphctl
from graphctl import DeclarationError, ReplayError, StaticInput
from graphctl.models import EngineConfig, MTPEngine, graphed_step

H = 8


def _model(device: str, gen: torch.Generator):
    w = torch.randn(H, H, generator=gen).to(device)

    def fwd(x: torch.Tensor, k: int, first: bool = True) -> torch.Tensor:
        y = torch.tanh(x.view(-1, k + 1, H).sum(1) @ w)  # one row per request out of k + 1 per request in
        return y * 2 if first else y - 1

    return fwd


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def test_every_variant_is_served_by_its_own_graphs_at_every_n(backend, gen):
    # Regression: issue 33, graphed() took no variants= (TypeError); a forward keyed by a host argument needed one
    # runner per value, captured and pooled by hand.
    dev = _device(backend)
    fwd = _model(dev, gen)
    run = graphctl.graphed(fwd, buckets=[1, 2, 4], backend=backend, progress=False,
                           inputs=[StaticInput("x", per_item_of=lambda k: k + 1)],
                           variants={"k": (1, 3, 7), "first": (True, False)})
    assert isinstance(run, graphctl.VariantRunner)
    run.capture_all(torch.randn(4 * 2, H, generator=gen).to(dev), 1)  # one example captures every k
    assert {lbl for lbl, _ in run.captured} == {f"k={k}, first={f}" for k in (1, 3, 7) for f in (True, False)}
    for k in (1, 3, 7):
        for first in (True, False):
            for n in (1, 2, 3, 4):
                x = torch.randn(n * (k + 1), H, generator=gen).to(dev)
                want = fwd(x.clone(), k, first)
                sub = run.runner(k=k, first=first)
                for t in sub.outputs(sub.buckets.pick(n)):
                    t.fill_(float("nan"))  # poisoned: a replay that skipped writing cannot pass for one that did
                sub.static_input("x")[n * (k + 1):].fill_(float("nan"))  # and the padding
                got = run(x, k, first).clone()
                torch.testing.assert_close(got, want)
    rep = run.report()
    assert run.fallbacks == {} and sum(b.replays for b in rep.buckets) == 3 * 2 * 4
    assert {(b.variant, b.bucket) for b in rep.buckets} == set(run.captured)
    assert "variant" in str(rep) and "k=7, first=False" in str(rep)


def test_an_unlisted_value_is_refused_naming_it_or_runs_eagerly_counted(gen):
    # Regression: issue 33, an unlisted variant value must never replay another value's graph.
    fwd = _model("cpu", gen)
    opts = dict(buckets=[2], backend="emulated", progress=False, inputs=[StaticInput("x", per_item_of=lambda k: k + 1)])
    run = graphctl.graphed(fwd, variants={"k": (1, 3)}, **opts)
    run.capture_all(torch.randn(4, H, generator=gen), 1)
    x = torch.randn(2 * 6, H, generator=gen)
    with pytest.raises(ReplayError) as err:
        run(x, 5)
    assert err.value.buffer == "k" and "5" in str(err.value.found) and "[1, 3]" in err.value.expected
    with pytest.raises(ReplayError, match="variant"):
        run(torch.randn(2 * 2, H, generator=gen), [1])  # unhashable: no variant, named as one
    with pytest.raises(ReplayError):
        run(torch.randn(2 * 2, H, generator=gen), True)  # True == 1 in Python, but not the variant 1
    eager = graphctl.graphed(fwd, variants={"k": (1, 3)}, fallback="eager", **opts)
    eager.capture_all(torch.randn(4, H, generator=gen), 1)
    got = eager(x, 5).clone()
    torch.testing.assert_close(got, fwd(x, 5))
    assert eager.fallbacks == {"[k] a variant value with no graphs": 1}
    assert eager.report().fallbacks == eager.fallbacks


def test_per_value_buckets_and_a_batch_past_them_names_the_variant(gen):
    # Regression: issue 33, a draft length with its own buckets (vLLM #48494): k=3 captures fewer sizes than k=1.
    fwd = _model("cpu", gen)
    run = graphctl.graphed(fwd, backend="emulated", progress=False,
                           inputs=[StaticInput("x", per_item_of=lambda k: k + 1)],
                           variants={"k": {1: [1, 2, 4, 8], 3: [1, 2]}})
    run.capture_all(torch.randn(8 * 2, H, generator=gen), 1)
    assert run.captured == (("k=1", 1), ("k=1", 2), ("k=1", 4), ("k=1", 8), ("k=3", 1), ("k=3", 2))
    got = run(x := torch.randn(8 * 2, H, generator=gen), 1).clone()
    torch.testing.assert_close(got, fwd(x, 1))
    with pytest.raises(ReplayError) as err:
        run(torch.randn(4 * 4, H, generator=gen), 3)
    assert "n = 4" in str(err.value) and "variant k=3" in "\n".join(getattr(err.value, "__notes__", []))


@pytest.mark.parametrize("variants,inputs,what", [
    ({"j": (1, 2)}, None, "names no host argument"),
    ({"x": (1, 2)}, ["x"], "names no host argument"),
    ({"k": ([1], 2)}, None, "hashable host value"),
    ({"k": (torch.ones(1),)}, None, "hashable host value"),
    ({"k": (1, 1)}, None, "listed twice"),
    ({"k": ()}, None, "lists no value"),
    ({"k": 3}, None, "lists its values"),
    ({"k": {1: [1, 2], 3: [4]}, "first": {True: [1], False: [2]}}, None, "no bucket every value allows"),
])
def test_bad_variant_declarations_are_clear_errors(variants, inputs, what, gen):
    # Regression: issue 33, every variants= mistake is a DeclarationError naming it, raised before anything runs.
    with pytest.raises(DeclarationError, match=what):
        graphctl.graphed(_model("cpu", gen), backend="emulated", inputs=inputs, variants=variants)


def test_true_and_one_are_two_variants_and_per_item_of_needs_variants(gen):
    # Regression: issue 33, True == 1 and hash(True) == hash(1): a dict keyed by value would serve one from the other.
    def fwd(x, flag):
        return x * (5 if flag is True else 7)

    run = graphctl.graphed(fwd, buckets=[2], backend="emulated", progress=False, variants={"flag": (True, 1)})
    run.capture_all(torch.randn(2, 3, generator=gen), True)
    x = torch.randn(2, 3, generator=gen)
    torch.testing.assert_close(run(x, 1).clone(), x * 7)
    torch.testing.assert_close(run(x, True).clone(), x * 5)
    with pytest.raises(DeclarationError, match="no variants"):
        graphctl.graphed(fwd, inputs=[StaticInput("x", per_item_of=lambda k: k + 1)])


def test_every_variant_shares_one_pool_and_a_failed_variant_drops_all(backend, gen):
    # Regression: issue 33, a variant whose capture fails must leave no variant captured (a call would find holes).
    dev = _device(backend)
    calls = {"n": 0}

    def fwd(x, k):
        if k == 3:
            calls["n"] += 1
            if calls["n"] > 4:  # past k=3's four warmups (2 buckets x 2): its first capture
                raise RuntimeError("boom in k=3")
        return x * k

    run = graphctl.graphed(fwd, buckets=[1, 2], backend=backend, progress=False, variants={"k": (1, 3)})
    with pytest.raises(graphctl.CaptureError, match="boom") as err:
        run.capture_all(torch.randn(2, 4, generator=gen).to(dev), 1)
    assert any("variant k=3" in n for n in getattr(err.value, "__notes__", []))
    assert run.captured == () and all(v.runner.capture is None for v in run.variants)
    pools = {id(v.runner.options.pool) for v in run.variants}
    assert len(pools) == 1  # one SharedPool, handed to every variant's runner
    calls["n"] = -10**6  # now it captures
    run.capture_all(torch.randn(2, 4, generator=gen).to(dev), 1)
    x = torch.randn(2, 4, generator=gen).to(dev)
    torch.testing.assert_close(run(x, 3).clone(), x * 3)
    if backend == "cuda":
        handles = {v.runner.options.pool.handle for v in run.variants}
        assert len(handles) == 1 and None not in handles


def test_verify_audit_and_coverage_run_per_variant(gen):
    # Regression: issue 33, verify/audit/coverage of a variant runner must cover every variant, labelled.
    fwd = _model("cpu", gen)
    run = graphctl.graphed(fwd, buckets=[1, 4], backend="emulated", progress=False,
                           inputs=[StaticInput("x", per_item_of=lambda k: k + 1)], variants={"k": (1, 3)})
    run.capture_all(torch.randn(4 * 2, H, generator=gen), 1)
    res = run.verify()
    assert {r.variant for r in res} == {"k=1", "k=3"} and all(r.ok for r in res)
    assert str(res[0]).startswith("k=")
    assert set(run.audit()) == set(run.captured)
    cov = run.coverage()
    assert cov[("k=3", 3)] == "bucket 4" and cov[("k=1", 1)] == "bucket 1"


def test_a_decorated_method_gets_a_variant_runner_per_instance(gen):
    # Regression: issue 33, variants on a method: each instance its own graphs, like a plain runner.
    class M:
        def __init__(self, s: float) -> None:
            self.s = s

        @graphctl.graphed(buckets=[2], backend="emulated", progress=False, variants={"k": (1, 2)})
        def fwd(self, x, k):
            return x * self.s + k

    a, b = M(2.0), M(3.0)
    x = torch.randn(2, 3, generator=gen)
    torch.testing.assert_close(a.fwd(x, 2).clone(), x * 2 + 2)
    torch.testing.assert_close(b.fwd(x, 1).clone(), x * 3 + 1)
    assert a.fwd is not b.fwd and isinstance(a.fwd, graphctl.VariantRunner)


@pytest.mark.parametrize("oracle", [True, False])
def test_the_reference_engine_serves_k_1_3_7_from_one_runner(oracle, backend, gen):
    # Regression: issue 33, the engine's draft length was fixed at capture: one runner per k, by hand.
    dev = _device(backend)
    eng = MTPEngine(EngineConfig(draft_len=7, max_seqs=4, max_context=160), device=dev, oracle=oracle)
    step = graphed_step(eng, draft_lens=(1, 3, 7), buckets=(1, 2, 4), backend=backend)
    prompts = eng.prompts(3, gen)
    for k in (7, 1, 3):
        want = eng.generate(prompts, 5, k=k)
        got = eng.generate(prompts, 5, forward=step, k=k)
        assert [a.tolist() for a in got] == [a.tolist() for a in want], k
        if oracle:
            assert all(bool((a == k + 1).all()) for a in want[1:]), want
    assert step.fallbacks == {}
    with pytest.raises(ValueError, match="k=9"):
        eng.generate(prompts, 1, k=9)
    with pytest.raises(DeclarationError, match="cannot hold"):
        graphed_step(eng, draft_lens=(1, 8), backend=backend)


def test_the_hf_engine_serves_each_draft_len_from_one_runner_eager_and_compiled(gen):
    # Regression: issue 33, the HF engine's draft_len as a variant, on an eager and a compiled (aot_eager) model.
    pytest.importorskip("transformers")
    from graphctl.integrations.hf import HFEngine
    from graphctl.integrations.hf.configs import hf_config

    torch._dynamo.reset()
    prompts = [torch.randint(3, 100, (n,), generator=gen) for n in (5, 7)]
    for compile in (False, "aot_eager"):
        eng = HFEngine.build(hf_config("tiny-llama"), draft_len=3, max_seqs=2, max_context=64, device="cpu",
                             compile=compile)
        step = graphed_step(eng, draft_lens=(1, 3), buckets=[2], backend="emulated")
        for k in (1, 3):
            want = eng.generate(prompts, 6, k=k)
            got = eng.generate(prompts, 6, forward=step, k=k)
            assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens], (compile, k)
        rep = step.report()
        assert {b.variant for b in rep.buckets} == {"k=1", "k=3"} and rep.uncompiled == 0, rep
    torch._dynamo.reset()


def test_options_record_keeps_variants_frozen_and_checked():
    # Regression: issue 33, variants= lives in the one frozen Options record, checked in one place.
    from graphctl.graphs.options import Options

    o = Options.of(variants={"k": {1: [4, 1], 3: [2]}, "first": [True, False]})
    assert o.variants == (("k", ((1, (1, 4)), (3, (2,)))), ("first", ((True, None), (False, None))))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.variants = None  # type: ignore[misc]


def test_a_variant_runner_collects_garbage_once_for_all_its_captures(gen, monkeypatch):
    # Regression: issue 33, each variant's capture ran its own gc.collect() (about 0.1 s each in a process that
    # imported transformers): the variant runner's capture cost more than a runner per value.
    import gc

    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or real(*a))
    run = graphctl.graphed(_model("cpu", gen), buckets=[1, 2], backend="emulated", progress=False,
                           inputs=[StaticInput("x", per_item_of=lambda k: k + 1)], variants={"k": (1, 3, 7)})
    run.capture_all(torch.randn(2 * 2, H, generator=gen), 1)
    assert len(calls) == 1 and gc.isenabled()
    plain = graphctl.graphed(lambda x: x * 2, buckets=[1, 2], backend="emulated", progress=False)
    plain.capture_all(torch.randn(2, 3, generator=gen))
    assert len(calls) == 2  # a plain runner still collects once

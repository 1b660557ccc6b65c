"""One runner face (issue 52): a plain and a variant runner behave the same for every operation; what a replay
reads (declared objects, weights) is checked; a switch of a state the runner was not given is refused at capture.
Each test is the code a user writes; each failed before issue 52."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import CaptureError, StaticInput
from graphctl.models import EngineConfig, MTPEngine
from support.engine import move_every_buffer


def test_a_switch_of_a_state_the_runner_was_not_given_is_refused_at_capture(backend, device, gen):
    # Regression: issue 52, @graphed without state= around a forward entering state.switch("draft") captured the
    # switch without the runner knowing the state: no refresh around replays, draft outputs of zeros on CUDA.
    eng = MTPEngine(EngineConfig(max_seqs=2, seed=int(torch.randint(0, 999, (1,), generator=gen))), device=device)
    k1 = eng.k + 1

    def step(input_ids, meta):
        return eng.step(input_ids, meta).drafts

    ids = torch.randint(0, eng.cfg.vocab, (2 * k1,), generator=gen).to(device)
    eng.meta.prepare(eng.state, torch.full((2,), k1, dtype=torch.int32), torch.full((2,), 9, dtype=torch.int32))
    run = graphctl.graphed(step, buckets=[2], inputs=[StaticInput("input_ids", per_item=k1)], backend=backend,
                           progress=False, params=eng.named_tensors())
    with pytest.raises(CaptureError, match="was not given") as err:
        run(ids, eng.meta)
    assert "state=" in err.value.fix and err.value.buffer == "PagedMetadata" and run.capture is None
    assert eng.state.poisoned is None and eng.state.active_switch is None
    fixed = graphctl.graphed(step, buckets=[2], inputs=[StaticInput("input_ids", per_item=k1)], backend=backend,
                             progress=False, params=eng.named_tensors(), state=eng.state)
    want = step(ids, eng.meta).clone()
    assert torch.equal(fixed(ids, eng.meta).clone(), want)


def test_a_variant_runner_reports_the_findings_of_every_variant(gen):
    # Regression: issue 52, VariantRunner.report() kept the random-state finding of the first variant only: a draw made
    # when k == 3 showed in vr.runner(k=3).report() and nowhere in vr.report().
    def fwd(x, k):
        return x + (torch.rand_like(x) if k == 3 else 0)

    vr = graphctl.graphed(fwd, buckets=[2], backend="emulated", progress=False, variants={"k": (1, 3)})
    vr.capture_all(torch.randn(2, 3, generator=gen), 1)
    assert len(vr.runner(k=3).report().random_state) == 1 and len(vr.runner(k=1).report().random_state) == 0
    rep = vr.report()
    assert len(rep.random_state) == 1 and "random state" in str(rep), str(rep)


def test_a_variant_runner_has_every_operation_of_a_plain_one(gen):
    # Regression: issue 52, a variant runner had no repoint (AttributeError), and a call leaving out the variant
    # argument raised a ReplayError about inspect._empty instead of Python's TypeError.
    eng = MTPEngine(EngineConfig(max_seqs=4, draft_len=3, seed=int(torch.randint(0, 999, (1,), generator=gen))))
    vr = graphctl.graphed(eng.step, buckets=[2, 4], state=eng.state, backend="emulated", progress=False,
                          params=eng.named_tensors(), variants={"k": (1, 3)},
                          inputs=[StaticInput("input_ids", per_item_of=lambda k: k + 1)])

    def prepare(n: int, k: int) -> torch.Tensor:
        eng.meta.prepare(eng.state, torch.full((n,), k + 1, dtype=torch.int32), torch.full((n,), 12, dtype=torch.int32))
        return torch.randint(0, eng.cfg.vocab, (n * (k + 1),), generator=gen)

    vr.capture_all(prepare(4, 3), eng.meta, 3)
    with pytest.raises(TypeError, match="unexpected keyword"):
        vr(prepare(2, 3), eng.meta, 3, bogus=1)
    plain = graphctl.graphed(lambda x, k: x * k, buckets=[2], backend="emulated", progress=False,
                             variants={"k": (1, 3)})
    plain.capture_all(torch.randn(2, 3, generator=gen), 1)
    with pytest.raises(TypeError, match="missing a required argument: 'k'"):
        plain(torch.randn(2, 3, generator=gen))
    new = move_every_buffer(eng)  # the move a grown pool makes
    eng.state = new
    done = vr.repoint(new)
    assert set(done) == {("k=1", 2), ("k=1", 4), ("k=3", 2), ("k=3", 4)} and all(v > 0 for v in done.values()), done
    for k in (1, 3):
        ids = prepare(3, k)
        want = eng.step(ids, eng.meta, k)
        got = vr(ids, eng.meta, k)
        assert torch.equal(got.drafts.clone(), want.drafts) and torch.equal(got.accepted.clone(), want.accepted), k
    del got
    # every operation answers alike, keyed (variant, bucket)
    assert {(r.variant, r.bucket) for r in vr.verify()} == set(done) and all(r.ok for r in vr.verify())
    assert set(vr.audit()) == set(done) and all(not a.errors for a in vr.audit().values())
    assert {k for k in vr.coverage(range(1, 5))} == {(f"k={k}", n) for k in (1, 3) for n in range(1, 5)}
    assert vr.measure(iters=2) is vr and all(b.replay_us is not None for b in vr.report().buckets)

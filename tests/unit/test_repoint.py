"""Re-pointing captured graphs at a state bound again after its buffers moved (issue 19)."""
from __future__ import annotations

import time

import pytest
import torch

import graphctl
from graphctl.graphs import StaticInput
from graphctl.models.mtp import EngineConfig, MTPEngine
from support.engine import move_every_buffer as _move_every_buffer


def _engine(device: str, gen: torch.Generator):
    eng = MTPEngine(EngineConfig(max_seqs=8, seed=int(torch.randint(0, 1000, (1,), generator=gen))), device=device)
    k1 = eng.k + 1
    step = graphctl.graphed(eng.step, buckets=[2, 4, 8], inputs=[StaticInput("input_ids", per_item=k1)],
                            state=eng.state,
                            backend="cuda" if device == "cuda" else "emulated", params=eng.named_tensors(),
                            progress=False)
    return eng, step


def _prepare(eng, n: int, gen: torch.Generator) -> torch.Tensor:
    k1 = eng.k + 1
    kv = torch.randint(k1 + 1, eng.cfg.max_context - 2 * k1, (n,), generator=gen, dtype=torch.int32)
    eng.meta.prepare(eng.state, torch.full((n,), k1, dtype=torch.int32), kv)
    return torch.randint(0, eng.cfg.vocab, (n * k1,), generator=gen).to(eng.device)


def test_every_declared_buffer_moved_repointed_replay_equals_eager_and_audit_clean(backend, device, gen):
    # Issue 19: a moved buffer meant reset() and a full recapture (peers: seconds per graph); now the graphs are
    # rewritten to the new addresses.
    eng, step = _engine(device, gen)
    step.capture_all(_prepare(eng, 8, gen), eng.meta)
    old = eng.state.addresses()
    new_state = _move_every_buffer(eng)
    moved = [n for n, a in new_state.addresses().items() if a != old[n]]
    assert len(moved) >= 10, moved
    eng.state = new_state  # the engine's own code (prepare, the forward's switch) uses the new state
    ids = _prepare(eng, 3, gen)
    with pytest.raises(graphctl.ReplayError, match="rebound since the capture"):
        step(ids, eng.meta)  # before re-pointing: the graph would read the old memory
    done = step.repoint(new_state)
    assert set(done) == {2, 4, 8} and all(v > 0 for v in done.values()), done
    for n in (3, 8, 1):
        ids = _prepare(eng, n, gen)
        want = eng.step(ids, eng.meta)
        got = step(ids, eng.meta)
        assert torch.equal(got.accepted.clone(), want.accepted) and torch.equal(got.drafts.clone(), want.drafts), n
    del got  # the last call's outputs, not kept across verify's calls (OutputsHeldWarning otherwise)
    assert all(r.ok and r.write is None for r in step.verify(writes="error")), [str(r) for r in step.verify()]
    assert not [str(f) for a in step.audit().values() for f in a.findings]


def test_repoint_refuses_a_changed_layout_and_changes_nothing(gen):
    # Issue 19: a buffer reallocated with another shape bakes other launch shapes: refused, naming it.
    eng, step = _engine("cpu", gen)
    step.capture_all(_prepare(eng, 8, gen), eng.meta)
    state = eng.state
    eng.meta.block_table = torch.zeros(8, eng.meta.block_table.shape[1] + 1, dtype=torch.int32)
    with pytest.raises(graphctl.BindError):
        graphctl.bind(eng.meta, registry=eng.registry)  # the spec itself refuses a different size here
    m2 = MTPEngine(EngineConfig(max_seqs=4), device="cpu")  # another engine: other sizes everywhere
    with pytest.raises(graphctl.RepointError, match="layout") as ei:
        step.repoint(m2.state)
    assert ei.value.buffer and step.state is state


def test_repoint_is_faster_than_recapture(gen):
    # Issue 19 (benchmarked on the H200 in bench/RESULTS.md): re-pointing every bucket beats capturing them again.
    eng, step = _engine("cpu", gen)
    ids = _prepare(eng, 8, gen)
    t0 = time.perf_counter()
    step.capture_all(ids, eng.meta)
    capture_s = time.perf_counter() - t0
    new_state = _move_every_buffer(eng)
    t0 = time.perf_counter()
    step.repoint(new_state)
    assert time.perf_counter() - t0 < capture_s


def test_a_repoint_failing_halfway_drops_every_graph_and_the_next_call_captures_again(gen):
    # Issue 19: a rewrite that fails after another bucket's was applied must not leave graphs reading old memory.
    eng, step = _engine("cpu", gen)
    step.capture_all(_prepare(eng, 8, gen), eng.meta)
    new_state = _move_every_buffer(eng)
    eng.state = new_state
    graph = step.record(4).graph
    check = graph.repoint

    def broken(moves):
        check(moves)  # the check passes; the rewrite fails
        return lambda: (_ for _ in ()).throw(KeyboardInterrupt())

    graph.repoint = broken
    with pytest.raises(KeyboardInterrupt) as ei:
        step.repoint(new_state)
    assert "dropped" in "".join(getattr(ei.value, "__notes__", []))
    assert step.captured == () and step.state is new_state
    ids = _prepare(eng, 5, gen)  # the next call captures again, against the new state
    want = eng.step(ids, eng.meta)
    assert torch.equal(step(ids, eng.meta).drafts.clone(), want.drafts)


def test_an_emulated_piecewise_graph_repoints_its_regions_arguments(gen):
    # Regression: issue 51, a region returning a declared buffer it was passed (an alias the next piece reads there)
    # was refused after repoint(): its result was compared with the buffer's address before the move.
    eng = MTPEngine(EngineConfig(max_seqs=8, seed=int(torch.randint(0, 1000, (1,), generator=gen))), device="cpu")
    k1 = eng.k + 1

    @graphctl.eager
    def lengths(kv):  # a host read of a declared buffer, passed as its argument and returned
        return kv if kv.numel() > 0 else kv.clone()

    def fwd(input_ids, meta):
        out = eng.step(input_ids, meta)
        return out.accepted, lengths(meta.kv_lens).to(torch.int64)

    step = graphctl.graphed(fwd, buckets=[4, 8], inputs=[StaticInput("input_ids", per_item=k1)], state=eng.state,
                            backend="emulated", params=eng.named_tensors(), progress=False)
    step.capture_all(_prepare(eng, 8, gen), eng.meta)
    new_state = _move_every_buffer(eng)
    eng.state = new_state
    step.repoint(new_state)
    for n in (3, 8):
        ids = _prepare(eng, n, gen)
        want_acc, want_kv = eng.step(ids, eng.meta).accepted, eng.meta.kv_lens.to(torch.int64)
        got_acc, got_kv = (t.clone() for t in step(ids, eng.meta))
        assert torch.equal(got_acc, want_acc) and torch.equal(got_kv, want_kv), n

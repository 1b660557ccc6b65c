"""Side effects of a forward on state graphctl was not told about (issue 15): found by the first
warmup, undone around every warmup, capture, measure and verify run, or refused."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import CaptureError, DeclarationError


class Counter:
    """Model state of the kind libraries keep: a device-side position and a ring it writes."""

    def __init__(self, gen: torch.Generator) -> None:
        self.pos = torch.zeros((), dtype=torch.int64)
        self.ring = torch.randn(16, 4, generator=gen)


def _step(state: Counter):
    def step(x):
        # one row a step (padded rows of a bucket never reach the state)
        state.ring.index_copy_(0, state.pos.view(1) % 16, x[:1])  # writes the caller's ring
        state.pos.add_(1)  # and advances the caller's position
        return x * 2 + state.ring.sum()
    return step


def _eager_twin(gen_seed: int):
    st = Counter(torch.Generator().manual_seed(gen_seed))
    return st, _step(st)


def test_capture_all_leaves_undeclared_state_bitwise_and_replay_equals_eager():
    # Issue 15: warmups and the capture of a forward that advances its own cache moved the caller's cache, so the
    # first replay started late, on garbage (transformers' StaticCache: cumulative_length.add_, index_copy_).
    state, step = _eager_twin(3)
    ref, ref_step = _eager_twin(3)
    f = graphctl.graphed(step, buckets=[2, 4], inputs=["x"], backend="emulated", progress=False)
    gen = torch.Generator().manual_seed(4)
    f.capture_all(torch.randn(4, 4, generator=gen))
    assert torch.equal(state.pos, ref.pos) and torch.equal(state.ring, ref.ring)
    paths = sorted(e.path for e in f.side_effects)
    assert paths == ["state.pos", "state.ring"], paths
    ops = {e.path: e.op for e in f.side_effects}
    assert ops == {"state.pos": "aten::add_", "state.ring": "aten::index_copy_"}
    assert all("test_side_effects.py:" in e.where for e in f.side_effects), f.side_effects
    rep = f.report()
    assert {e["path"]: e["policy"] for e in rep.to_dict()["side_effects"]} == {"state.pos": "restore",
                                                                            "state.ring": "restore"}
    assert "side effect (restore): state.ring (256 B) written by aten::index_copy_ at " in str(rep)
    assert "test_side_effects.py:" in str(rep)
    for n in (4, 3, 2, 4, 1):
        x = torch.randn(n, 4, generator=gen)
        want = ref_step(x)
        got = f(x).clone()
        torch.testing.assert_close(got, want)
        assert torch.equal(state.pos, ref.pos) and torch.equal(state.ring, ref.ring), n


def test_measure_and_verify_leave_the_state_as_they_found_it():
    # Issue 15: measure and verify runs moved undeclared state too.
    state, step = _eager_twin(5)
    f = graphctl.graphed(step, buckets=[2, 4], inputs=["x"], backend="emulated", progress=False)
    f.capture_all(torch.randn(4, 4, generator=torch.Generator().manual_seed(6)))
    pos, ring = state.pos.clone(), state.ring.clone()
    f.measure(iters=5)
    res = f.verify()
    assert all(r.ok for r in res), [str(r) for r in res]
    assert torch.equal(state.pos, pos) and torch.equal(state.ring, ring)


def test_side_effects_error_names_the_tensor_and_the_line():
    # Issue 15: nothing said why a graphed forward with undeclared state diverged from eager.
    state, step = _eager_twin(7)
    pos, ring = state.pos.clone(), state.ring.clone()
    f = graphctl.graphed(step, buckets=[4], inputs=["x"], backend="emulated", progress=False, side_effects="error")
    with pytest.raises(CaptureError, match="writes state graphctl does not own") as ei:
        f.capture_all(torch.randn(4, 4, generator=torch.Generator().manual_seed(8)))
    assert "state.pos" in str(ei.value) and "aten::index_copy_" in str(ei.value)
    assert "test_side_effects.py:" in str(ei.value)
    assert torch.equal(state.pos, pos) and torch.equal(state.ring, ring) and f.captured == ()


def test_side_effects_cap_and_ignore():
    # Issue 15: snapshot memory must be capped where a KV cache is large.
    state, step = _eager_twin(9)
    f = graphctl.graphed(step, buckets=[4], inputs=["x"], backend="emulated", progress=False,
                         max_side_effect_bytes=64)
    with pytest.raises(CaptureError, match="exceed the snapshot cap"):
        f.capture_all(torch.randn(4, 4, generator=torch.Generator().manual_seed(8)))
    state, step = _eager_twin(9)
    pos = state.pos.clone()
    f = graphctl.graphed(step, buckets=[4], inputs=["x"], backend="emulated", progress=False, side_effects="ignore")
    f.capture_all(torch.randn(4, 4, generator=torch.Generator().manual_seed(8)))
    assert int(state.pos) > int(pos)  # documented: the runs moved it
    assert [e.path for e in f.side_effects] == ["state.ring", "state.pos"] or len(f.side_effects) == 2
    with pytest.raises(DeclarationError, match="side_effects"):
        graphctl.graphed(step, side_effects="undo")


def test_a_warmup_that_raises_partway_restores_and_names_the_bucket():
    # Issue 15: a forward whose warmup raised part-way left the caller's state advanced.
    state = Counter(torch.Generator().manual_seed(2))
    pos, ring = state.pos.clone(), state.ring.clone()

    def step(x):
        state.pos.add_(1)
        state.ring.mul_(2)
        raise RuntimeError("layer 2 failed")

    f = graphctl.graphed(step, buckets=[2, 4], inputs=["x"], backend="emulated", progress=False)
    with pytest.raises(RuntimeError, match="layer 2 failed") as ei:
        f.capture_all(torch.randn(4, 4))
    assert any("warming up bucket 4" in n for n in getattr(ei.value, "__notes__", []))
    assert torch.equal(state.pos, pos) and torch.equal(state.ring, ring)

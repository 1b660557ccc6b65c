"""The graphs layer on real CUDA graphs (H200), where it has no emulated twin: segments and node
counts, a call allocates nothing, host syncs inside a captured switch, addresses checked, and the
state machine with capture/replay rules. (Replay equals eager, stale padding, failed captures:
tests/unit/test_graphs.py through the ``backend`` fixture.)"""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import CaptureError, ReplayError
from support.graphs import Toy, check_replay_matches_eager

pytestmark = pytest.mark.cuda


@pytest.fixture
def toy(gen):
    return Toy("cuda", gen, S=64, k=3, H=32, buckets=(1, 2, 4, 8, 16, 32, 64), backend="cuda")


def _rng_works() -> None:
    a = torch.randn(16, device="cuda")
    torch.cuda.synchronize()
    assert torch.isfinite(a).all()


def test_segments_and_node_counts_cuda(toy):
    check_replay_matches_eager(toy, [8])
    for b in toy.forward.captured:
        segs = toy.forward.segments(b)
        assert [s.name for s in segs] == ["target", "draft"], segs
        g = toy.forward.graph(b)
        assert g.node_count > 0 and segs[-1].end == g.node_count
        assert 0 < segs[0].end < g.node_count


def test_a_call_allocates_nothing_cuda(toy):
    tokens, positions = toy.batch(5)
    toy.forward(tokens, positions, toy.meta)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(5):
        toy.forward(tokens, positions, toy.meta)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_host_sync_inside_draft_switch_during_capture(gen):
    # Regression: torch's graph context masks the body's error with cudaErrorStreamCaptureInvalidated
    # and leaves the CUDA RNG in capture mode (apis.md §1.4).
    toy = Toy("cuda", gen, backend="cuda")
    st = toy.state
    before = {n: st.tensor(n).clone() for n in st.plan.buffers}

    def bad(x, meta):
        with st.switch("draft"):
            y = x * meta.kv_lens[0]
            if graphctl.state.phase.capturing(x.device):
                y = y * float(x.sum())  # host sync: invalidates the capture
        return y

    f = graphctl.graphed(bad, buckets=[2, 4], state=st, inputs=["x"], backend="cuda", progress=False)
    with pytest.raises(CaptureError) as ei:
        f(torch.randn(3, 4, device="cuda"), toy.meta)
    cause = ei.value.__cause__
    assert cause is not None and "invalidated" not in str(cause).split("\n")[0].lower(), str(cause)
    assert f.captured == ()
    assert st.poisoned is None and st.active_phase is None
    for n, t in before.items():
        assert torch.equal(st.tensor(n), t), n
    _rng_works()


def test_swallowed_sync_error_still_fails_the_capture(gen):
    def sneaky(x):
        try:
            x.sum().item()
        except RuntimeError:
            pass  # the capture is dead even though the body completes
        return x * 2

    f = graphctl.graphed(sneaky, buckets=[2], backend="cuda", warmup_iters=0, progress=False)
    with pytest.raises(CaptureError, match="invalidated"):
        f(torch.randn(2, 3, device="cuda"))
    assert f.captured == ()
    _rng_works()


def test_capture_inside_a_running_capture_is_refused_before_capture_begin():
    f = graphctl.graphed(lambda x: x + 1, buckets=[2], backend="cuda", warmup_iters=0, progress=False)
    x = torch.randn(2, 3, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g.capture_begin()
        try:
            x.mul_(1)  # the outer capture is not empty
            with pytest.raises(CaptureError, match="already running"):
                f.capture_all(x)
        finally:
            g.capture_end()
    _rng_works()


def test_rng_in_the_forward_and_randn_after(gen):
    f = graphctl.graphed(lambda x: x + torch.rand_like(x), buckets=[4], backend="cuda", progress=False)
    x = torch.randn(4, 8, device="cuda")
    a, b = f(x).clone(), f(x).clone()
    assert not torch.equal(a, b) and ((a - x) >= 0).all() and ((a - x) < 1).all()  # new draws each replay
    _rng_works()


def test_address_change_detected_cuda(toy):
    tokens, positions = toy.batch(3)
    toy.forward.capture_all(tokens, positions, toy.meta)
    toy.meta.kv_lens = toy.meta.kv_lens.clone()
    with pytest.raises(ReplayError, match="kv_lens"):
        toy.forward(tokens, positions, toy.meta)


@pytest.mark.parametrize("body", [lambda x: x + x.cpu().cuda(), lambda x: x + torch.tensor(x[0].tolist(),
                                                                                          device="cuda")],
                         ids=["cpu", "tolist"])
def test_emulated_backend_refuses_device_to_host_on_cuda_tensors(body):
    f = graphctl.graphed(body, buckets=[2], backend="emulated", warmup_iters=0, progress=False)
    with pytest.raises(CaptureError, match="test_graphs_cuda.py:"):
        f(torch.randn(2, 3, device="cuda"))


def test_graph_machine_on_cuda():
    from hypothesis import settings

    from graphctl.testing import GraphMachine, cases

    class CudaGraphMachine(GraphMachine):
        backend = "cuda"
        phases = ("eager", "replay", "refresh")

        def draw_case(self, data):
            return data.draw(cases(device="cuda"))

    CudaGraphMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
    CudaGraphMachine.TestCase("runTest").runTest()


def test_verify_on_cuda_graphs(toy):
    tokens, positions = toy.batch(5)
    toy.forward.capture_all(tokens, positions, toy.meta)
    results = toy.forward.verify(gen=torch.Generator().manual_seed(3))
    assert all(r.ok for r in results), [str(r) for r in results]
    assert {r.bucket for r in results} == set(toy.forward.captured)

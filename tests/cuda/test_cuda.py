"""GPU tests (run on the H200 by scripts/device-check): CUDA kernels against the references,
one launch per switch direction, graph node counts, no allocation, a switch captured and
replayed inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import bind, ops
from graphctl.ops import reference
from support.mini import MiniMetadata, make_registry
from support.ops import buffer_set, bytes_equal

pytestmark = pytest.mark.cuda


def _graph_nodes(fn) -> dict[str, int]:
    """Capture fn into a CUDA graph and count its nodes by type (cuda.bindings runtime API)."""
    from cuda.bindings import runtime as rt

    g = torch.cuda.CUDAGraph(keep_graph=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        try:
            fn()
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    raw = g.raw_cuda_graph()
    err, _, n = rt.cudaGraphGetNodes(raw, 0)
    err, nodes, n = rt.cudaGraphGetNodes(raw, n)
    counts: dict[str, int] = {}
    for node in nodes[:n]:
        err, kind = rt.cudaGraphNodeGetType(node)
        name = kind.name.replace("cudaGraphNodeType", "")
        counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize("n", [1, 7, 65, 449, 1000])
def test_swap_through_cuda_matches_reference(n, gen):
    statics, arenas, sources = buffer_set(n, gen, "cuda", max_numel=5000)
    for i in range(0, n, 3):
        sources[i] = statics[i]
    s_ref, a_ref = [t.cpu() for t in statics], [t.cpu() for t in arenas]
    src_ref = [s_ref[i] if i % 3 == 0 else t.cpu() for i, t in enumerate(sources)]
    ops.swap_through_(statics, arenas, sources)
    reference.swap_through_(s_ref, a_ref, src_ref)
    assert bytes_equal(statics, s_ref) and bytes_equal(arenas, a_ref)


@pytest.mark.parametrize("n", [3, 449])
def test_copy_and_fingerprint_cuda_match_reference(n, gen):
    dst, _, src = buffer_set(n, gen, "cuda", max_numel=70000)
    d_ref = [t.cpu() for t in dst]
    ops.copy_(dst, src)
    reference.copy_(d_ref, [t.cpu() for t in src])
    assert bytes_equal(dst, d_ref)
    fp = ops.fingerprint(dst)
    assert fp.is_cuda and torch.equal(fp.cpu(), reference.fingerprint([t.cpu() for t in dst]))


def test_large_buffers_bandwidth_path_is_exact(gen):
    a = torch.randint(-2**31, 2**31 - 1, (3 << 20,), dtype=torch.int32, device="cuda", generator=None)
    src = torch.randint(-2**31, 2**31 - 1, (3 << 20,), dtype=torch.int32, device="cuda")
    arena = torch.full_like(a, 7)
    want_arena, want_static = a.clone(), src.clone()
    ops.swap_through_([a], [arena], [src])
    assert torch.equal(arena, want_arena) and torch.equal(a, want_static)


def test_token_to_request_cuda_matches_reference(gen):
    for S, T in [(1, 1), (7, 40), (128, 8448), (256, 16384), (3000, 5000)]:
        lens = torch.randint(0, 5, (S,), generator=gen, dtype=torch.int32)
        num = int(torch.randint(0, T + 1, (1,), generator=gen))
        out = torch.full((T,), -77, dtype=torch.int32, device="cuda")
        want = torch.full((T,), -77, dtype=torch.int32)
        ops.token_to_request_(out, lens.cuda(), num, -3)
        reference.token_to_request_(want, lens, num, -3)
        assert torch.equal(out.cpu(), want), (S, T, num)


def test_loop_condition_cuda_matches_reference(gen):
    for n in (0, 1, 255, 256, 257, 5000):
        for p in (0.0, 0.001, 0.5):
            active = torch.rand(n, generator=gen) < p
            counter = torch.randint(-1, 6, (1,), generator=gen)
            got = torch.full((1,), 7, dtype=torch.int32, device="cuda")
            want = torch.full((1,), 7, dtype=torch.int32)
            ops.loop_condition_(got, counter.cuda(), 4, active.cuda())
            reference.loop_condition_(want, counter, 4, active)
            assert torch.equal(got.cpu(), want), (n, p, int(counter))


def test_one_kernel_per_direction_and_two_nodes_per_switch(gen):
    statics, arenas, sources = buffer_set(40, gen, "cuda")
    statics = [s for s in statics if s.numel()]
    arenas, sources = arenas[: len(statics)], sources[: len(statics)]
    arenas = [torch.empty_like(s) for s in statics]
    sources = [torch.empty_like(s).copy_(s).add_(1) if s.dtype.is_floating_point else s for s in statics]
    assert _graph_nodes(lambda: ops.swap_through_(statics, arenas, sources)) == {"Kernel": 1}
    assert _graph_nodes(lambda: ops.copy_(statics, arenas)) == {"Kernel": 1}


def test_switch_recorded_in_graph_adds_two_nodes_and_replays_transactionally(gen):
    m = MiniMetadata(gen, S=64, B=16, k=3, device="cuda")
    st = bind(m, registry=make_registry())
    before = {n: st.tensor(n).clone() for n in st.plan.buffers}
    recompute = st.plan.phases["capture"].recompute
    assert recompute == ("slot_mapping",)

    def body():
        with st.switch("draft", "capture"):
            pass

    def recompute_only():
        st._recompute("slot_mapping", out=torch.empty_like(m.slot_mapping))

    counts, user = _graph_nodes(body), _graph_nodes(recompute_only)
    # the switch itself: one snapshot+apply kernel and one restore kernel; the rest is the user's fn
    assert counts == {"Kernel": user["Kernel"] + 2}, (counts, user)
    for n in st.plan.buffers:
        assert torch.equal(st.tensor(n), before[n]), n


def test_switch_recorded_in_graph_replays_with_live_contents_and_restores(gen):
    # The test above never replayed: a recorded switch must, at every replay, read the live draft twin and
    # write-through contents, and leave every declared buffer as it found it.
    from support.mini import slots

    m = MiniMetadata(gen, S=64, B=16, k=3, device="cuda")
    st = bind(m, registry=make_registry())
    out = torch.empty(64, dtype=torch.int64, device="cuda")
    bump = torch.full((64,), 5, dtype=torch.int32, device="cuda")
    lens = torch.empty(64, dtype=torch.int32, device="cuda")

    def body():
        with st.switch("draft"):
            torch.add(m.kv_lens, bump, out=lens)
            st.write("kv_lens", lens)  # slot_mapping recomputed from the draft twin and the new lens
            out.copy_(m.slot_mapping)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        body()
    for _ in range(3):
        st.write("kv_lens", torch.randint(1, 900, (64,), generator=gen, dtype=torch.int32).cuda())
        st.write("draft_block_offsets", torch.randint(0, 1000, (64, 16), generator=gen, dtype=torch.int32).cuda())
        before = {n: st.tensor(n).clone() for n in st.restorable_names()}
        want = torch.empty_like(out)
        slots(want, m.draft_block_offsets, m.kv_lens + 5)
        out.fill_(-(2**40))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        for n, t in before.items():
            assert torch.equal(st.tensor(n), t), f"{n} not restored by the replayed switch"


def test_switch_allocates_nothing_on_cuda(gen):
    m = MiniMetadata(gen, S=64, B=16, k=3, device="cuda")
    st = bind(m, registry=make_registry())
    ones = torch.ones_like(m.seq_lens)
    with st.switch("draft", "eager"):
        st.write("seq_lens", ones)
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    for phase in ("eager", "replay", "eager"):
        with st.switch("draft", phase):
            st.write("seq_lens", ones)
    torch.cuda.synchronize()
    stats1 = torch.cuda.memory_stats()
    assert stats1["allocation.all.allocated"] == stats0["allocation.all.allocated"]


def test_draft_loop_captured_and_replayed_equals_eager(gen):
    # Whole draft loop with in-graph switch, write-through and kv_lens += 1, replayed on fresh inputs.
    m = MiniMetadata(gen, S=32, B=8, k=3, device="cuda")
    st = bind(m, registry=make_registry())
    out = torch.empty(32, dtype=torch.int64, device="cuda")
    ones = torch.ones_like(m.seq_lens)

    def step():
        with st.switch("draft", "capture" if torch.cuda.is_current_stream_capturing() else "eager"):
            st.write("seq_lens", ones)
            for _ in range(3):
                m.kv_lens.add_(1)
                st.write("kv_lens", m.kv_lens)  # in place; write-through recomputes slot_mapping
            out.copy_(m.slot_mapping + m.req_idx_per_token[:32])

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warmup (eager)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            step()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        fresh = torch.randint(10, 900, m.kv_lens.shape, generator=gen, dtype=torch.int32).cuda()
        st.write("kv_lens", fresh)
        before = {n: st.tensor(n).clone() for n in st.plan.buffers}
        out.fill_(-1)
        with st.switch("draft", "replay"):
            g.replay()
        got = out.clone()
        out.fill_(-1)
        step()  # eager reference on the same state
        torch.cuda.synchronize()
        assert torch.equal(got, out)
        for n in st.plan.buffers:
            assert torch.equal(st.tensor(n), before[n]), n


def test_pageable_host_buffer_refused_on_cuda_state():
    from support.errors import CASES, PINNED_MESSAGE

    case = next(c for c in CASES if c.id == "bind-host-pinned")
    with pytest.raises(graphctl.BindError) as ei:
        case.run()
    assert str(ei.value) == PINNED_MESSAGE


def test_state_machine_on_cuda_with_host_mirrors():
    from hypothesis import settings

    from graphctl.testing import SwitchMachine, cases

    class CudaMachine(SwitchMachine):
        phases = ("eager", "replay", "refresh")

        def draw_case(self, data):
            return data.draw(cases(device="cuda"))

    CudaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)
    CudaMachine.TestCase("runTest").runTest()

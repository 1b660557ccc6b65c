"""The pointer and segment audits on the emulated backend (CI): planted bugs, each found with the
right classification and the op that holds it; clean forwards give no findings."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl.graphs.analysis.audit import AddressMap
from graphctl.graphs.analysis.nodes import Region, short_name
from support.audit import dangling_temporary, engine_audits, stale_token_map, target_reads_refreshed


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20261202)


def test_a_temporary_the_caller_still_holds_is_unregistered_not_dangling(gen):
    a = dangling_temporary("cpu", "emulated", gen, drop=False)
    assert not a.errors, str(a)
    assert [(f.kind, f.op) for f in a.warnings] == [("unregistered", "aten::add.Tensor")], str(a)
    assert a.classes["param"] >= 1 and a.classes["input"] >= 1 and a.classes["pool"] >= 1, a.classes


def test_pointer_audit_names_a_temporary_only_the_graph_still_holds(gen):
    # Regression: TensorRT-LLM #16290, a kernel reading a temporary allocated outside the pool and freed.
    a = dangling_temporary("cpu", "emulated", gen, drop=True)
    assert [(e.kind, e.op, e.segment) for e in a.errors] == [("dangling", "aten::add.Tensor", "target")], str(a)
    assert "freed since capture" in str(a.errors[0]) and a.errors[0].node is not None


def test_segment_audit_names_a_target_read_of_a_buffer_refreshed_before_replay(gen):
    # Regression: TensorRT-LLM #16887 review, the target segment reading a buffer refreshed before replay.
    a = target_reads_refreshed("cpu", "emulated", gen)
    assert [(e.kind, e.buffer, e.segment) for e in a.errors] == [
        ("refreshed-in-target", "draft_block_offsets", "target")], str(a)
    assert a.errors[0].op and "refreshed in place before replay" in str(a.errors[0])
    # declared read by the target, read only by the draft here
    assert {(x.kind, x.buffer, x.segment) for x in a.warnings} == {("unread-reader", "block_offsets", "target")}
    assert a.usage["draft"]["draft_block_offsets"] == "read" and "draft_block_offsets" in a.usage["target"]


@pytest.mark.parametrize("compiled", [False, True])
def test_segment_audit_names_a_read_of_a_map_left_stale_by_an_in_place_input_write(gen, compiled):
    # Regression: issue 29, meta.seq_lens.fill_(1) inside a switch left req_idx_per_token stale; verify() saw equal
    # outputs and audit() reported 0 errors though its own usage line said "seq_lens (write)".
    f, toy, a = stale_token_map("cpu", "emulated", gen, compiled=compiled)
    stale = [e for e in a.errors if e.kind == "stale-derived"]
    assert [(e.buffer, e.segment) for e in stale] == [("req_idx_per_token", "draft")], str(a)
    e = stale[0]
    assert "'seq_lens'" in e.message and "aten::fill_" in e.message and "state.write" in e.message, str(e)
    assert e.node is not None and e.op != "aten::fill_", str(e)  # the reading op, not the write
    assert all(r.ok for r in f.verify()), "eager and replay are equally wrong: verify cannot see it"
    # the same forward run eagerly under GRAPHCTL_CHECK_STALE is caught at its switch's exit
    with graphctl.knobs.scope(check_stale=True), pytest.raises(graphctl.StaleBufferError, match="req_idx_per_token"):
        f.fn(*toy.batch(4), toy.meta)


def test_the_same_step_writing_through_the_state_has_no_stale_finding(gen):
    # Regression: issue 29, the rule must not flag a write followed by its recompute (state.write, pad, restores).
    _, _, a = stale_token_map("cpu", "emulated", gen, via_state=True)
    assert not a.errors and not [f for f in a.findings if f.kind == "stale-derived"], str(a)
    assert a.usage["draft"]["seq_lens"] == "write" and "req_idx_per_token" in a.usage["draft"], a.usage


def test_no_findings_on_the_reference_engine_at_every_bucket(gen):
    audits = engine_audits("cpu", "emulated", gen)
    assert set(audits) == {2, 4, 8}
    assert not [str(f) for a in audits.values() for f in a.findings], [str(a) for a in audits.values()]


def test_registered_weights_are_params_and_a_clean_forward_has_no_findings(gen):
    w = torch.randn(4, 4, generator=gen)
    lin = torch.nn.Linear(4, 4).requires_grad_(False)

    @graphctl.graphed(buckets=[2, 4], backend="emulated", progress=False, params=lin)
    def f(x):
        return lin(x).relu()

    f.capture_all(torch.randn(3, 4, generator=gen))
    for a in f.audit().values():
        assert not a.findings, str(a)
        assert a.classes.get("param", 0) >= 2, a.classes  # weight and bias
    # the same forward without params: the weights are live memory nobody registered
    g = graphctl.graphed(lambda x: lin(x) @ w, buckets=[2], backend="emulated", progress=False)
    g.capture_all(torch.randn(2, 4, generator=gen))
    assert {f.kind for f in g.audit()[2].warnings} == {"unregistered"}
    assert not g.audit(params={"w": w, **dict(lin.named_parameters())})[2].findings


def test_census_and_nodes_list_the_recorded_ops(gen):
    w = torch.randn(4, 4, generator=gen)
    f = graphctl.graphed(lambda x: (x @ w).relu() + 1, buckets=[4], backend="emulated", progress=False)
    f.capture_all(torch.randn(4, 4, generator=gen))
    c = f.census(4)
    assert c["types"] == {"op": len(f.nodes(4))} and c["kernels"]["aten::mm"] == 1, c
    mm = next(n for n in f.nodes(4) if n.name == "aten::mm")
    assert {r.access for r in mm.refs} == {"read", "write"} and mm.refs[0].nbytes == 4 * 4 * 4


def test_dot_export_needs_cuda(gen):
    f = graphctl.graphed(lambda x: x * 2, buckets=[4], backend="emulated", progress=False)
    f.capture_all(torch.randn(4, 2, generator=gen))
    with pytest.raises(graphctl.ReplayError, match="DOT export needs a CUDA graph"):
        f.dot(4, "/tmp/never.dot")


def test_address_map_prefers_the_most_specific_region():
    amap = AddressMap([Region("graph pool", "pool", 1000, 5000), Region("output[0]", "output", 2000, 2100),
                       Region("freed block", "freed", 0, 10_000)])
    assert amap.lookup(2050)[0].name == "output[0]" and amap.lookup(2050)[1] == 50
    assert amap.lookup(1500)[0].kind == "pool" and amap.lookup(9000)[0].kind == "freed"
    assert amap.lookup(20_000) is None


def test_library_kernels_are_recognised_by_name():
    # Regression: cuBLASLt's split-K reduction takes the cuBLAS workspace as a plain argument (H100):
    # live memory in it is the library's workspace, not an unregistered tensor.
    from graphctl.graphs.analysis.nodes import is_library_kernel

    assert is_library_kernel("cublasLt::splitKreduce_kernel") and is_library_kernel("nvjet_sm90_tst_128x64")
    assert not is_library_kernel("at::native::vectorized_elementwise_kernel")
    assert not is_library_kernel("graphctl::_GLOBAL__N_1::swap_copy_kernel") and not is_library_kernel("triton_poi_0")


@pytest.mark.parametrize(
    "symbol,short",
    [
        (
            "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_",
            "at::native::vectorized_elementwise_kernel",
        ),
        (
            "_ZN8graphctl12_GLOBAL__N_116swap_copy_kernelILi64EEEvNS0_5TableIXT_EEE",
            "graphctl::_GLOBAL__N_1::swap_copy_kernel",
        ),
        ("nvjet_sm90_tst_128x64_64x4_1x2_h_bz_TNT", "nvjet_sm90_tst_128x64_64x4_1x2_h_bz_TNT"),
        ("_Z6kernelPf", "kernel"),
    ],
)
def test_short_names_of_mangled_kernels(symbol, short):
    assert short_name(symbol) == short

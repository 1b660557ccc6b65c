"""Inspection and audit of real CUDA graphs (H200): node census with kernel names, DOT export,
argument decoding (kernelParams and cuBLAS's extra buffers), and the planted bugs, each found
with the right classification and the kernel that holds it; none on the reference engine."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import ReplayError, StaleBufferError
from support.audit import dangling_temporary, engine_audits, stale_token_map, target_reads_refreshed

pytestmark = pytest.mark.cuda


def test_census_names_kernels_and_counts_copies(gen):
    x0 = torch.randn(64, 32, generator=gen).cuda()
    out = torch.empty(64, 32, device="cuda")

    def fwd(x):
        out.copy_(x)  # a device-to-device copy: one memcpy node
        return (out * 2).relu_()

    f = graphctl.graphed(fwd, buckets=[64], backend="cuda", progress=False)
    f.capture_all(x0)
    c = f.census(64)
    assert c["types"].get("kernel", 0) >= 2 and sum(c["types"].values()) == f.graph(64).node_count, c
    assert any(k.startswith("at::native::") for k in c["kernels"]), c
    nodes = f.nodes(64)
    kern = next(n for n in nodes if n.kind == "kernel")
    assert kern.symbol.startswith("_Z") and kern.launch.startswith("grid ") and kern.param_sizes, kern
    a = f.audit(params={"out": out})[64]
    assert not a.findings and a.classes.get("input", 0) >= 1 and a.classes.get("param", 0) >= 1, str(a)


def test_cublas_extra_buffers_are_decoded(gen):
    w = torch.randn(256, 256, generator=gen).to("cuda", torch.bfloat16)
    f = graphctl.graphed(lambda x: x @ w, buckets=[64], backend="cuda", progress=False, params={"w": w})
    f.capture_all(torch.randn(64, 256, generator=gen).to("cuda", torch.bfloat16))
    nodes = f.nodes(64)
    gemm = [n for n in nodes if n.kind == "kernel" and n.refs]
    assert gemm, [str(n) for n in nodes]
    a = f.audit()[64]
    assert not a.errors, str(a)
    # the weight, the static input and the output are all found in the gemm's arguments
    assert a.classes.get("param", 0) >= 1 and a.classes.get("input", 0) >= 1 and a.classes.get("output", 0) >= 1, \
        (str(a), [(n.name, n.library, n.param_sizes) for n in nodes])


def test_dot_export_writes_the_graph(gen, tmp_path):
    f = graphctl.graphed(lambda x: (x + 1).sin(), buckets=[8], backend="cuda", progress=False)
    f.capture_all(torch.randn(8, 8, generator=gen).cuda())
    path = str(tmp_path / "g.dot")
    f.dot(8, path)
    text = open(path).read()
    assert text.startswith("digraph") and "sin" in text.lower(), text[:400]


def test_dangling_temporary_found_with_its_kernel_cuda(gen):
    # Regression: TensorRT-LLM #16290, a kernel reading a temporary allocated outside the pool and freed.
    held = dangling_temporary("cuda", "cuda", gen, drop=False)
    assert not held.errors and [w.kind for w in held.warnings] == ["unregistered"], str(held)
    a = dangling_temporary("cuda", "cuda", gen, drop=True)
    # the add kernel takes its pointers inside TensorIterator's functor (a struct parameter): possible, not proven
    assert [(f.kind, f.severity) for f in a.findings if f.kind == "dangling"] in (
        [("dangling", "possible")], [("dangling", "error")]), str(a)
    a = dangling_temporary("cuda", "cuda", gen, drop=True, confirm=True)
    assert [e.kind for e in a.errors] == ["dangling"] and not a.possible and not a.dropped, str(a)
    e = a.errors[0]
    assert e.op.startswith("at::native::") and e.node is not None and e.segment == "target", str(e)
    assert e.evidence.startswith("confirmed") or e.evidence == "", str(e)


def test_target_kernel_touching_a_refreshed_buffer_cuda(gen):
    # Regression: TensorRT-LLM #16887 review, the target segment reading a buffer refreshed before replay.
    a = target_reads_refreshed("cuda", "cuda", gen)
    assert [(e.kind, e.buffer, e.segment) for e in a.errors] == [
        ("refreshed-in-target", "draft_block_offsets", "target")], str(a)
    assert a.errors[0].op and a.errors[0].op != "?", str(a)


def test_stale_derived_buffer_named_cuda(gen):
    # Regression: TensorRT-LLM #16925, req_idx_per_token built for k+1 tokens/request reused at 1 in the draft loop.
    from graphctl import Recompute, StateSpec
    from graphctl.families.paged import paged_spec, token_map_
    from graphctl.models import EngineConfig, MTPEngine

    holder: dict = {}
    spec = StateSpec("paged-stale-map", extends=paged_spec(block_size=8))
    spec.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32, override=True,
                derive=Recompute(["kv_cache_manager"], lambda out, _m: token_map_(out, holder["meta"].seq_lens)
                                     if "meta" in holder else out.zero_()))  # bind computes it before holder is set
    eng = MTPEngine(EngineConfig(draft_len=3, max_seqs=8), spec=spec, device="cuda")
    holder["meta"] = eng.meta
    with graphctl.knobs.scope(check_stale=True), pytest.raises(StaleBufferError, match="req_idx_per_token"):
        eng.generate(eng.prompts(8, torch.Generator().manual_seed(1)), 3)


def test_input_whose_address_changed_cuda(gen):
    w = torch.randn(8, 8, generator=gen).cuda()
    f = graphctl.graphed(lambda x, w: x @ w, buckets=[4], backend="cuda", progress=False, inputs=["x"])
    x = torch.randn(4, 8, generator=gen).cuda()
    f(x, w)
    with pytest.raises(ReplayError, match="w"):
        f(x, w.clone())  # same values, new address: the graph would read the old one


def test_no_findings_on_the_reference_engine_at_every_bucket_cuda(gen):
    # Regression: issue 35, struct words pointing into freed blocks were reported as dangling errors; confirmed by
    # poisoned replays, none is read: each is dropped with its evidence.
    audits = engine_audits("cuda", "cuda", gen, buckets=(1, 2, 4, 8, 16), confirm=True)
    assert set(audits) == {1, 2, 4, 8, 16}
    bad = [str(a) for a in audits.values() if a.findings]
    assert not bad, bad
    print("dropped possible findings:", [str(f) for a in audits.values() for f in a.dropped])
    a = audits[16]
    assert a.usage["target"] and a.usage["draft"], str(a)  # segments really were attributed


@pytest.mark.parametrize("via_state", [True, False])
def test_stale_derived_rule_never_flags_a_kernel_on_cuda(gen, via_state):
    # Regression: issue 29, the stale-derived rule must not cry wolf on CUDA, where a kernel's touch says neither
    # read nor write: a state.write in the step is clean; an in-place fill_ (a kernel) is for the emulated audit.
    _, _, a = stale_token_map("cuda", "cuda", gen, via_state=via_state)
    assert not [str(f) for f in a.findings if f.kind == "stale-derived"], str(a)
    _, _, e = stale_token_map("cpu", "emulated", gen, via_state=via_state)
    assert bool([f for f in e.errors if f.kind == "stale-derived"]) is not via_state, str(e)

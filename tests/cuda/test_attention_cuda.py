"""``graphctl::paged_attention`` on the GPU (issue 32): the Triton kernel against the reference on
random ragged batches (every dtype, grouped-query heads, long contexts), and inside a CUDA graph
replayed after the tables, rows and positions changed in place."""
from __future__ import annotations

import pytest
import torch
from unit.test_attention import _case

from graphctl import knobs
from graphctl.ops.attention import kernel_for, reference

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")

TOL = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}  # fp32 products run as TF32 only for 16-bit
SHAPES = [dict(H=4, KVH=4, D=8, BS=4, B=3, R=3, q_per_row=1),
          dict(H=32, KVH=8, D=64, BS=16, B=9, R=8, q_per_row=4),
          dict(H=32, KVH=8, D=128, BS=16, B=128, R=4, q_per_row=1),  # 2,048 keys a row
          dict(H=6, KVH=3, D=12, BS=5, B=7, R=5, q_per_row=3)]


def _cuda(case):
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_triton_kernel_equals_the_reference_on_cuda(gen, dtype, shape):
    case = _cuda(_case(gen, dtype, **shape))
    assert kernel_for(case[0]) is not reference, "auto should pick Triton on CUDA"
    got = torch.ops.graphctl.paged_attention(*case)
    want = reference(*case)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    dead = case[4] >= shape["R"]
    assert torch.equal(got[dead], torch.zeros_like(got[dead]))


@pytest.mark.parametrize("lowp", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_both_product_precisions_equal_the_reference_on_cuda(gen, dtype, shape, lowp):
    # Issue 32: Launch.lowp (16-bit products, the weights rounded as FlashAttention rounds them) and float32
    # operands, each against the reference, whichever is the default; split-K too (2,048 keys at a few rows).
    from graphctl.ops.attention_triton import Launch, paged_attention

    case = _cuda(_case(gen, dtype, **shape))
    want = reference(*case).float()
    for splits in (None, 1, 3):
        out = paged_attention(*case, splits=splits, launch=Launch(lowp=lowp))
        torch.testing.assert_close(out.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_the_kernel_replays_in_a_cuda_graph_with_what_the_step_wrote(gen):
    shape = dict(H=8, KVH=2, D=64, BS=16, B=8, R=4, q_per_row=4)
    q, k, v, table, req, pos, scale = _cuda(_case(gen, torch.bfloat16, **shape))
    torch.ops.graphctl.paged_attention(q, k, v, table, req, pos, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.graphctl.paged_attention(q, k, v, table, req, pos, scale)
    for _ in range(3):  # new tables, rows, positions and queries written in place: the replay reads them
        nq, nk, nv, ntable, nreq, npos, _ = _cuda(_case(gen, torch.bfloat16, **shape))
        n = min(nq.shape[0], q.shape[0])
        q[:n].copy_(nq[:n])
        req.fill_(shape["R"])  # tokens past the new batch: no request
        req[:n].copy_(nreq[:n])
        pos[:n].copy_(npos[:n])
        table.copy_(ntable)
        k.copy_(nk)
        v.copy_(nv)
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out.float(), reference(q, k, v, table, req, pos, scale).float(), rtol=2e-2,
                                   atol=2e-2)


def test_the_reference_knob_runs_the_reference_on_cuda(gen):
    case = _cuda(_case(gen, torch.float16, **SHAPES[1]))
    with knobs.scope(paged_attention="reference"):
        assert kernel_for(case[0]) is reference
        torch.testing.assert_close(torch.ops.graphctl.paged_attention(*case), reference(*case))


@pytest.mark.parametrize("kdt,cdt", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                     (torch.float16, torch.float16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("T,kvh,D,P,BS", [(7, 3, 12, 5, 4), (1, 8, 64, 9, 16), (1000, 8, 128, 70, 16)])
def test_the_write_kernel_equals_the_reference_on_cuda(gen, kdt, cdt, T, kvh, D, P, BS):
    # Issue 32: the eager path's K/V write, one launch, from the HF layer's strided [T, KVH, D] views.
    from graphctl.ops.attention import write_reference
    from graphctl.ops.attention_triton import write_kv

    k = torch.randn(kvh, T, D, generator=gen).to(kdt).cuda().transpose(0, 1)
    v = torch.randn(kvh, T, D, generator=gen).to(kdt).cuda().transpose(0, 1)
    slots = torch.randperm(P * BS, generator=gen)[:T].cuda()
    if T > 2:
        slots[1], slots[-1] = -1, P * BS + 3  # a padded lane, a slot past the pool: both write nothing
    caches = [torch.randn(P, BS, kvh * D, generator=gen).to(cdt).cuda() for _ in range(2)]
    want = [c.clone() for c in caches]
    write_reference(*want, slots, k, v)
    write_kv(*caches, slots, k, v)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


def test_the_direct_path_holds_only_where_nothing_watches_the_ops(gen):
    # Issue 32: the kernels are launched directly only with no dispatch mode (graphctl's write tracker journals the
    # writes by rows), no capture (a kernel variant built there would load a module), and Triton picked.
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphctl.ops.attention import direct

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    t = torch.ones(3, device="cuda")
    assert direct(t)
    assert not direct(t.cpu())
    with Watch():
        assert not direct(t)
    with knobs.scope(paged_attention="reference"):
        assert not direct(t)
    with knobs.scope(eager_kernels=False):
        assert not direct(t)
    seen = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen.append(direct(t))
    assert seen == [False]

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

"""A loop whose trip count the device decides: a CUDA conditional WHILE node spliced into the
running torch capture (``../shared/reference/apis.md`` §2.4, verified on an H200 with torch
2.11), or, outside a capture, a plain loop that reads the predicate on the host.

Inside a capture, :meth:`DeviceLoop.run`:

1. reads the capturing graph and its current dependencies (``cudaStreamGetCaptureInfo``);
2. creates a conditional handle whose value resets to 1 at every launch
   (``cudaGraphCondAssignDefault``), so the body runs at least once, and adds a WHILE node;
3. makes the WHILE node the capture's only dependency, so later work waits for the loop;
4. captures ``body()`` and then ``predicate(handle)`` into the node's body graph on a side
   stream (``cudaStreamBeginCaptureToGraph``); ``predicate`` must launch a kernel that calls
   ``cudaGraphSetConditional`` (``graphctl.ops.loop_condition_``).

Body restrictions (CUDA's and torch's), each refused with a typed error where graphctl can see
it: one stream (no event record/wait nodes, so no NCCL and no side streams); no RNG (torch
refuses it inside conditional nodes); no host synchronisation. Allocations in the body go to a
private pool of the loop's own (torch 2.11 does not route a body stream's allocations to the
graph's pool), so the body's temporaries keep their addresses from one iteration to the next.
Torch >= 2.14 has ``torch.while_loop`` with the same node underneath; graphctl splices the node
itself on every version so that one code path is tested.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from graphctl.errors import CaptureError
from graphctl.graphs.features import cuda_bindings
from graphctl.state.phase import is_recording

__all__ = ["DeviceLoop"]


def _check(r, what: str):
    err, *out = r
    if int(err) != 0:
        raise CaptureError(f"{what} failed while splicing a WHILE node", expected="cudaSuccess", found=str(err),
                           fix="the device loop needs CUDA 12.4+ and a driver with conditional nodes; see "
                               "`graphctl info` (conditional_nodes), or use mode='unrolled'")
    return out[0] if len(out) == 1 else tuple(out)


def _pool_routing() -> tuple[Callable, Callable]:
    names = vars(torch._C)
    begin = names.get("_cuda_beginAllocateCurrentStreamToPool")
    end = names.get("_cuda_endAllocateToPool") or names.get("_cuda_endAllocateCurrentStreamToPool")
    if begin is None or end is None:
        raise CaptureError("this torch cannot route a stream's allocations to a pool", expected="torch._C."
                           "_cuda_beginAllocateCurrentStreamToPool", found=torch.__version__,
                           fix="use mode='unrolled' or 'per_step' on this torch")
    return begin, end


class DeviceLoop:
    """``run(body, predicate, max_iters)``: a device-decided loop (see the module docstring).
    One instance per device and forward; it owns the body stream and the body's pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        # made here, outside any capture: the body's stream and the private pool of its temporaries
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.nodes_spliced = 0

    def run(self, body: Callable[[], None], predicate: Callable[[torch.Tensor, int], None], max_iters: int) -> None:
        """Run ``body()`` then ``predicate(flag, handle)`` until the predicate says stop, at most
        ``max_iters`` times (the predicate must also stop at the limit: under capture the device
        alone decides). ``predicate`` writes ``flag[0]`` (0 or 1) and, with a nonzero
        ``handle``, sets the WHILE node's condition."""
        if is_recording():
            raise CaptureError("a device-side loop needs a CUDA graph", expected="backend 'cuda'",
                               found="the emulated recorder", fix="capture on a GPU, or use mode='unrolled' or "
                               "'per_step', which the emulated backend runs")
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            with self._while_node() as handle:
                body()
                predicate(self.flag, handle)
            return
        for _ in range(max_iters):  # eager: the same predicate, read on the host
            body()
            predicate(self.flag, 0)
            if not int(self.flag.item()):
                break

    @contextlib.contextmanager
    def _while_node(self) -> Iterator[int]:
        cb = cuda_bindings()
        if cb is None:
            raise CaptureError("a device-side loop needs cuda-bindings", expected="cuda.bindings importable",
                               found="not installed", fix="pip install cuda-bindings, or use mode='unrolled'")
        rt, _ = cb
        begin, end = _pool_routing()
        outer = torch.cuda.current_stream(self.device).cuda_stream
        info = _check(rt.cudaStreamGetCaptureInfo(outer), "cudaStreamGetCaptureInfo")
        status, graph, deps = info[0], info[2], info[3]
        if status != rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
            raise CaptureError("no active capture to splice the loop into", expected="an active capture",
                               found=str(status), fix="call run() inside the forward being captured")
        handle = _check(rt.cudaGraphConditionalHandleCreate(graph, 1, 1), "cudaGraphConditionalHandleCreate")
        p = rt.cudaGraphNodeParams()
        p.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
        p.conditional.handle = handle
        p.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile
        p.conditional.size = 1
        node = _check(rt.cudaGraphAddNode(graph, deps, None, len(deps), p), "cudaGraphAddNode")
        body_graph = p.conditional.phGraph_out[0]
        _check(rt.cudaStreamUpdateCaptureDependencies(
            outer, [node], None, 1, rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies),
            "cudaStreamUpdateCaptureDependencies")
        s = self._stream.cuda_stream
        _check(rt.cudaStreamBeginCaptureToGraph(s, body_graph, None, None, 0,
                                                rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
               "cudaStreamBeginCaptureToGraph")
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        ok = False
        try:
            with torch.cuda.stream(self._stream):
                begin(idx, self._pool)
                try:
                    yield int(handle)
                finally:
                    end(idx, self._pool)
            ok = True
        finally:
            r = rt.cudaStreamEndCapture(s)
            if ok:
                _check(r, "cudaStreamEndCapture (loop body)")
        self.nodes_spliced += 1

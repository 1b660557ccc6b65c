"""A loop whose trip count the device decides: a CUDA conditional WHILE node spliced into the
running torch capture (``cudaStreamGetCaptureInfo`` and ``cudaStreamUpdateCaptureDependencies``,
verified on an H200 with torch 2.11), or, outside a capture, a plain loop that reads the predicate on the host.

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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphctl import bindings
from graphctl.errors import CaptureError
from graphctl.graphs.backends.cuda_nodes import graph_nodes, register_bodies
from graphctl.state.interrupts import drop_mode
from graphctl.state.phase import is_recording

__all__ = ["DeviceLoop"]

# Node types a conditional body may not hold (CUDA refuses them at instantiation with a
# message that names neither the op nor the loop): what each one means in torch terms.
_FORBIDDEN = {"cudaGraphNodeTypeWaitEvent": "a second stream (an event wait: side streams, NCCL)",
              "cudaGraphNodeTypeEventRecord": "a second stream (an event record: side streams, NCCL)",
              "cudaGraphNodeTypeMemAlloc": "a graph memory allocation node (cudaMallocAsync)",
              "cudaGraphNodeTypeMemFree": "a graph memory free node (cudaFreeAsync)",
              "cudaGraphNodeTypeHost": "a host callback"}


class _BodyGuard(TorchDispatchMode):
    """Refuses, while the loop body is captured, what a conditional body cannot hold: random
    numbers (the Philox offset would be the same every iteration; torch refuses RNG in
    conditional nodes) and host reads of device values."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise CaptureError("random numbers inside a device-loop body", expected="no RNG in the loop body",
                               found=func.name(), fix="draw the random numbers before the loop into a buffer the "
                               "body indexes, or use mode='unrolled'")
        if func.name() == "aten::_local_scalar_dense":
            raise CaptureError("a host read of a device value inside a device-loop body", expected="device-only work",
                               found=func.name(), fix="keep .item()/int()/bool() of device values out of the body; "
                               "the loop's predicate decides on the device")
        return func(*args, **(kwargs or {}))


def _check_body(rt: Any, body_graph: Any) -> None:
    for node in graph_nodes(int(body_graph)) or []:
        err, kind = rt.cudaGraphNodeGetType(node)
        why = _FORBIDDEN.get(kind.name) if int(err) == 0 else None
        if why:
            raise CaptureError("the device-loop body holds a node a conditional body cannot", expected="kernels, "
                               "copies and memsets on one stream", found=f"{kind.name}: {why}",
                               fix="run the loop body on the current stream only, without collectives; or use "
                                   "mode='unrolled' or 'per_step'")


_NEEDS = ("the device loop needs CUDA 12.4+ and a driver with conditional nodes; see `graphctl info` "
          "(conditional_nodes), or use mode='unrolled'")


def _check(r: Any, what: str, fix: str = _NEEDS) -> Any:
    err, *out = r
    if int(err) != 0:
        raise CaptureError(f"{what} failed while splicing a WHILE node", expected="cudaSuccess", found=str(err),
                           fix=fix)
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
        rt = bindings.runtime()
        if rt is None:
            raise CaptureError("a device-side loop needs cuda-bindings", expected="cuda.bindings importable",
                               found="not installed", fix="pip install cuda-bindings, or use mode='unrolled'")
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
        assert self._stream is not None  # a CUDA device (the capture check above)
        s = self._stream.cuda_stream
        _check(rt.cudaStreamBeginCaptureToGraph(s, body_graph, None, None, 0,
                                                rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
               "cudaStreamBeginCaptureToGraph")
        idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
        ok = False
        guard = _BodyGuard()
        try:
            with torch.cuda.stream(self._stream), guard:
                begin(idx, self._pool)
                try:
                    yield int(handle)
                finally:
                    end(idx, self._pool)
            ok = True
        finally:
            drop_mode(guard)  # an interrupt at the with-statement's exit skips its __exit__
            r = rt.cudaStreamEndCapture(s)
            if ok:
                _check(r, "cudaStreamEndCapture (loop body)", "the loop body holds something a conditional body "
                       "cannot (event nodes from NCCL or external events, allocation nodes, host callbacks); keep "
                       "the body to kernels and copies on its stream, or use mode='unrolled' or 'per_step'")
        _check_body(rt, body_graph)
        register_bodies(int(node), [int(body_graph)])  # so the audit and the census see the body's nodes

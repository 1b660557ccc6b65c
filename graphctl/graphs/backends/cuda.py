"""The CUDA graph backend: ``torch.cuda.CUDAGraph`` captured exception-safely.

torch's ``with torch.cuda.graph(g)`` always calls ``capture_end`` in ``__exit__``, so a body
that raised leaves a replayable partial graph, and a body that synchronised surfaces
``cudaErrorStreamCaptureInvalidated`` instead of its own error and leaves the CUDA RNG in
capture mode (torch's ``graphs.py``, seen on torch 2.11). This backend calls ``capture_begin`` and
``capture_end`` itself:

- preconditions are checked *before* ``capture_begin`` (a non-default stream, no capture
  already running on it), because ``capture_begin`` puts the RNG in capture mode before it
  checks the stream;
- a body that raises gets its capture ended (any error of that end is kept as a note), the
  graph reset and dropped, and, when the end failed, one throw-away capture that runs the RNG
  epilogue, so later ``torch.randn`` works; the body's own exception is the ``__cause__`` of
  the :class:`~graphctl.errors.CaptureError`;
- graphs keep their template (``keep_graph=True``) so nodes can be counted and inspected.
"""
from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphctl import bindings
from graphctl.errors import CaptureError, RepointError
from graphctl.graphs.analysis.nodes import Node, Region
from graphctl.graphs.backends.cuda_nodes import (
    allocator_regions,
    apply_patches,
    capturing_nodes,
    dot_print,
    graph_nodes,
    kernel_patches,
    read_cuda_nodes,
)
from graphctl.graphs.backends.hooks import ReplayHooks
from graphctl.graphs.capture import pieces
from graphctl.graphs.findings.randomness import same_generator
from graphctl.graphs.replay.repoint import lookup
from graphctl.state.interrupts import deferred
from graphctl.state.phase import capture_invalidated

__all__ = ["CudaBackend", "CudaGraph", "PiecewiseGraph", "refuse_nested_capture"]


class _NodeOrder:
    """Node handles in the order the capture added them: ``mark()`` (at every switch boundary)
    appends the new ones, so a segment's nodes are a slice of ``order`` whatever order
    ``cudaGraphGetNodes`` lists them in."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.order: list[Any] = []
        self._seen: set[Any] = set()

    def _add(self, handles: list[int]) -> None:
        for h in handles:
            if h not in self._seen:
                self._seen.add(h)
                self.order.append(h)

    def mark(self) -> int:
        handles = capturing_nodes(self.stream)
        if handles is None:
            return -1
        self._add(handles)
        return len(self.order)

    def finish(self, raw_graph: int) -> list[int]:
        final = graph_nodes(raw_graph)
        if final is None:
            return []
        if not self._seen <= set(final):  # handles changed at capture end: keep the driver's order
            self.order, self._seen = [], set()
        self._add(final)
        return self.order


def refuse_nested_capture(bucket: int | None = None) -> None:
    """Raise before anything is warmed up, allocated or begun inside another running capture."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise CaptureError("a capture is already running on the current stream", expected="no capture running",
                           found="an active capture", fix="capture graphs one at a time, outside other captures",
                           bucket=bucket)


class CudaGraph:
    """One captured ``torch.cuda.CUDAGraph`` (template kept) and what was measured of it."""

    def __init__(self, graph: torch.cuda.CUDAGraph, pool_bytes: int, order: list[int], pool: Any,
                 device: torch.device) -> None:
        self._graph = graph
        self.pool_bytes = pool_bytes
        self.order = order  # node handles in capture order (segments slice it)
        self.node_count = len(order) if order else -1
        self._pool, self._device = pool, device

    def nodes(self) -> list[Node]:
        """Every node, in capture order, with its kernel name and the addresses in its arguments."""
        return read_cuda_nodes(self.order)

    def memory_regions(self) -> list[Region]:
        """The caching allocator's memory on this graph's device, classified: this graph's pool,
        live blocks and freed blocks outside it (see :mod:`graphctl.graphs.analysis.audit`)."""
        return allocator_regions(self._device, self._pool)

    def dot(self, path: str) -> None:
        """Write the graph as Graphviz DOT (``cudaGraphDebugDotPrint``, verbose)."""
        dot_print(self._graph.raw_cuda_graph(), path)

    def replay(self, hooks: ReplayHooks | None = None) -> None:
        self._graph.replay()  # one launch: it runs whole or not at all, nothing to tell the hooks

    regions: tuple = ()  # a whole graph has no eager region (PiecewiseGraph has)

    def reset(self) -> None:  # a capture that failed after this piece: never keep it replayable
        self._graph.reset()

    can_poison = True  # audit confirm (graphs/analysis/confirm.py) may fill freed blocks and replay

    def poison(self, start: int, nbytes: int, byte: int) -> None:
        """Fill device memory ``[start, start + nbytes)`` with ``byte`` (the caller checked that the
        caching allocator lists it as free: nobody's data is there)."""
        drv = bindings.driver()
        err, = drv.cuMemsetD8(drv.CUdeviceptr(start), byte, nbytes)
        if int(err) != 0:
            raise RuntimeError(f"cuMemsetD8 on a freed block failed: {err}")

    def peek(self, start: int, nbytes: int) -> bytes:
        """The bytes of device memory ``[start, start + nbytes)``, copied to the host."""
        drv = bindings.driver()
        buf = ctypes.create_string_buffer(nbytes)
        err, = drv.cuMemcpyDtoH(ctypes.addressof(buf), drv.CUdeviceptr(start), nbytes)
        if int(err) != 0:
            raise RuntimeError(f"cuMemcpyDtoH from a freed block failed: {err}")
        return buf.raw

    def repoint(self, moves: list) -> Callable[[], int]:
        """Check now that every address inside a moved span (``graphs/replay/repoint.py``) sits where it
        can be rewritten: a kernel argument, a memcpy or memset address (``RepointError``
        otherwise, nothing changed); the returned call rewrites them in the instantiated graph
        and its template and says how many nodes."""
        if bindings.driver() is None or not self.order:
            raise RepointError("this CUDA graph cannot be re-pointed", buffer=moves[0].name if moves else None,
                               expected="cuda-bindings and the graph's node handles", found="neither is available",
                               fix="install cuda-bindings, or reset() and capture again")
        patches, why = kernel_patches(self.order, lambda a: lookup(moves, a))
        if why:
            raise RepointError("an old address sits where it cannot be rewritten safely", buffer=None,
                               expected="addresses only in kernel arguments and whole memcpy/memset ranges of the "
                                        "top-level graph", found=why,
                               fix="reset() and capture again (a library kernel's opaque arguments, a conditional "
                                   "body or a copy straddling the buffer holds it)")

        def apply() -> int:
            apply_patches(self._graph.raw_cuda_graph_exec(), patches)
            return len(patches)

        return apply


class PiecewiseGraph:
    """Pieces of one capture with an eager region between each two (``graphs/capture/pieces.py``):
    replayed piece, region, piece, ... on the current stream. Nodes are the pieces' nodes in
    order (segments and the audit see one sequence); the pool is the pieces' shared one."""

    can_poison = True

    def __init__(self, parts: list[CudaGraph], regions: list[pieces.EagerRegion], pool_bytes: int) -> None:
        self.parts, self.regions, self.pool_bytes = tuple(parts), tuple(regions), pool_bytes
        self.order = [h for p in parts for h in p.order]
        self.node_count = -1 if any(p.node_count < 0 for p in parts) else len(self.order)
        self._starts = []  # each region's node offset: where the pieces before it end
        n = 0
        for p in parts[:-1]:
            n += max(p.node_count, 0)
            self._starts.append(n)

    def replay(self, hooks: ReplayHooks | None = None) -> None:
        """Piece, region, piece, ... as one held section (a first Ctrl-C waits for the end, as for a
        whole graph; regions are user code, so a second one reaches a region that hangs). A region
        or launch that raises is told to ``hooks`` with whether a switch recorded in the pieces
        was open there (the region's, or the one before the piece)."""
        i, in_region = 0, False
        with deferred():
            try:
                for i, part in enumerate(self.parts):
                    in_region = False
                    part.replay()
                    if i < len(self.regions):
                        reg, in_region = self.regions[i], True
                        if hooks is None:
                            reg.run(*reg.args, **reg.kwargs)
                        else:
                            with hooks.region(reg):
                                reg.run(*reg.args, **reg.kwargs)
            except BaseException as exc:
                if hooks is not None:
                    at = self._starts[i] if in_region else self._starts[i - 1] if i else 0
                    inside = self.regions[i].inside if in_region else bool(i) and self.regions[i - 1].inside
                    hooks.failed(at, inside, exc, f"eager region {self.regions[i].name}" if in_region
                                 else f"the launch of piece {i}")
                raise

    def nodes(self) -> list[Node]:
        return read_cuda_nodes(self.order)

    def memory_regions(self) -> list[Region]:
        return self.parts[0].memory_regions()

    def dot(self, path: str) -> None:
        """One DOT file per piece: ``path`` for the first, ``<stem>.piece<i>.dot`` for the others."""
        stem = path[:-4] if path.endswith(".dot") else path
        for i, part in enumerate(self.parts):
            part.dot(path if i == 0 else f"{stem}.piece{i}.dot")

    def poison(self, start: int, nbytes: int, byte: int) -> None:
        self.parts[0].poison(start, nbytes, byte)

    def peek(self, start: int, nbytes: int) -> bytes:
        return self.parts[0].peek(start, nbytes)

    def reset(self) -> None:
        for p in self.parts:
            p.reset()

    def repoint(self, moves: list) -> Callable[[], int]:
        raise RepointError("a piecewise graph cannot be re-pointed", buffer=moves[0].name if moves else None,
                           expected="a graph without eager regions", found=f"{len(self.parts)} pieces",
                           fix="reset() and capture again after the buffers moved")


class CudaBackend:
    """Interface shared with :class:`~graphctl.graphs.backends.emulated.EmulatedBackend`:
    ``new_pool()``, ``warmup(body)``, ``capture(body, pool, bucket) -> (graph, out)`` where
    ``body(mark)`` runs the forward and ``mark()`` counts the nodes recorded so far, and
    ``synchronize()``. Graphs have ``replay()``, ``node_count`` and ``pool_bytes``."""

    name = "cuda"
    capture_executes = False  # a capture only records (eager regions aside: graphs/capture/pieces.py)

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream()
            self._scratch = torch.zeros(1, device=self.device)  # for the RNG recovery capture

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def live_blocks(self) -> set[tuple[int, int]]:
        """``(address, size)`` of the allocator's live blocks outside graph pools on this device."""
        return {(r.start, r.end - r.start) for r in allocator_regions(self.device, None) if r.kind == "live"}

    def warmup(self, body: Callable[[], Any]) -> Any:
        # Warm up on the capture stream: allocator blocks and library handles warmed here are the
        # ones the capture will see.
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            out = body()
        cur.wait_stream(self.stream)
        return out

    def _check_preconditions(self, bucket: int) -> None:
        if self.stream == torch.cuda.default_stream(self.device):
            raise CaptureError("capture stream is the default stream", expected="a side stream",
                               found="the default stream", fix="pass a torch.cuda.Stream()", bucket=bucket)
        refuse_nested_capture(bucket)

    def capture(self, body: Callable[[Callable[[], int]], Any], pool: Any, bucket: int,
                generators: Sequence[torch.Generator] = ()) -> tuple[CudaGraph | PiecewiseGraph, Any]:
        """Capture ``body(mark)``; every ``@graphctl.eager`` call inside ends the piece captured so
        far, replays it (the region sees real data), runs the region and begins the next piece in
        the same pool (``graphs/capture/pieces.py``): a :class:`PiecewiseGraph` when there was one. Each
        CUDA generator of ``generators`` is registered with every piece (torch registers the default
        one itself): a replay draws on from the generator's state at that time."""
        cuda_gens = [g for g in generators if g.device.type == "cuda" and not same_generator(
            g, torch.cuda.default_generators[g.device.index or 0])]
        self._check_preconditions(bucket)
        self.synchronize()
        before = torch.cuda.memory_reserved(self.device)
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        done: list[CudaGraph] = []
        regions: list[pieces.EagerRegion] = []
        live: list[Any] = [None, None]  # the piece being captured and its node order (None between pieces)

        def begin() -> None:
            g = torch.cuda.CUDAGraph(keep_graph=True)
            for gen in cuda_gens:
                g.register_generator_state(gen)
            g.capture_begin(pool=pool)
            live[:] = [g, _NodeOrder(self.stream)]

        def end() -> None:
            g, tracker = live
            live[:] = [None, None]
            try:
                with warnings.catch_warnings():  # a region first or last leaves an empty piece: fine, say nothing
                    warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                    g.capture_end()
            except BaseException as exc:  # the body swallowed an error that invalidated the capture
                g.reset()
                self._recover_rng()
                raise self._invalidated(bucket, exc) from exc
            g.instantiate()
            done.append(CudaGraph(g, 0, tracker.finish(g.raw_cuda_graph()), pool, self.device))

        def mark() -> int:
            m = live[1].mark() if live[1] is not None else -1
            return -1 if m < 0 or any(p.node_count < 0 for p in done) else m + sum(p.node_count for p in done)

        def region(fn: Callable[..., Any], args: tuple, kwargs: dict, in_switch: bool) -> Any:
            inside = pieces.admit(fn, in_switch)
            end()
            done[-1].replay()  # the region runs on what the piece computes, as at every replay
            out, reg = pieces.run_region(fn, args, kwargs, in_switch, inside)
            regions.append(reg)
            begin()
            return out

        outside = pieces.saved()
        with torch.cuda.stream(self.stream):
            begin()
            try:
                with pieces.regions(region):
                    out = body(mark)
            except BaseException as exc:
                pieces.restore(outside)  # a Ctrl-C in the cleanup of regions() could skip its reset
                dead = live[0] is not None and capture_invalidated(self.device)
                if live[0] is not None:
                    self._abandon(live[0], exc)
                for p in done:
                    p.reset()
                if not isinstance(exc, Exception):  # Ctrl-C, SystemExit, GeneratorExit propagate as themselves
                    exc.add_note(f"graphctl: capture of bucket {bucket} dropped; nothing replayable was kept")
                    raise
                if isinstance(exc, CaptureError):
                    raise
                if dead and "CaptureInvalidated" in str(exc):  # the body's error is a symptom, not the cause
                    raise self._invalidated(bucket, exc) from exc
                raise CaptureError.from_body(bucket, exc) from exc
            try:
                end()
            except BaseException:
                for p in done:
                    p.reset()
                raise
        cur.wait_stream(self.stream)
        self.synchronize()
        pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - before)
        if not regions:
            done[0].pool_bytes = pool_bytes
            return done[0], out
        return PiecewiseGraph(done, regions, pool_bytes), out

    @staticmethod
    def _invalidated(bucket: int, exc: BaseException) -> CaptureError:
        return CaptureError(f"capture of bucket {bucket} was invalidated by an earlier operation in the forward",
                            expected="a valid capture", found=f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                            fix="a host sync or an illegal call ran in the forward and its error was swallowed; "
                                "run the forward with backend='emulated' to get its file:line", bucket=bucket)

    def _abandon(self, g: torch.cuda.CUDAGraph, exc: BaseException) -> None:
        try:
            g.capture_end()
            ended = True
        except BaseException as end_err:  # typically cudaErrorStreamCaptureInvalidated; keep it as a note
            exc.add_note(f"graphctl: ending the failed capture also raised {type(end_err).__name__}: {end_err}")
            ended = False
        g.reset()  # never keep a replayable partial graph
        if not ended:
            self._recover_rng()

    def _recover_rng(self) -> None:
        # A capture whose end failed leaves the default CUDA generator in capture mode; the next
        # successful capture's epilogue resets it, so run a tiny throw-away one.
        try:
            torch.cuda.synchronize(self.device)
        except BaseException:
            pass
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            g.capture_begin()
            self._scratch.add_(1)
            g.capture_end()
        g.reset()

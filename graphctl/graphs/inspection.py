"""What a :class:`~graphctl.graphs.runner.GraphRunner` can say about its graphs, kept apart from
capture and replay: timings (``measure``), eager-vs-replay checks (``verify``), the pointer and
segment audits (``audit``), node listings, census and DOT export, and the report.

Everything here reads the runner's captured buckets and never changes them (``measure`` and
``verify`` replay, inside the runner's mutable-buffer guard).
"""
from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from graphctl.errors import CaptureError, ReplayError
from graphctl.graphs.audit import Audit, audit_graph, param_tensors
from graphctl.graphs.nodes import Node, census
from graphctl.graphs.report import BucketReport, Report, Segment
from graphctl.graphs.verify import verify as _verify

if TYPE_CHECKING:
    from graphctl.graphs.runner import GraphRunner

__all__ = ["Inspection"]


class Inspection:
    """Mixed into :class:`~graphctl.graphs.runner.GraphRunner` (which owns ``_graphs``,
    ``_slots``, ``_frozen``, ``_example``, ``_backend``, ``_guard``, ``state`` and ``params``)."""

    # ------------------------------------------------------------------------- measure

    def measure(self: "GraphRunner", iters: int = 20) -> "GraphRunner":
        """Median time of the whole graphed call and of the eager forward, per bucket, each at
        its own size (the example's items, repeated when the bucket holds more). Every declared
        buffer is restored before each timed call, outside the timing, so a forward that
        advances a bounded cache never runs off its end however many iterations are timed."""
        if self._example is None:
            raise CaptureError("nothing captured yet", expected="capture_all() or a call first", found="no graphs",
                               fix="call capture_all(*example) before measure()")
        arguments = self._arguments(*self._example)
        n = self._batch((), arguments)[0]
        with self.guard_all() as given:
            for b, cap in sorted(self._graphs.items()):
                args, kwargs = self._assemble({**arguments, **_tiled(self._inputs, arguments, n, b)})
                before = cap.replays
                cap.replay_us = _median_us(self._backend, lambda: self(*args, **kwargs), iters, given.restore)
                if cap.replays - before < iters:  # every timed call must have replayed this bucket
                    raise ReplayError(f"measure() of bucket {b} did not replay it", expected=f"{iters} replays",
                                      found=f"{cap.replays - before}", fix="report this: the bucket picked for "
                                      f"a batch of {b} is {self.buckets.pick(b)}")
                cap.eager_us = _median_us(self._backend, lambda: self.fn(*args, **kwargs), iters, given.restore)
        return self

    def coverage(self: "GraphRunner", sizes: Any = None) -> dict[int, str]:
        """For each batch size ``n`` (default 1 .. the largest bucket, capped at the example's
        items), call the runner on the example's first ``n`` items and say what served it:
        ``"bucket B"``, ``"eager: <reason>"`` (a fallback) or ``"error: <message>"``."""
        if self._example is None:
            raise CaptureError("nothing captured yet", expected="capture_all() or a call first", found="no graphs",
                               fix="call capture_all(*example) before coverage()")
        arguments = self._arguments(*self._example)
        items = self._batch((), arguments)[0]
        sizes = range(1, min(items, self.buckets.largest) + 1) if sizes is None else sizes
        out: dict[int, str] = {}
        with self.guard_all() as given:  # the caller's state (and side effects) back after every call
            for n in sizes:
                if n > items:
                    continue  # the example cannot make a batch this large
                args, kwargs = self._assemble({**arguments, **self._head(arguments, n)})
                before = dict(self._fallbacks)
                try:
                    self(*args, **kwargs)
                except ReplayError as exc:
                    out[n] = f"error: {str(exc).splitlines()[0]}"
                    continue
                finally:
                    given.restore()
                new = [r for r, c in self._fallbacks.items() if c > before.get(r, 0)]
                out[n] = f"eager: {new[0]}" if new else f"bucket {self.buckets.pick(n)}"
        return out

    def verify(self, **options: Any) -> tuple:
        """Eager against replay per bucket, on fresh random inputs with outputs and padding
        poisoned first; see :func:`graphctl.graphs.verify.verify` (``gen``, ``rtol``, ``atol``)."""
        return _verify(self, **options)

    # --------------------------------------------------------------------------- audit

    def audit(self: "GraphRunner", params: Any = None) -> dict[int, Audit]:
        """Per bucket, the pointer and segment audits (``graphs/audit.py``). ``params``: the
        model tensors the forward reads (an ``nn.Module``, a name -> tensor mapping or an
        iterable); default the runner's ``params=``, or the module a decorated method is bound to."""
        return {b: audit_graph(self, b, self._model_tensors(params)) for b in self.captured}

    def _model_tensors(self: "GraphRunner", params: Any) -> dict[str, torch.Tensor]:
        if params is None:
            params = self.params
        if params is None and inspect.ismethod(self.fn) and isinstance(self.fn.__self__, torch.nn.Module):
            params = self.fn.__self__
        return param_tensors(params)

    def known_tensors(self: "GraphRunner", bucket: int) -> list[tuple[str, str, torch.Tensor]]:
        """``(kind, name, tensor)`` of the memory the runner itself knows for ``bucket``: the
        state's buffers and twins, its snapshot arenas, static inputs and outputs, frozen
        tensor arguments (the audit's named regions)."""
        out: list[tuple[str, str, torch.Tensor]] = []
        if self.state is not None:
            out += [("buffer", n, self.state.tensor(n)) for n in self.state.addresses()]
            out += [("arena", f"arena {n}", t) for n, t in self.state.arenas().items()]
        out += [("input", f"input:{slot.spec.name}", slot.static) for slot in self._slots]
        out += [("output", f"output[{i}]", t) for i, t in enumerate(self.outputs(bucket))]
        for name, (v, _) in self._frozen.items():
            out += [("argument", f"argument:{name}", t) for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        return out

    def nodes(self, bucket: int) -> list[Node]:
        """Every node of ``bucket``'s graph in capture order (CUDA: kernels with names, launch
        shapes and argument addresses; emulated: recorded ops)."""
        return self.graph(bucket).nodes()

    def census(self, bucket: int) -> dict[str, dict[str, int]]:
        """Node counts by type and by kernel (or op) name."""
        return census(self.nodes(bucket))

    def dot(self: "GraphRunner", bucket: int, path: str) -> None:
        """Write ``bucket``'s graph as Graphviz DOT (CUDA only: ``cudaGraphDebugDotPrint``)."""
        if self._backend is None or self._backend.name != "cuda":
            raise ReplayError("DOT export needs a CUDA graph", expected="backend 'cuda'",
                              found=self._backend.name if self._backend else "nothing captured",
                              fix="capture on a GPU (backend='cuda'); emulated graphs have nodes() instead")
        self.graph(bucket).dot(path)

    # ---------------------------------------------------------------------------- report

    def report(self: "GraphRunner") -> Report:
        """Per bucket: capture ms, pool bytes, nodes, segments, replay/eager µs (see ``report`` module)."""
        be = self._backend
        rows = tuple(BucketReport(b, c.capture_ms, c.graph.pool_bytes, c.graph.node_count, c.replay_us, c.eager_us,
                                  c.replays, c.segments) for b, c in sorted(self._graphs.items()))
        device = str(be.device) if be is not None else "-"
        if be is not None and be.device.type == "cuda":
            device = f"{device} ({torch.cuda.get_device_name(be.device)})"
        effects = tuple(dict(path=e.path, op=e.op, where=e.where, nbytes=e.nbytes, policy=self.side_effect_policy)
                        for e in self.side_effects)
        return Report(getattr(self.fn, "__qualname__", repr(self.fn)), be.name if be is not None else "-", device,
                      torch.__version__, rows, dict(self._fallbacks), effects)

    @property
    def captured(self: "GraphRunner") -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def static_input(self: "GraphRunner", name: str) -> torch.Tensor:
        """The static buffer behind input ``name`` (tests poison its padding with it)."""
        return next(slot.static for slot in self._slots if slot.spec.name == name)

    def graph(self: "GraphRunner", bucket: int) -> Any:
        """The backend graph of ``bucket`` (``.replay()``, ``.node_count``, ``.pool_bytes``, ``.nodes()``)."""
        return self._graphs[bucket].graph

    def outputs(self: "GraphRunner", bucket: int) -> list[torch.Tensor]:
        """The static output tensors of ``bucket``'s graph (tests poison them before replay)."""
        return [t for t in self._graphs[bucket].out_flat if isinstance(t, torch.Tensor)]

    def segments(self: "GraphRunner", bucket: int) -> tuple[Segment, ...]:
        return self._graphs[bucket].segments


def _tiled(inputs: Any, arguments: dict[str, Any], n: int, b: int) -> dict[str, torch.Tensor]:
    """The example's static inputs at ``b`` items: its first ``b`` items, or its ``n`` items
    repeated whole when ``b > n``."""
    out = {}
    for si in inputs:
        t = arguments[si.name]
        if b <= n:
            out[si.name] = t.narrow(si.dim, 0, b * si.per_item)
        else:
            idx = torch.arange(b * si.per_item, device=t.device) % (n * si.per_item)
            out[si.name] = t.index_select(si.dim, idx)
    return out


def _median_us(be: Any, fn: Callable[[], Any], iters: int, reset: Callable[[], None]) -> float:
    reset()
    fn()  # settle caches and lazy work
    samples = []
    if be.device.type == "cuda":
        for _ in range(iters):
            reset()  # queued before the start event: not timed
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3)
    else:
        for _ in range(iters):
            reset()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    reset()
    samples.sort()
    return samples[len(samples) // 2]

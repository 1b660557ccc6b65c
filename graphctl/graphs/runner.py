"""The graph runner: buckets, static inputs, two-pass capture, transactional replay.

A :class:`GraphRunner` wraps a forward function. ``capture_all(*example)`` (or the first call)
warms every bucket up eagerly, then captures from the largest bucket down into one shared
pool; a call with a batch of ``n`` then picks the smallest bucket ``>= n``, copies the live
inputs into the static ones, pads every declared tail, checks the address manifest, replays
(inside ``state.switch("draft", phase="refresh")``, the draft twins' refreshes, when the capture
holds a draft segment) and returns the outputs sliced to ``n``. ``refresh`` rather than
``replay``: a ``replay`` switch also snapshots the ``mutable`` buffers and would undo, on exit,
what the graph itself wrote to them.

Constraints (each is checked, and a violation raises a typed error):

- The forward must be capturable: static shapes per bucket, no host reads of device values,
  no allocation that later calls expect to see; the emulated backend names the offending
  file:line. Non-input arguments are frozen at capture: a later call must pass the same
  objects (tensors at the same address, equal scalars) or get ``ReplayError``.
- Inside the forward, enter the draft role with ``state.switch("draft")`` (phase ``auto``):
  warmups run it eagerly, the capture records it, eager fallbacks run it eagerly.
- Buffers declared ``mutable`` are snapshotted before every warmup, capture and measuring
  run and restored after it, so those runs never accumulate into live state.
- Returned tensors are views of the graph's static outputs: the next call overwrites them;
  clone what you keep. The forward must not write its static inputs.
- One runner per device; graphs share one memory pool and are captured largest first, so
  only replay them in any order when the forward frees nothing it allocated (the usual case
  for a forward whose outputs are kept by the graph).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from graphctl.errors import CaptureError, DeclarationError, ReplayError
from graphctl.graphs.analysis.nodes import Node, census
from graphctl.graphs.analysis.report import Report, Segment
from graphctl.graphs.backends.cuda import refuse_nested_capture
from graphctl.graphs.capture.bucket import BucketGraph
from graphctl.graphs.capture.calls import Signature, name_of, wraps
from graphctl.graphs.capture.inputs import StaticInput
from graphctl.graphs.capture.passes import capture_buckets
from graphctl.graphs.capture.record import Capture
from graphctl.graphs.face import RunnerFace, Unit, timed
from graphctl.graphs.findings.hoststate import HostChange
from graphctl.graphs.findings.side_effects import SideEffect
from graphctl.graphs.options import Options, per_instance
from graphctl.graphs.replay.distributed import Agreement, agreed_switch
from graphctl.knobs import knobs
from graphctl.state import BoundState, bind
from graphctl.state.snapshot import Snapshot

__all__ = ["GraphRunner"]

log = logging.getLogger("graphctl")
_KNOBS = knobs.live()  # a plain dict lookup on the call path (a knob attribute goes through __getattr__)


class GraphRunner(RunnerFace):
    """Captured graphs of ``fn``, one per bucket. Build it with :func:`graphctl.graphed`.

    Its options are one frozen :class:`~graphctl.graphs.options.Options` (``runner.options``,
    each option documented there). What ``capture_all`` produced is one
    :class:`~graphctl.graphs.capture.record.Capture` (``runner.capture``; ``None`` until then, and
    again after ``reset()``). See the module docstring for the constraints."""

    def __init__(self, fn: Callable[..., Any], options: Options | None = None, /, **given: Any) -> None:
        wraps(self, fn)
        self.fn = fn
        self.options = opts = options if options is not None else Options.of(**Options.named("GraphRunner", given))
        self.buckets = opts.buckets
        self._copy, self._paths = opts.copy_outputs, opts.check_paths  # read on every call: plain attributes
        # state="attr" names the instance's metadata when a method is decorated (see __get__)
        self._state_attr = opts.state if isinstance(opts.state, str) else None
        self._state = None if opts.state is None or self._state_attr is not None else \
            opts.state if isinstance(opts.state, BoundState) else bind(opts.state)
        self._sig = Signature(fn)
        for si in opts.inputs or ():
            if si.name not in self._sig.position:
                raise DeclarationError("static input is not a parameter of the forward", buffer=si.name,
                                       expected=f"one of {self._sig.names}", found=si.name,
                                       fix="fix the name in inputs=")
        self.capture: Capture | None = None  # None: nothing captured
        self._agreement: Agreement | None = None
        self._fallbacks: dict[str, int] = {}
        self.phase_s: dict[str, float] = {}
        self._streak = 0  # calls since the last replay, all eager (a bypassed runner: see _unservable)
        self._units = (Unit((), self),)

    def units(self) -> tuple[Unit, ...]:
        return self._units

    def _set_state(self, new: BoundState | None) -> None:  # repoint() hands the runner a newly bound state
        self._state = new
        if self.capture is not None:
            self.capture.state = new

    state = property(lambda self: self._state, _set_state, doc="The bound state (a BoundState), or None.")

    fallback = property(lambda self: self.options.fallback)
    backend_name = property(lambda self: self.options.backend)
    group = property(lambda self: self.options.group)
    params = property(lambda self: self.options.params)
    workspaces = property(lambda self: self.capture.workspaces if self.capture is not None else ())
    host_changes: tuple[HostChange, ...] = property(  # type: ignore[assignment]
        lambda self: self.capture.host_changes if self.capture is not None else ())

    @property
    def check_paths(self) -> bool | None:  # None: GRAPHCTL_CHECK_PATHS decides at each call
        return self.options.check_paths

    @check_paths.setter
    def check_paths(self, value: bool | None) -> None:
        self.options = dataclasses.replace(self.options, check_paths=Options.of(check_paths=value).check_paths)
        self._paths = self.options.check_paths

    @property
    def side_effects(self) -> tuple[SideEffect, ...]:
        """What the forward writes that graphctl does not own (see ``graphs/findings/stream.py``)."""
        return self.capture.ledger.effects if self.capture is not None else ()

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        """A decorated method gets one runner per instance (its own graphs, inputs and state)."""
        if obj is None:
            return self
        return per_instance(self.fn, self.options, obj, GraphRunner)

    # -------------------------------------------------------------------------- capture

    def capture_all(self, *args: Any, **kwargs: Any) -> GraphRunner:
        """Warm every bucket up eagerly, then capture them largest first into one pool. With
        ``group``, every rank must call it (the same buckets, in the same order: the forward's
        collectives are warmed up and captured in step).

        The example call fixes dtypes, devices, non-batch dims and every non-input argument;
        its first ``min(n, bucket)`` items fill each bucket's inputs, the rest is padding."""
        refuse_nested_capture()  # before anything is allocated or warmed up: a capture would record it
        if self.group is not None and self._agreement is None:
            self._agreement = Agreement(self.group)
        if self.capture is not None and self.capture.graphs:
            raise CaptureError("graphs are already captured", expected="one capture_all per runner",
                               found=f"buckets {list(self.captured)}", fix="call reset() first to capture again")
        if self._state_attr is not None:
            raise DeclarationError(f"state='{self._state_attr}' names an attribute of an instance",
                                   expected="a decorated method called on an instance", found="a plain call",
                                   fix="decorate a method (each instance gets its runner), or pass the state itself")
        try:
            arguments = self._sig.bind(args, kwargs)
            self.capture = Capture.make(self._sig, arguments, args, kwargs, self.options, self.state)
            with timed(self, "capture"):
                capture_buckets(self.fn, self.capture, self.options, arguments)
        except BaseException:
            self.reset()  # never keep some buckets of a failed capture_all: a call would find holes
            raise
        return self

    def pad_state(self, n: int) -> None:
        """The bound state describing a batch of ``n`` items: the ``prepare=`` option's (a variant
        runner's units get it with their values bound), else every padding policy past ``n``."""
        prepare = self.options.prepare
        if prepare is not None:
            prepare(n)
        elif self.state is not None:
            self.state.pad({a: n * m for a, m in self._captured_or_raise("pad_state").pad_axes.items()})

    def guard_all(self) -> Snapshot:
        """A snapshot of everything a run of the forward may change that the caller owns: every
        declared buffer but Stable scratch, the side effects being restored, random state."""
        led = self.capture.ledger if self.capture is not None else None  # and the undeclared random streams
        return Snapshot.of(self.state, BoundState.restorable_names, led.tensors if led else [],
                           [g for g, _ in led.generators] if led else [])

    def reset(self) -> None:
        """Drop every graph (and the static inputs); the next call captures again."""
        self.capture = None
        self._streak = 0

    # --------------------------------------------------------------------------- replay

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cap = self.capture
        if cap is None or not cap.graphs:
            cap = self.capture_all(*args, **kwargs)._captured_or_raise("a call")
        n, lives = cap.batch(args, kwargs)
        if self.buckets.pick(n) is None:
            err: ReplayError | None = ReplayError(
                "batch size outside the captured buckets", expected=f"1 <= n <= {self.buckets.largest}",
                found=f"n = {n}", fix="add a larger bucket or split the batch" +
                (", or pass fallback='eager'" if self.fallback == "error" else ""))
        else:
            err = cap.refusal(n, lives, args, kwargs, _KNOBS["check_paths"] if self._paths is None else self._paths)
        agreed = n
        if self._agreement is not None:  # with group=: every rank replays one bucket, or every rank runs eagerly
            agreed, all_ok = self._agreement.agree(n, err is None)
            if err is None and not all_ok:
                err = ReplayError("a peer rank cannot replay this call", expected="every rank servable",
                                  found=f"this rank n = {n}, largest n over ranks = {agreed}",
                                  fix="see the peer rank's log for its reason; all ranks run eagerly together")
            elif err is None and self.buckets.pick(agreed) is None:
                err = ReplayError("batch size outside the captured buckets (on a peer rank)",
                                  expected=f"1 <= n <= {self.buckets.largest} on every rank",
                                  found=f"largest n over ranks = {agreed}", fix="add a larger bucket")
        if err is not None:
            return self._unservable(args, kwargs, err, n)
        bucket = self.buckets.at(agreed)
        graph = cap.graphs[bucket]
        state = cap.state
        if state is not None:
            state.check_usable()  # a poisoned state never replays, with or without a refresh
        if not graph.checked or _KNOBS["check_manifest"]:  # before loading: never pad into a moved buffer
            cap.check_manifest(graph)
        cap.load(lives, n, bucket)
        self._replay(graph, cap)
        self._streak = 0
        return graph.result(n, self._copy, _KNOBS["check_outputs"])

    def _replay(self, graph: BucketGraph, cap: Capture) -> None:
        state = cap.state
        if graph.draft and cap.refreshes and state is not None:
            # the draft twins' refreshes around the replay (closed around a region that uses the state: bucket.py);
            # with group=, a refresh that fails on one rank restores on all, before any replay
            graph.replay(state, functools.partial(state.switch, "draft", phase="refresh") if self._agreement is None
                         else functools.partial(agreed_switch, state, "draft", self._agreement, phase="refresh"))
        else:
            graph.replay(state)
        graph.replays += 1

    def _unservable(self, args: tuple, kwargs: dict, err: ReplayError, n: int) -> Any:
        if self.fallback == "error":
            raise err
        # counted by kind (err.what: "batch size outside the captured buckets"), logged in full
        reason = f"[{err.buffer}] {err.what}" if err.buffer else err.what
        self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
        graphs = self.capture.graphs if self.capture is not None else {}
        graph = graphs.get(self.buckets.pick(n) or 0)
        if graph is not None:
            graph.eager_runs += 1
        self._streak += 1
        name = name_of(self.fn)
        log.warning("graphctl: %s runs eagerly: %s", name, err)
        if self._streak == knobs.bypass_window:  # once per streak: graphs that serve nothing are a silent slowdown
            log.warning("graphctl: %s: the last %d calls all ran eagerly, its %d graphs serve nothing (most frequent "
                        "reason: %s); see report()", name, self._streak, len(graphs),
                        max(self._fallbacks, key=self._fallbacks.__getitem__))
        return self.fn(*args, **kwargs)

    # ------------------------------------------------------- what a capture says about itself

    def _captured_or_raise(self, what: str) -> Capture:
        if self.capture is None:
            raise CaptureError("nothing captured yet", expected="capture_all() or a call first", found="no graphs",
                               fix=f"call capture_all(*example) before {what}")
        return self.capture

    @property
    def captured(self) -> tuple[int, ...]:  # the buckets captured, smallest first
        return tuple(sorted(self.capture.graphs)) if self.capture is not None else ()

    def _buckets_captured(self) -> tuple[int, ...]:  # what face.py keys by
        return self.captured

    @property
    def inputs(self) -> tuple[StaticInput, ...]:
        """The static inputs (declared, or every tensor argument of the example call)."""
        return self._captured_or_raise("inputs").inputs

    device = property(lambda self: self._captured_or_raise("device").backend.device)
    example_items = property(lambda self: self._captured_or_raise("example_items").n)

    def example_arguments(self) -> dict[str, Any]:  # the example call of capture_all, by parameter name
        args, kwargs = self._captured_or_raise("using the example").example
        return self._sig.bind(args, kwargs)

    def assemble(self, values: dict[str, Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` calling the forward with ``values`` (parameter name -> value)."""
        return self._sig.assemble(values)

    def written(self, n: int) -> list[tuple[str, str, torch.Tensor]]:
        """``(name, who writes it, tensor)`` of what a run may write that the caller owns (``Capture.written``)."""
        return self._captured_or_raise("written").written(n)

    def record(self, bucket: int) -> BucketGraph:  # graph, outputs, manifest, segments, counters
        return self._captured_or_raise("record").graphs[bucket]

    def graph(self, bucket: int) -> Any:  # .replay(), .node_count, .pool_bytes, .nodes()
        return self.record(bucket).graph

    def outputs(self, bucket: int) -> list[torch.Tensor]:  # the static output tensors of bucket's graph
        return [t for t in self.record(bucket).out_flat if isinstance(t, torch.Tensor)]

    def segments(self, bucket: int) -> tuple[Segment, ...]:
        return self.record(bucket).segments

    def static_input(self, name: str) -> torch.Tensor:  # the static buffer behind input name
        return next(slot.static for slot in self._captured_or_raise("static_input").slots if slot.spec.name == name)

    def known_tensors(self, bucket: int) -> list[tuple[str, str, torch.Tensor]]:
        """``(kind, name, tensor)`` the runner knows for ``bucket``: the audit's named regions."""
        return self._captured_or_raise("known_tensors").known_tensors(self.outputs(bucket), self.graph(bucket).regions)

    def nodes(self, bucket: int) -> list[Node]:
        """``bucket``'s nodes in capture order (CUDA: kernels, launch shapes, argument addresses; emulated: ops)."""
        return self.graph(bucket).nodes()

    def census(self, bucket: int) -> dict[str, dict[str, int]]:  # node counts by type and kernel (or op) name
        return census(self.nodes(bucket))

    def dot(self, bucket: int, path: str) -> None:
        """Write ``bucket``'s graph as Graphviz DOT (CUDA only: ``cudaGraphDebugDotPrint``)."""
        self.graph(bucket).dot(path)

    def _unit_report(self) -> Report:
        """This unit's report (``face.py`` merges the units'): per bucket capture ms, pool bytes,
        nodes, segments, replay/eager µs (``analysis/report.py``), and the capture's findings."""
        name = name_of(self.fn)
        if self.capture is None:
            return Report(name, "-", "-", torch.__version__, (), dict(self._fallbacks), eager_streak=self._streak)
        return self.capture.report(name, self.options, dict(self._fallbacks), self._streak)

"""The two capture passes, filling one :class:`~graphctl.graphs.capture.record.Capture`.

:func:`capture_buckets` runs them on the record the example call made:

1. **warmup**, every bucket, largest first: each bucket starts from the caller's state, loads
   the example's first ``min(n, bucket)`` items (padding the state for the bucket), and runs
   the forward eagerly under the mutable-buffer guard: ``warmup_iters`` times at the largest
   bucket, once (``min(warmup_iters, 1)``) at each smaller one (what a second run would do
   that the first did not is process-wide, and the largest bucket's runs did it); a compiled
   forward ``max(warmup_iters, 2)`` times at every bucket (its tracked run is eager). Every eager run
   goes under the side-effect tracker (``graphs/findings/stream.py``): in full (writes, reads, padding
   taint) the largest bucket's first run and the first run of each bucket holding padded rows,
   the others for writes only (the tracker's cost paid once per forward where padding cannot
   differ); what they find is restored after every run. Every workspace reaches its high-water
   mark before any capture, so no capture records a first-time allocation.
2. **capture**, largest first into one pool (smaller graphs reuse its blocks), each bucket
   from the caller's state again, segments marked at every switch boundary.

The objects the forward reaches are walked twice (``graphs/findings/reach.py``): before the passes and
after them. The caller's state (declared buffers and side effects) is handed back as it was
found, on success and on any exception. Compiled forwards (``graphs/capture/compiled.py``): the first
run of a bucket goes under the ``force_eager`` stance (tracked), the others run compiled
(untracked: a digest of the watched storages finds what they alone write), and dynamo's work
is counted per bucket (a frame it must convert during a capture ran uncompiled).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from graphctl.errors import CaptureError
from graphctl.graphs.analysis.audit import param_tensors
from graphctl.graphs.analysis.nodes import Region
from graphctl.graphs.capture import compiled, pieces
from graphctl.graphs.capture.bucket import BucketGraph, gc_held, segments_from_marks, settle_slicing, spans_from_marks
from graphctl.graphs.capture.calls import name_of
from graphctl.graphs.capture.record import Capture
from graphctl.graphs.findings import hoststate, reach
from graphctl.graphs.findings.randomness import declared_generators
from graphctl.graphs.findings.reach import storage_key
from graphctl.graphs.options import Options
from graphctl.graphs.replay import rebinding
from graphctl.state import BoundState, CopyInPlace
from graphctl.state import paths as entry_paths
from graphctl.state.phase import given
from graphctl.state.snapshot import Snapshot

__all__ = ["capture_buckets"]

log = logging.getLogger("graphctl")


def capture_buckets(fn: Callable[..., Any], cap: Capture, opts: Options, arguments: dict[str, Any]) -> None:
    """Both passes (see the module docstring), their results kept in ``cap``. The objects
    the forward reaches are walked twice (``graphs/findings/reach.py``): before the passes (what the
    write tracker watches, host values before, compiled callables) and after them (host values
    after, the paths to check, what is reached at all)."""
    p = _Passes(fn, cap, opts)
    name = name_of(fn)
    start = reach.roots(fn, arguments, opts.params, cap.sig.get)
    # the forward itself is never a site nor entered (the runner calls it); a module passed as the forward is the
    # walk's "self" root, its parameters and buffers reached through it
    me = None if isinstance(fn, torch.nn.Module) and not compiled.is_compiled(fn) else fn
    first = reach.walk(start, skip=me)
    compiled.refuse_inductor_graphs(p.fn, first.sites)
    stats: dict[int, dict[str, int]] = {}
    stuck: list[str] = []
    try:
        graphs, workspaces = _passes(p, arguments, first, stats)
    finally:  # whatever happened, the host values are compared (and, by policy, put back)
        last = reach.walk(start, skip=me)
        found = hoststate.changes(first.host, last.host)
        if found and p.opts.host_state != "warn":
            stuck = hoststate.put_back(first.host, found)
    if found:
        if p.opts.host_state == "error":
            raise hoststate.refuse(found)
        done = "" if p.opts.host_state != "restore" else \
            " (put back)" if not stuck else f" (put back, except {'; '.join(stuck)})"
        log.warning("graphctl: %s: warmup and capture changed host state the graph may have baked%s: %s",
                    name, done, "; ".join(map(str, found)))
    # declared buffers are checked as the state's entries; copy sources are looked up afresh at every switch
    skip = _owned(p) | _sources(p.cap.state)
    checks, unchecked = rebinding.collect(last, p.cap.ledger.used, skip, rebinding.entries_of(p.cap.state))
    skip |= {storage_key(t) for t in _model_tensors(p.opts.params)}
    if unchecked:
        log.warning("graphctl: %s: %d paths past the %d checked per replay (%s) are not checked for rebinding; "
                    "weights go first: after rebinding one, call runner.repoint() or capture again", name,
                    sum(unchecked.values()), rebinding.MAX_PATHS, ", ".join(f"{c} {r}" for r, c in unchecked.items()))
    reached = first.tensors.keys() | last.tensors.keys() | skip  # read before the forward ran, with no path to it
    p.cap.ledger.unreached = tuple(u for k, u in p.cap.ledger.external.items() if k not in reached)
    # The walk's bounds matter only where the forward read something no path reaches: said there, with the cause.
    # Objects past them that the forward never read from cost nothing (a hint for the curious: report().reach).
    if p.cap.ledger.unreached:
        cut = f" (the reach walk stopped early: {last.cuts()}; pass that state as an argument)" if last.cuts() else ""
        log.warning("graphctl: %s: tensors the graph reads that no checked path reaches%s: %s",
                    name, cut, "; ".join(map(str, p.cap.ledger.unreached)))
    elif last.cuts():
        log.debug("graphctl: %s: the reach walk stopped early (%s); the forward read nothing past it", name,
                  last.cuts())
    for b, st in sorted(stats.items()):
        if st["uncompiled"]:
            log.warning("graphctl: %s: bucket %d: dynamo was asked to convert %d frame(s) during the capture (a guard "
                        "that failed after the warmups, or a recompile limit): compiled frames ran uncompiled",
                        name, b, st["uncompiled"])
    paths_of_sites = tuple(s.path for s in first.sites) + (("forward",) if compiled.is_compiled(p.fn) else ())
    counts = {"objects": last.objects, "tensors": len(last.tensors), "host_values": len(last.host),
              "paths_checked": sum(c.role != "module" for c in checks), "paths_unchecked": sum(unchecked.values()),
              "past_depth": last.cut["depth"], "past_bound": last.cut["nodes"]}
    cap.graphs, cap.workspaces, cap.host_changes, cap.paths = graphs, workspaces, tuple(found), checks
    cap.compile, cap.sites, cap.reach = stats, paths_of_sites, counts


@dataclasses.dataclass(slots=True)
class _Passes:
    fn: Callable[..., Any]
    cap: Capture
    opts: Options
    # whole copies of the Persistent buffers around each run, where rows cannot undo them (see _passes)
    lasting: Snapshot | None = None


def _model_tensors(params: Any) -> list[torch.Tensor]:
    """The tensors of ``params=`` (the model's weights: known, never unreached)."""
    try:
        return list(param_tensors(params).values()) if params is not None else []
    except TypeError:  # an unusable params= is the audit's to report, with its message
        return []


def _sources(state: BoundState | None) -> set[tuple[str, int]]:
    """Storage keys of the declared copy sources (a path, or a function of the object): looked up
    afresh at every switch, so rebinding them between calls is the declared way to feed a refresh,
    not a stale read."""
    out: set[tuple[str, int]] = set()
    if state is None:
        return out
    for d in state.plan.buffers.values():
        for act in (d.draft, d.refresh):
            if not isinstance(act, CopyInPlace):
                continue
            try:  # a source only computes (its contract): one more lookup here changes nothing
                src = act.source(state.obj) if callable(act.source) else entry_paths.get(state.obj, act.source)
            except Exception:
                continue
            if isinstance(src, torch.Tensor):
                out.add(storage_key(src))
    return out


def _owned(p: _Passes) -> set[tuple[str, int]]:
    """Storage keys graphctl owns: static inputs, declared buffers (twins too), snapshot arenas."""
    owned = {storage_key(slot.static) for slot in p.cap.slots}
    if p.cap.state is not None:
        owned |= {storage_key(p.cap.state.tensor(n)) for n in p.cap.state.plan.buffers}
        owned |= {storage_key(t) for t in p.cap.state.arenas().values()}
    return owned


def _passes(p: _Passes, arguments: dict[str, Any], first: reach.Reach,
            stats: dict[int, dict[str, int]]) -> tuple[dict[int, BucketGraph], tuple[Region, ...]]:
    be, sites = p.cap.backend, first.sites
    watched = first.watched()
    # the tracked run is eager by design (compiled.py): a compiled forward gets one compiling run more, in every
    # bucket (dynamo compiles each shape). An eager forward runs warmup_iters times at the largest bucket, first:
    # process-wide first-call work and every workspace's high-water mark are behind it; a smaller bucket's first
    # run does what is new to its shapes (a kernel variant built, a cache keyed by them filled), so one suffices
    compiled_fn = bool(sites) or compiled.is_compiled(p.fn)  # compiled code anywhere in the forward
    if compiled_fn:
        compiled.use_compile_cache()  # GRAPHCTL_COMPILE_CACHE: before the warmups compile anything
    runs = max(p.opts.warmup_iters, 2) if compiled_fn else p.opts.warmup_iters
    order = sorted(p.opts.buckets.sizes, reverse=True)
    graphs: dict[int, BucketGraph] = {}
    # Persistent buffers (KV-cache pools): where every warmup is tracked (an eager forward) each one's writes are
    # undone by the rows they touched (graphs/findings/journal.py), and a capture that executes gets a whole copy; a
    # compiled forward's untracked runs get whole copies around every run, as mutable buffers do (cap.guard)
    lasting = _lasting(p)
    journaled = {} if compiled_fn else {storage_key(t): t for t in lasting.values()}
    if lasting and not journaled:
        p.lasting = Snapshot(list(lasting.values()))
    met = pieces.calls()
    with Snapshot.of(p.cap.state, lambda st: [n for n in BoundState.restorable_names(st) if n not in lasting]) \
            as given, gc_held(), _progress(p.opts.progress) as bar:
        task = bar.add_task("warmup", total=2 * len(order)) if bar else None
        be.synchronize()
        before = be.live_blocks()
        for b in order:  # pass 1: every workspace reaches its high-water mark before any capture
            given.restore()
            p.cap.load_example(arguments, b)
            call = p.cap.call_args(arguments, b)
            dynamo = compiled.Counters.now()
            t_warm = time.perf_counter()
            untracked = None  # a compiled forward's compiled runs: no tracker can watch them (compiled.py)
            for it in range(runs if b == order[0] or compiled_fn else min(runs, 1)):
                try:
                    with p.cap.guard, p.lasting or contextlib.nullcontext():
                        if it == 0 or not compiled_fn:
                            # in full (writes, reads, padding taint): the forward's first run, and the first
                            # of each bucket with padded rows (only they can index a write with a pad);
                            # every other eager run for its writes (lean): a write may start on any run
                            full = it == 0 and (b == order[0] or b > p.cap.n)
                            given.adopt(_tracked_warmup(p, call, watched, lean=not full, journaled=journaled))
                            given.adopt_generators(p.cap.ledger.generators)  # undeclared streams: restored too
                            p.cap.guard.adopt_generators(p.cap.ledger.generators)
                        else:
                            if untracked is None:
                                untracked = p.cap.ledger.digest(watched)
                            be.warmup(lambda: p.fn(*call[0], **call[1]))
                except BaseException as exc:
                    typed = pieces.fullgraph_error(exc)
                    if typed is not None:
                        raise typed from exc
                    exc.add_note(f"graphctl: raised while warming up bucket {b}; the caller's state was restored")
                    raise
                if p.cap.ledger.tensors:  # the next run starts from the caller's state too
                    given.restore(added_only=True)
            if untracked is not None and (late := p.cap.ledger.untracked(untracked)):
                log.warning("graphctl: %s: bucket %d: compiled warmups wrote state the tracked (eager) run did not: "
                            "it cannot be restored: %s", name_of(p.fn), b,
                            "; ".join(e.path for e in late))
            be.synchronize()
            p.cap.warmup_ms[b] = (time.perf_counter() - t_warm) * 1e3
            done = compiled.Counters.now().since(dynamo)
            stats[b] = {"warmup_frames": done.frames, "warmup_graphs": done.graphs, "breaks": done.breaks,
                        "uncompiled": 0, "cache_hits": done.cache_hits, "cache_misses": done.cache_misses}
            if bar:
                bar.update(task, advance=1, description=f"warmup bucket {b}")
        be.synchronize()
        skipped = compiled.never_compiled(p.fn, sites)  # dynamo holds no code for them: they run uncompiled
        if skipped:
            log.warning("graphctl: %s: compiled callables with no compiled code after the warmups (dynamo skips them, "
                        "e.g. after running under a dispatch mode elsewhere): %s", name_of(p.fn),
                        ", ".join(skipped))
        for st in stats.values():
            st["uncompiled"] = len(skipped)
        # what warmup allocated and kept is library state (cuBLAS workspaces): the audit's "workspace"
        workspaces = tuple(Region(f"warmup allocation of {n} B", "workspace", a, a + n)
                           for a, n in sorted(be.live_blocks() - before))
        shared = p.opts.pool  # a variant runner's: every variant captures into one pool
        pool = shared.handle if shared is not None and shared.handle is not None else be.new_pool()
        if shared is not None:
            shared.handle = pool
        if journaled and (be.capture_executes or pieces.calls() != met):  # the capture runs the forward's writes
            p.lasting = Snapshot(list(lasting.values()))
        # memory that existed before the capture: a region returning some of it is an alias, never copied into
        known = set(first.tensors) | _owned(p) | {storage_key(t) for t in _model_tensors(p.opts.params)} | \
            {storage_key(t) for t in p.cap.ledger.before_tensors()}

        def existing(t: torch.Tensor) -> bool:
            return storage_key(t) in known
        t_start = time.perf_counter()
        for b in order:  # pass 2: largest first, so smaller graphs reuse its pool blocks
            given.restore()
            p.cap.load_example(arguments, b)
            dynamo = compiled.Counters.now()
            graphs[b] = _capture_one(p, b, p.cap.call_args(arguments, b), pool, existing)
            stats[b]["uncompiled"] += compiled.Counters.now().since(dynamo).frames
            if bar:
                pool_mib = sum(c.graph.pool_bytes for c in graphs.values()) / 2**20
                bar.update(task, advance=1, description=f"captured bucket {b} "
                           f"({time.perf_counter() - t_start:.1f}s, pool {pool_mib:.1f} MiB)")
        settle_slicing(list(graphs.values()))
    return graphs, workspaces


def _lasting(p: _Passes) -> dict[str, torch.Tensor]:
    """The declared Persistent buffers by name: what a journal undoes by rows."""
    st = p.cap.state
    return {} if st is None else {n: st.tensor(n) for n, d in st.plan.buffers.items() if d.persistent}


def _tracked_warmup(p: _Passes, call: tuple[tuple, dict], watched: dict, lean: bool,
                    journaled: dict[tuple[str, int], torch.Tensor]) -> list:
    """An eager run under the write tracker: what it writes to tensors that existed before it
    and graphctl does not own is a side effect (returned as new ``(live, copy)`` pairs); what it
    writes into ``journaled`` storages is undone by rows after it."""
    owned = _owned(p)
    be = p.cap.backend
    # integer inputs whose padded rows hold valid indices (anything but a negative sentinel)
    padded = {storage_key(s.static): s.spec.name for s in p.cap.slots
              if not s.static.dtype.is_floating_point and s.static.dtype != torch.bool
              and not (s.spec.pad.kind == "fill" and s.spec.pad.value is not None and s.spec.pad.value < 0)}
    known = len(p.cap.ledger.hazards)

    def run() -> Any:
        stance = None
        try:
            stance = compiled.eager()  # dynamo never meets the tracker's dispatch mode (compiled.py)
            with stance:
                return be.warmup(lambda: p.fn(*call[0], **call[1]))
        finally:  # again: an interrupt at the with-statement's exit skips its __exit__ (harmless twice)
            if stance is not None:
                stance.__exit__(None, None, None)

    pairs = p.cap.ledger.track(run, watched, owned, be.synchronize, None if lean else padded, lean, journaled)
    if p.cap.ledger.published:
        found = p.cap.ledger.published
        raise CaptureError("an eager region publishes a tensor a later piece reads", buffer=found[0].region,
                           expected="every tensor that crosses a region boundary returned by the region",
                           found="; ".join(map(str, found)),
                           fix="return the tensor from the region and use the returned one (a replay calls the region "
                               "again, and the pieces read only what it returns)")
    for h in list(p.cap.ledger.hazards.values())[known:]:
        log.warning("graphctl: %s: %s", name_of(p.fn), h)
    if pairs:
        log.info("graphctl: %s writes state it does not own (restored around every warmup, capture, measure "
                 "and verify run, %d B of snapshots): %s", name_of(p.fn),
                 p.cap.ledger.nbytes, "; ".join(map(str, p.cap.ledger.effects)))
    return pairs


def _capture_one(p: _Passes, bucket: int, call: tuple[tuple, dict], pool: Any,
                 existing: Callable[[torch.Tensor], bool]) -> BucketGraph:
    marks: list[tuple[str, int]] = []
    be = p.cap.backend

    def body(mark: Callable[[], int]) -> Any:
        def observe(role: str, phase: str, event: str) -> None:
            if phase == "capture":
                marks.append((event, mark()))
        if p.cap.state is None:
            return p.fn(*call[0], **call[1])
        with p.cap.state.observe(observe), pieces.watching(_Watch(p.cap, bucket)):
            return p.fn(*call[0], **call[1])

    t0 = time.perf_counter()
    # the generators a CUDA capture must register: declared ones, and undeclared ones the warmups drew from
    gens = [*declared_generators(p.cap.state).values(), *(g for g, _ in p.cap.ledger.generators)]
    with p.cap.guard, p.lasting or contextlib.nullcontext(), given(p.cap.state):
        graph, out = be.capture(body, pool, bucket, gens)
    ms = (time.perf_counter() - t0) * 1e3
    for region in graph.regions:  # what later pieces wrote, and results on memory that existed before
        region.seal(existing)
    return BucketGraph(graph, out, bucket, p.cap.manifest(), segments_from_marks(marks, graph.node_count), ms,
                       frozenset({1} | {si.per_item for si in p.cap.inputs}), spans_from_marks(marks),
                       None if be.capture_executes else be.device.type)


class _Watch:
    """The runner's checks at each eager region of one bucket's capture (``graphs/capture/pieces.py``)."""

    __slots__ = ("cap", "bucket")

    def __init__(self, cap: Capture, bucket: int) -> None:
        self.cap, self.bucket = cap, bucket

    def admit(self, name: str, in_switch: bool) -> bool:
        """No switch open across a region unless it is declared ``in_switch``; whether one is."""
        sw = self.cap.state.active_switch if self.cap.state is not None else None
        if sw is not None and not in_switch:
            raise CaptureError("a state.switch is open across an eager region", buffer=name,
                               expected="every switch closed before an @graphctl.eager call",
                               found=f"the switch to '{sw.role}' ({sw.phase}) open", bucket=self.bucket,
                               fix="close the switch before the call and open another after it, or open the switch "
                                   "inside the eager function; declare @graphctl.eager(in_switch=True) only if the "
                                   "function reads the state through its arguments alone")
        return sw is not None

    def uses(self) -> int:
        return self.cap.state.uses if self.cap.state is not None else 0

    def used(self, name: str, in_switch: bool) -> None:
        """The region switched, wrote or padded the state: fine outside every switch (a replay
        closes the runner's refresh switch around it), refused inside one."""
        sw = self.cap.state.active_switch if self.cap.state is not None else None
        if sw is not None:
            raise CaptureError("an eager region inside a switch uses the state", buffer=name,
                               expected="an in_switch region that reads the state through its arguments alone",
                               found=f"state.switch, write or pad called inside the open '{sw.role}' switch",
                               bucket=self.bucket,
                               fix="move the write out of the region (before the switch, or in the piece around the "
                                   "region), or close the switch before the region and let the region open its own")


def _progress(show: bool | None) -> Any:
    if show is None:
        show = sys.stderr.isatty()
    if not show:
        return contextlib.nullcontext(None)
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), transient=True)

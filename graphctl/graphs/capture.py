"""The two capture passes, and what the example call fixes for every bucket.

:class:`Fixed` is the runner's one "captured" state: made by :meth:`Fixed.make` from the
example call at ``capture_all``, dropped by ``reset()``; before it exists nothing is captured.
:func:`capture_buckets` runs the passes on it:

1. **warmup**, every bucket, largest first: each bucket starts from the caller's state, loads
   the example's first ``min(n, bucket)`` items (padding the state for the bucket), and runs
   the forward eagerly ``warmup_iters`` times under the mutable-buffer guard. Each bucket's
   first run goes under the side-effect tracker (``graphs/effects.py``); what it finds is
   restored after every later run. Every workspace reaches its high-water mark before any
   capture, so no capture records a first-time allocation.
2. **capture**, largest first into one pool (smaller graphs reuse its blocks), each bucket
   from the caller's state again, segments marked at every switch boundary.

The caller's state (declared buffers and side effects) is handed back as it was found, on
success and on any exception. Compiled forwards (``graphs/compiled.py``): the tracked run goes
under the ``force_eager`` stance, every bucket gets at least one compiling warmup, and dynamo's
work is counted per bucket (a frame it must convert during a capture ran uncompiled).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphctl.errors import DeclarationError, ReplayError
from graphctl.graphs import compiled, hoststate, reach, rebinding
from graphctl.graphs.analysis.audit import param_tensors
from graphctl.graphs.analysis.nodes import Region
from graphctl.graphs.backends import GraphBackend, select_backend
from graphctl.graphs.calls import Signature
from graphctl.graphs.captured import Captured, gc_held, segments_from_marks, settle_slicing
from graphctl.graphs.effects import Ledger, storage_key
from graphctl.graphs.frozen import freeze
from graphctl.graphs.inputs import Buckets, InputSlot, StaticInput
from graphctl.state import BoundState, CopyInPlace, paths
from graphctl.state.snapshot import Snapshot

__all__ = ["Fixed", "capture_buckets"]

log = logging.getLogger("graphctl")


@dataclasses.dataclass(slots=True)
class Fixed:
    """What the example call fixed, from ``capture_all`` until ``reset()``."""

    inputs: tuple[StaticInput, ...]
    slots: tuple[InputSlot, ...]
    positions: tuple[int, ...]  # each static input's position in the forward's signature
    pad_axes: dict[str, int]
    backend: GraphBackend
    guard: Snapshot  # the mutable buffers (and what derives from them), around every run
    refreshes: bool  # the state has draft twins to refresh around replay
    frozen: dict[str, tuple[Any, Any]]  # non-input argument -> (object, structural copy)
    example: tuple[tuple, dict]
    n: int  # the example's batch items

    @classmethod
    def make(cls, sig: Signature, arguments: dict[str, Any], args: tuple, kwargs: dict, *, declared:
             tuple[StaticInput, ...] | None, pad_axes: dict[str, int] | None, largest: int, backend: str,
             state: BoundState | None, batch: Callable[[tuple[StaticInput, ...], dict[str, Any]],
                                                       tuple[int, list[Any]]]) -> Fixed:
        inputs = declared
        if inputs is None:
            inputs = tuple(StaticInput(n) for n, v in arguments.items() if isinstance(v, torch.Tensor))
        if not inputs:
            raise DeclarationError("the forward has no static input", expected="at least one tensor argument",
                                   found=list(arguments), fix="declare inputs=('input_ids', ...)")
        slots = tuple(InputSlot(si, si.allocate(arguments[si.name], largest)) for si in inputs)
        names = {si.name for si in inputs}
        pads = pad_axes if pad_axes is not None else {"seq": 1, "token": inputs[0].per_item}
        for name, d in state.plan.buffers.items() if state is not None else ():
            # a bucket's padded rows must exist in every padded state buffer (else the forward sees
            # buffers shorter than its inputs, and fails somewhere inside with a shape error)
            if d.axis in pads and state.tensor(name).shape[d.axis_dim] < largest * pads[d.axis]:
                rows = state.tensor(name).shape[d.axis_dim]
                raise DeclarationError("the largest bucket does not fit the bound state", buffer=name,
                                       expected=f"at least {largest * pads[d.axis]} rows along '{d.axis}' "
                                                f"(bucket {largest} x {pads[d.axis]})", found=f"{rows} rows",
                                       fix=f"capture buckets up to {rows // pads[d.axis]}, or size the state "
                                           f"(e.g. max_seqs) for {largest} items")
        n, lives = batch(inputs, arguments)
        for slot, live in zip(slots, lives):
            err = slot.spec.check(live, slot.static, n)
            if err is not None:
                raise err
        return cls(
            inputs=inputs, slots=slots, positions=tuple(sig.position[si.name] for si in inputs),
            pad_axes=pads,
            backend=select_backend(backend, slots[0].device),
            guard=Snapshot.of(state, BoundState.mutable_names),
            # the replay-time refreshes of draft twins; a spec without any needs no switch around replay
            refreshes=state is not None and bool(state.snapshot_names("refresh")),
            # Non-input arguments are baked into the graph: keep each object and a structural copy
            # of what it held (containers are compared by contents at every call: an in-place
            # change to a dict or list passed here would otherwise replay capture-time values).
            frozen={k: (v, freeze(v)) for k, v in arguments.items() if k not in names},
            example=(args, kwargs), n=n)

    def input_addresses(self) -> dict[str, int]:
        # every bucket's view starts at its static buffer's first byte
        return {f"input:{slot.spec.name}": slot.static.data_ptr() for slot in self.slots}

    def check_manifest(self, cap: Captured, state: BoundState | None) -> None:
        """Raise ``ReplayError`` naming the first static buffer (input or declared) whose address
        moved since ``cap`` was captured; mark ``cap`` checked otherwise."""
        live = self.input_addresses()
        if state is not None:
            live.update(state.live_addresses())
        for name, want in cap.manifest.items():
            got = live.get(name)
            if got != want:
                sw = state._active if state is not None else None
                if sw is not None:  # the swap moved it, nobody else: say where the call is
                    raise ReplayError(f"a graphed call inside an active '{sw.role}' switch ({sw.phase})",
                                      buffer=name, expected="a call outside any switch of its state",
                                      found=f"'{name}' bound to its {sw.role} twin", fix="call the graphed "
                                      "function outside the with-statement: its graph holds its own switches")
                raise ReplayError("static buffer moved since capture", buffer=name, expected=f"{want:#x}",
                                  found="not a tensor" if got is None else f"{got:#x}",
                                  fix="write into the buffer in place (state.write / copy_) instead of rebinding "
                                      "it, or reset() and capture again")
        cap.checked = True

    def known_tensors(self, state: BoundState | None,
                      outputs: list[torch.Tensor]) -> list[tuple[str, str, torch.Tensor]]:
        """``(kind, name, tensor)`` of the memory the runner knows: the state's buffers and
        twins, its snapshot arenas, the static inputs, ``outputs``, frozen tensor arguments."""
        out: list[tuple[str, str, torch.Tensor]] = []
        if state is not None:
            out += [("buffer", n, state.tensor(n)) for n in state.addresses()]
            out += [("arena", f"arena {n}", t) for n, t in state.arenas().items()]
        out += [("input", f"input:{slot.spec.name}", slot.static) for slot in self.slots]
        out += [("output", f"output[{i}]", t) for i, t in enumerate(outputs)]
        for name, (v, _) in self.frozen.items():
            out += [("argument", f"argument:{name}", t) for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        return out

    def head(self, arguments: dict[str, Any], m: int) -> dict[str, torch.Tensor]:
        """The example's static inputs cut to their first ``m`` items, in input order."""
        return {si.name: arguments[si.name].narrow(si.dim, 0, m * si.per_item) for si in self.inputs}


@dataclasses.dataclass(slots=True)
class Passes:
    """What the two passes need from the runner, explicitly."""

    fn: Callable[..., Any]
    fixed: Fixed
    state: BoundState | None
    ledger: Ledger
    buckets: Buckets
    warmup_iters: int
    params: Any
    load: Callable[[dict[str, Any], int, int], None]  # (arguments, n, bucket): inputs and state padded
    call_args: Callable[[dict[str, Any], int], tuple[tuple, dict]]  # the forward's call on a bucket's views
    manifest: Callable[[], dict[str, int]]
    progress: bool | None
    host_policy: str = "warn"  # host_state= (graphs/hoststate.py)


@dataclasses.dataclass(frozen=True)
class Result:
    graphs: dict[int, Captured]
    workspaces: tuple[Region, ...]  # what the warmups allocated and kept (library workspaces)
    host_changes: tuple[hoststate.HostChange, ...]  # host values the passes changed (policy applied)
    paths: list[rebinding.PathCheck]  # tensors reached through the arguments, re-checked at every replay
    # bucket -> dynamo's work: "warmup" (frames converted and graphs compiled while warming it up),
    # "uncompiled" (frames dynamo was asked to convert during its capture: run uncompiled), "breaks"
    compile: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    sites: tuple[str, ...] = ()  # the compiled callables the forward reaches, by path
    reach: dict[str, int] = dataclasses.field(default_factory=dict)  # what the walk saw and left out


def capture_buckets(p: Passes, arguments: dict[str, Any], get_arg: Callable[[tuple, dict, str], Any]) -> Result:
    """Both passes (see the module docstring), then what the runner keeps of them. The objects
    the forward reaches are walked twice (``graphs/reach.py``): before the passes (what the
    write tracker watches, host values before, compiled callables) and after them (host values
    after, the paths to check, what is reached at all)."""
    name = getattr(p.fn, "__qualname__", p.fn)
    start = reach.roots(p.fn, arguments, p.params, get_arg)
    first = reach.walk(start, skip=p.fn)
    compiled.refuse_inductor_graphs(p.fn, first.sites)
    stats: dict[int, dict[str, int]] = {}
    stuck: list[str] = []
    try:
        graphs, workspaces = _passes(p, arguments, first, stats)
    finally:  # whatever happened, the host values are compared (and, by policy, put back)
        last = reach.walk(start, skip=p.fn)
        found = hoststate.changes(first.host, last.host)
        if found and p.host_policy != "warn":
            stuck = hoststate.put_back(first.host, found)
    if found:
        if p.host_policy == "error":
            raise hoststate.refuse(found)
        done = "" if p.host_policy != "restore" else \
            " (put back)" if not stuck else f" (put back, except {'; '.join(stuck)})"
        log.warning("graphctl: %s: warmup and capture changed host state the graph may have baked%s: %s",
                    name, done, "; ".join(map(str, found)))
    skip = _owned(p) | _sources(p.state) | {storage_key(t) for t in _model_tensors(p.params)}
    paths, unchecked = rebinding.collect(last, p.ledger.used, skip)
    if unchecked or last.cuts():
        log.warning("graphctl: %s: the reach walk left state out: %s", name, "; ".join(
            ([f"{sum(unchecked.values())} paths past the {rebinding.MAX_PATHS} checked per replay ("
              + ", ".join(f"{c} {r}" for r, c in unchecked.items()) + ")"] if unchecked else [])
            + ([last.cuts()] if last.cuts() else [])))
    reached = first.tensors.keys() | last.tensors.keys() | skip  # read before the forward ran, with no path to it
    p.ledger.unreached = tuple(u for k, u in p.ledger.external.items() if k not in reached)
    if p.ledger.unreached:
        log.warning("graphctl: %s: tensors the graph reads that no checked path reaches: %s",
                    name, "; ".join(map(str, p.ledger.unreached)))
    for b, st in sorted(stats.items()):
        if st["uncompiled"]:
            log.warning("graphctl: %s: bucket %d: dynamo was asked to convert %d frame(s) during the capture (a guard "
                        "that failed after the warmups, or a recompile limit): compiled frames ran uncompiled",
                        name, b, st["uncompiled"])
    paths_of_sites = tuple(s.path for s in first.sites) + (("forward",) if compiled.is_compiled(p.fn) else ())
    counts = {"objects": last.objects, "tensors": len(last.tensors), "host_values": len(last.host),
              "paths_checked": len(paths), "paths_unchecked": sum(unchecked.values()),
              "past_depth": last.cut["depth"], "past_bound": last.cut["nodes"]}
    return Result(graphs, workspaces, tuple(found), paths, stats, paths_of_sites, counts)


def _model_tensors(params: Any) -> list[torch.Tensor]:
    """The tensors of ``params=`` (the model's weights: never rebound per step, never path-checked)."""
    try:
        return list(param_tensors(params).values()) if params is not None else []
    except TypeError:  # an unusable params= is the audit's to report, with its message
        return []


def _sources(state: BoundState | None) -> set[tuple[str, int]]:
    """Storage keys of the declared copy sources (a path, or a function of the object): looked up
    afresh at every switch, so rebinding them between calls is the declared way to feed a refresh,
    not a stale read."""
    out: set[tuple[str, int]] = set()
    for d in state.plan.buffers.values() if state is not None else ():
        for act in (d.draft, d.refresh):
            if not isinstance(act, CopyInPlace):
                continue
            try:  # a source only computes (its contract): one more lookup here changes nothing
                src = act.source(state.obj) if callable(act.source) else paths.get(state.obj, act.source)
            except Exception:
                continue
            if isinstance(src, torch.Tensor):
                out.add(storage_key(src))
    return out


def _owned(p: Passes) -> set[tuple[str, int]]:
    """Storage keys graphctl owns: static inputs, declared buffers (twins too), snapshot arenas."""
    owned = {storage_key(slot.static) for slot in p.fixed.slots}
    if p.state is not None:
        owned |= {storage_key(p.state.tensor(n)) for n in p.state.plan.buffers}
        owned |= {storage_key(t) for t in p.state.arenas().values()}
    return owned


def _passes(p: Passes, arguments: dict[str, Any], first: reach.Reach,
            stats: dict[int, dict[str, int]]) -> tuple[dict[int, Captured], tuple[Region, ...]]:
    fx, be, sites = p.fixed, p.fixed.backend, first.sites
    watched = first.watched()
    # the tracked run is eager by design (compiled.py): a compiled forward gets one compiling run more
    runs = max(p.warmup_iters, 2) if sites or compiled.is_compiled(p.fn) else p.warmup_iters
    order = sorted(p.buckets.sizes, reverse=True)
    graphs: dict[int, Captured] = {}
    with Snapshot.of(p.state, BoundState.restorable_names) as given, gc_held(), _progress(p.progress) as bar:
        task = bar.add_task("warmup", total=2 * len(order)) if bar else None
        be.synchronize()
        before = be.live_blocks()
        for b in order:  # pass 1: every workspace reaches its high-water mark before any capture
            given.restore()
            p.load(arguments, fx.n, b)
            call = p.call_args(arguments, b)
            dynamo = compiled.Counters.now()
            untracked = None  # a compiled forward's compiled runs: no tracker can watch them (compiled.py)
            for it in range(runs):
                try:
                    with fx.guard:
                        if it == 0 or not (sites or compiled.is_compiled(p.fn)):
                            # the first run finds side effects and reads (tracked in full); every later
                            # eager run too, only its writes (lean): a write may start on any run
                            given.adopt(_tracked_warmup(p, call, watched, lean=it > 0))
                        else:
                            if untracked is None:
                                untracked = p.ledger.digest(watched)
                            be.warmup(lambda: p.fn(*call[0], **call[1]))
                except BaseException as exc:
                    exc.add_note(f"graphctl: raised while warming up bucket {b}; the caller's state was restored")
                    raise
                if p.ledger.tensors:  # the next run starts from the caller's state too
                    given.restore(added_only=True)
            if untracked is not None and (late := p.ledger.untracked(untracked)):
                log.warning("graphctl: %s: bucket %d: compiled warmups wrote state the tracked (eager) run did not: "
                            "it cannot be restored: %s", getattr(p.fn, "__qualname__", p.fn), b,
                            "; ".join(e.path for e in late))
            done = compiled.Counters.now().since(dynamo)
            stats[b] = {"warmup_frames": done.frames, "warmup_graphs": done.graphs, "breaks": done.breaks,
                        "uncompiled": 0}
            if bar:
                bar.update(task, advance=1, description=f"warmup bucket {b}")
        be.synchronize()
        skipped = compiled.never_compiled(p.fn, sites)  # dynamo holds no code for them: they run uncompiled
        if skipped:
            log.warning("graphctl: %s: compiled callables with no compiled code after the warmups (dynamo skips them, "
                        "e.g. after running under a dispatch mode elsewhere): %s", getattr(p.fn, "__qualname__", p.fn),
                        ", ".join(skipped))
        for st in stats.values():
            st["uncompiled"] = len(skipped)
        # what warmup allocated and kept is library state (cuBLAS workspaces): the audit's "workspace"
        workspaces = tuple(Region(f"warmup allocation of {n} B", "workspace", a, a + n)
                           for a, n in sorted(be.live_blocks() - before))
        pool = be.new_pool()
        t_start = time.perf_counter()
        for b in order:  # pass 2: largest first, so smaller graphs reuse its pool blocks
            given.restore()
            p.load(arguments, fx.n, b)
            dynamo = compiled.Counters.now()
            graphs[b] = _capture_one(p, b, p.call_args(arguments, b), pool, sites)
            stats[b]["uncompiled"] += compiled.Counters.now().since(dynamo).frames
            if bar:
                pool_mib = sum(c.graph.pool_bytes for c in graphs.values()) / 2**20
                bar.update(task, advance=1, description=f"captured bucket {b} "
                           f"({time.perf_counter() - t_start:.1f}s, pool {pool_mib:.1f} MiB)")
        settle_slicing(list(graphs.values()))
    return graphs, workspaces


def _tracked_warmup(p: Passes, call: tuple[tuple, dict], watched: dict, lean: bool) -> list:
    """An eager run under the write tracker: what it writes to tensors that existed before it
    and graphctl does not own is a side effect. Returns the new ``(live, copy)`` pairs."""
    owned = _owned(p)
    be = p.fixed.backend
    # integer inputs whose padded rows hold valid indices (anything but a negative sentinel)
    padded = {storage_key(s.static): s.spec.name for s in p.fixed.slots
              if not s.static.dtype.is_floating_point and s.static.dtype != torch.bool
              and not (s.spec.pad.kind == "fill" and s.spec.pad.value is not None and s.spec.pad.value < 0)}
    known = len(p.ledger.hazards)

    def run() -> Any:
        stance = None
        try:
            stance = compiled.eager()  # dynamo never meets the tracker's dispatch mode (compiled.py)
            with stance:
                return be.warmup(lambda: p.fn(*call[0], **call[1]))
        finally:  # again: an interrupt at the with-statement's exit skips its __exit__ (harmless twice)
            if stance is not None:
                stance.__exit__(None, None, None)

    pairs = p.ledger.track(run, watched, owned, be.synchronize, None if lean else padded, lean)
    for h in list(p.ledger.hazards.values())[known:]:
        log.warning("graphctl: %s: %s", getattr(p.fn, "__qualname__", p.fn), h)
    if pairs:
        log.info("graphctl: %s writes state it does not own (restored around every warmup, capture, measure "
                 "and verify run, %d B of snapshots): %s", getattr(p.fn, "__qualname__", p.fn),
                 p.ledger.nbytes, "; ".join(map(str, p.ledger.effects)))
    return pairs


def _capture_one(p: Passes, bucket: int, call: tuple[tuple, dict], pool: Any, sites: list[reach.SiteLeaf]) -> Captured:
    marks: list[tuple[str, int]] = []
    be = p.fixed.backend
    fn = be.opaque(p.fn) if compiled.is_compiled(p.fn) else p.fn

    def body(mark: Callable[[], int]) -> Any:
        def observe(role: str, phase: str, event: str) -> None:
            if phase == "capture":
                marks.append((event, mark()))
        if p.state is None:
            return fn(*call[0], **call[1])
        with p.state.observe(observe):
            return fn(*call[0], **call[1])

    t0 = time.perf_counter()
    with p.fixed.guard:
        graph, out = be.capture(body, pool, bucket, sites)
    ms = (time.perf_counter() - t0) * 1e3
    return Captured(graph, out, bucket, p.manifest(), segments_from_marks(marks, graph.node_count), ms,
                    frozenset({1} | {si.per_item for si in p.fixed.inputs}))


def written(state: BoundState | None, fixed: Fixed, ledger: Ledger, n: int) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, who writes it, tensor)`` of what a run may write that the caller owns: the mutable
    declared buffers (their live rows for ``n`` items: padding is graphctl's, not the forward's;
    buffers derived from them are functions of them, and of the padding) and the restored side
    effects (whole: a padded lane writing live memory shows there)."""
    out: list[tuple[str, str, torch.Tensor]] = []
    if state is not None:
        for name in (n for n in state.plan.buffers if n in state.plan.mutable):
            d, t = state.plan.buffers[name], state.tensor(name)
            if d.axis is not None and d.axis in fixed.pad_axes:
                t = t.narrow(d.axis_dim, 0, min(t.shape[d.axis_dim], n * fixed.pad_axes[d.axis]))
            out.append((f"state.{name}", "a declared mutable buffer", t))
    if ledger.policy == "restore":
        out += [(e.path, f"{e.op} at {e.where}", t) for e, t in ledger.written()]
    return out


def _progress(show: bool | None) -> Any:
    if show is None:
        show = sys.stderr.isatty()
    if not show:
        return contextlib.nullcontext(None)
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), transient=True)


def tiled(inputs: Sequence[StaticInput], arguments: dict[str, Any], n: int, b: int) -> dict[str, torch.Tensor]:
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

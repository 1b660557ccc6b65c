"""One bucket's capture, as the runner keeps it: the graph, its static outputs (sliced to the
live batch on the way out), the address manifest it was captured against, its segments
(target, draft, post) and the recorded switches' entry and exit sections, its counters; and the
capture-time helpers that build it.

A replay is the graph's, with this record as its hooks (``graphs/backends/hooks.py``): the
runner's refresh switch is closed around an eager region that uses the state, and a replay that
stops inside a switch the graph recorded gets that switch restored from its recorded snapshot, or
the state poisoned where the snapshot itself stopped partway; anywhere else the exception (the
user's own, from a region) propagates as itself and the state is untouched.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from graphctl.graphs.analysis.report import Segment
from graphctl.graphs.findings.frames import user_frame
from graphctl.graphs.replay.stale import Handouts, watch

__all__ = ["BucketGraph", "Span", "gc_held", "segments_from_marks", "spans_from_marks", "settle_slicing"]


class Span(NamedTuple):
    """One switch recorded in a graph, as op (or node) counts: its entry section ``[enter,
    applied)`` (snapshot first, then recomputes), its body, its restore section ``[restore, exit)``."""

    role: str
    enter: int
    applied: int
    restore: int
    exit: int


class _Window:
    """The runner's refresh switch around a replay, closed around an eager region that used the
    state at capture (there, at capture, no switch was open) and opened again after it."""

    __slots__ = ("make", "open")

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.open = make, None

    def __enter__(self) -> _Window:
        sw = self.make()
        sw.__enter__()
        self.open = sw
        return self

    def __exit__(self, *exc: Any) -> None:
        sw, self.open = self.open, None
        if sw is not None:
            sw.__exit__(*exc)

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        self.__exit__(None, None, None)
        yield  # a region that raised leaves it closed: the replay is over
        self.__enter__()


class BucketGraph:
    """One bucket's graph and everything its replay relies on."""

    __slots__ = ("graph", "out_flat", "out_spec", "out_rows", "single", "manifest", "segments", "draft",
                 "checked", "capture_ms", "replays", "eager_runs", "replay_us", "eager_us", "_sliced", "bucket",
                 "last_where", "_hand", "spans", "_state", "_window", "_device")

    def __init__(self, graph: Any, out: Any, bucket: int, manifest: dict[str, int], segments: tuple[Segment, ...],
                 capture_ms: float, per_items: frozenset[int], spans: tuple[Span, ...] = (),
                 device: str | None = None) -> None:
        self.graph = graph
        self.spans = spans
        self._device = device  # the device type whose switch work the graph recorded (None: all of it)
        self._state: Any = None  # the bound state and refresh window of the replay running now
        self._window: _Window | None = None
        self.bucket = bucket
        self.last_where = "?"  # the user's line of the last replay (recorded under GRAPHCTL_CHECK_OUTPUTS)
        self.out_flat, self.out_spec = tree_flatten(out)
        self.single = isinstance(out, torch.Tensor)
        # Rows per batch item of each output's first dim, or None: that output is not sliced. An
        # output is batched when its first dim is bucket * r, r = 1 or the per_item of a static input (and,
        # across buckets, with the same per_item: see settle_slicing); never because
        # the first dim merely divides by the bucket (a [256] per-vocab output at bucket 4).
        self.out_rows = tuple(t.shape[0] // bucket if isinstance(t, torch.Tensor) and t.dim() and
                              t.shape[0] % bucket == 0 and t.shape[0] // bucket in per_items else None
                              for t in self.out_flat)
        self.manifest = manifest
        self.segments = segments
        self.draft = any(s.name.startswith("draft") for s in segments)
        self.checked = False
        self.capture_ms = capture_ms
        self.replays = 0
        self.eager_runs = 0  # calls of this bucket's size that fell back to eager
        self.replay_us: float | None = None
        self.eager_us: float | None = None
        self._sliced: dict[int, Any] = {}
        self._hand: Handouts | None = None  # built at the first default-path call (graphs/replay/stale.py)

    def replay(self, state: Any, refresh: Callable[[], Any] | None = None) -> None:
        """Replay the graph (see the module docstring); ``refresh()`` makes the runner's refresh
        switch, open around the replay (None: no switch around it)."""
        self._state = state
        if self._hand is not None:
            self._hand.overwriting()  # what the last call handed out and is still held reads this replay's values
        try:
            if refresh is None:
                self.graph.replay(self)
            else:
                with _Window(refresh) as self._window:
                    self.graph.replay(self)
        finally:
            self._state = self._window = None

    def region(self, region: Any) -> contextlib.AbstractContextManager[None]:
        """The hook around an eager region's call (``graphs/backends/hooks.py``)."""
        if region.uses_state and self._window is not None:
            return self._window.closed()
        return contextlib.nullcontext()

    def failed(self, at: int, inside: bool | None, exc: BaseException, what: str) -> None:
        """The hook of a replay stopped at ``at`` (see ``graphs/backends/hooks.py``)."""
        st = self._state
        if st is None:
            return
        span = next((s for s in self.spans if s.enter <= at < s.exit), None)
        if inside is None and span is None or inside is False:
            return  # no recorded switch open there: the state is as the forward left it, the exception itself
        partial = inside is None and span is not None and span.enter <= at < span.applied and \
            what == "graphctl::swap_through_"
        switch = f"the '{span.role}' switch" if span is not None else "the switch"
        st.recover_recorded(f"{switch} recorded in bucket {self.bucket}'s graph, its replay stopped at {what} "
                            f"(recorded {'op' if inside is None else 'node'} {at}) by {type(exc).__name__}",
                            exc, partial, self._device)

    def result(self, n: int, copy: bool, check: bool) -> Any:
        """What a call returns: the outputs sliced to ``n`` (views of the static outputs), fresh
        copies (``copy_outputs=True``), or views that raise when read after this bucket replayed
        again (``GRAPHCTL_CHECK_OUTPUTS``, see ``graphs/replay/stale.py``)."""
        if copy:
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.outputs(n))
        if check:
            self.last_where = user_frame()
            return watch(self.outputs(n), self, self.last_where)
        if self._hand is None:
            self._hand = Handouts(self)
        return self._hand.give(n)

    def outputs(self, n: int) -> Any:
        """The static outputs sliced to ``n`` items (views, built once per ``n``)."""
        out = self._sliced.get(n)
        if out is None:
            if self.single:
                r = self.out_rows[0]
                out = self.out_flat[0] if r is None else self.out_flat[0][: n * r]
            else:
                leaves = [t if r is None else t[: n * r] for t, r in zip(self.out_flat, self.out_rows)]
                out = tree_unflatten(leaves, self.out_spec)
            self._sliced[n] = out
        return out


def settle_slicing(caps: Sequence[BucketGraph]) -> None:
    """An output is sliced only where every bucket agrees it is batched, at one per_item: a
    first dim that equals bucket * per_item in one bucket only is a coincidence."""
    caps = list(caps)
    for i in range(len(caps[0].out_rows)):
        rows = {c.out_rows[i] if i < len(c.out_rows) else None for c in caps}
        if len(rows) > 1 or (len(caps) > 1 and None in rows):
            for c in caps:
                if i < len(c.out_rows):
                    c.out_rows = c.out_rows[:i] + (None,) + c.out_rows[i + 1:]


def segments_from_marks(marks: list[tuple[str, int]], total: int) -> tuple[Segment, ...]:
    """Turn switch enter/exit marks into named segments: target, draft (or draft[i]), post."""
    marks = [(e, at) for e, at in marks if e in ("enter", "exit")]
    segs: list[Segment] = []
    cursor, drafts = 0, sum(1 for e, _ in marks if e == "enter")
    i = 0
    for event, at in marks:
        if event == "enter":
            if at > cursor or not segs:
                segs.append(Segment("target" if i == 0 else "post", cursor, at))
            cursor = at
        else:
            segs.append(Segment("draft" if drafts == 1 else f"draft[{i}]", cursor, at))
            cursor, i = at, i + 1
    if total > cursor or not segs:
        segs.append(Segment("target" if not marks else "post", cursor, max(total, cursor)))
    return tuple(segs)


def spans_from_marks(marks: list[tuple[str, int]]) -> tuple[Span, ...]:
    """The recorded switches (enter, applied, restore, exit marks in order), named as their segments."""
    spans: list[Span] = []
    cur: dict[str, int] = {}
    n = sum(1 for e, _ in marks if e == "enter")
    for event, at in marks:
        cur[event] = at
        if event == "exit" and {"enter", "applied", "restore"} <= cur.keys():
            role = "draft" if n == 1 else f"draft[{len(spans)}]"
            spans.append(Span(role, cur["enter"], cur["applied"], cur["restore"], at))
            cur = {}
    return tuple(spans)


@contextlib.contextmanager
def gc_held() -> Iterator[None]:
    # A collection during capture can run __del__ of tensors (frees inside the capture's pool)
    # and costs seconds across many buckets; collect once, then hold it off. The young generations
    # only: what the example call and the model's last steps left (a full collection of a process
    # that imported transformers is 0.1-0.2 s, a tenth of a whole capture_all). Nested (a variant
    # runner holds one around its runners' captures) the outer one has disabled collection: the
    # inner one neither collects nor re-enables (no counter a Ctrl-C could leave wrong).
    was = gc.isenabled()
    if was:
        gc.collect(1)
    try:  # disable inside the try: a Ctrl-C right after it must still re-enable collection
        gc.disable()
        yield
    finally:
        if was:
            gc.enable()

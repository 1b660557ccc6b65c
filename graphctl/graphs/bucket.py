"""One bucket's capture, as the runner keeps it: the graph, its static outputs (sliced to the
live batch on the way out), the address manifest it was captured against, its segments
(target, draft, post) and its counters; and the capture-time helpers that build it.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from graphctl.graphs.analysis.report import Segment
from graphctl.graphs.frames import user_frame
from graphctl.graphs.stale import Held, refs, watch

__all__ = ["BucketGraph", "gc_held", "segments_from_marks", "settle_slicing"]


class BucketGraph:
    """One bucket's graph and everything its replay relies on."""

    __slots__ = ("graph", "out_flat", "out_spec", "out_rows", "single", "manifest", "segments", "draft",
                 "checked", "capture_ms", "replays", "eager_runs", "replay_us", "eager_us", "_sliced", "bucket",
                 "last_where", "_held", "_sets", "_calls")

    def __init__(self, graph, out, bucket: int, manifest: dict[str, int], segments: tuple[Segment, ...],
                 capture_ms: float, per_items: frozenset[int]) -> None:
        self.graph = graph
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
        self._held: Held | None = None  # built at the first default-path call (graphs/stale.py)
        self._sets: dict[tuple[int, int], tuple] = {}  # (n, parity) -> (objects returned, their refcounts)
        self._calls = 0

    def replay(self, state: Any) -> None:
        """Replay the graph. A replay the emulated backend stopped at an op inside or after a
        recorded switch (an op raising: out of memory, a device error, a profiler hook) may have
        left draft contents in place with the switch's restore never run: the state is poisoned,
        as after a failed restore, and the op's exception is the cause. A CUDA launch runs
        whole or not at all (``failed_at`` stays None)."""
        try:
            self.graph.replay()
        except Exception as exc:
            at = self.graph.failed_at
            first = min((s.start for s in self.segments if s.name.startswith("draft")), default=None)
            if state is None or at is None or first is None or at < first:
                raise  # nothing of a switch ran yet: the state is as it was
            raise state._poison([(f"bucket {self.bucket}'s replay, stopped at recorded op {at} after its draft "
                                  f"switch began", exc)]) from exc

    def result(self, n: int, copy: bool, check: bool) -> Any:
        """What a call returns: the outputs sliced to ``n`` (views of the static outputs), fresh
        copies (``copy_outputs=True``), or views that raise when read after this bucket replayed
        again (``GRAPHCTL_CHECK_OUTPUTS``, see ``graphs/stale.py``)."""
        if copy:
            return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.outputs(n))
        if check:
            self.last_where = user_frame()
            return watch(self.outputs(n), self, self.last_where)
        # two sets of views alternate, so what the call before the last returned is told apart
        # from what the last returned: a caller still holding it gets one warning (stale.Held)
        self._calls += 1
        key = (n, self._calls & 1)
        rec = self._sets.get(key)
        if rec is None:
            if self._held is None:
                self._held = Held(self.out_flat, self.manifest)
            before = self._held.uses()
            out = self.outputs(n) if key[1] else tree_map(
                lambda t: t.view(t.shape) if isinstance(t, torch.Tensor) else t, self.outputs(n))
            objs = (out, *(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))) \
                if not isinstance(out, torch.Tensor) else (out,)
            del out  # counted below as graphctl alone holds them
            self._held.built(before)
            rec = self._sets[key] = objs, refs(objs)
        assert self._held is not None  # made with the first set above
        self._held.given(rec, self.bucket)
        return rec[0][0]

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

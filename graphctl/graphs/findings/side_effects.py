"""Side effects of a forward on state graphctl was never told about, found and undone.

Model code graphctl did not write keeps state of its own: a Hugging Face ``StaticCache`` layer
advances a device-side ``cumulative_length`` and writes K/V with ``index_copy_`` at it. Every
warmup and capture run of such a forward moves the caller's cache, so the first replay starts
late, on garbage. No spec declares those tensors, and users should not have to.

:class:`Writes` watches the writes of each tracked warmup: every in-place or ``out=`` write into
the storage of a tensor the forward reaches (``findings/reach.py``: its path) or of one that existed
before the run (found by the reads watcher, ``findings/reads.py``) is a :class:`SideEffect`,
recorded with the op and the user's file:line, and the storage is copied *before* the first write
(copy on first write), so the warmup itself can be undone. Writes into declared ``Persistent``
buffers are journaled by the rows they touch instead (``findings/journal.py``). The ledger
(``findings/ledger.py``) applies the policy: ``"restore"`` keeps the copies (one per storage) and
the runner puts them back after every warmup, capture, measure and verify run; ``"error"`` refuses
them; ``"ignore"`` leaves them. Whole storages, not the rows an ``index_copy_`` touched: a replay
writes where device data says, which the host cannot see.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from graphctl.graphs.findings.frames import user_frame
from graphctl.graphs.findings.journal import Journal, storage_bytes
from graphctl.graphs.findings.reach import storage_key
from graphctl.graphs.findings.record import Finding
from graphctl.graphs.findings.stream import Op, Track, Watcher

__all__ = ["SideEffect", "Writes", "no_path"]


@dataclasses.dataclass(frozen=True)
class SideEffect(Finding):
    """One tensor the forward wrote that graphctl does not own."""

    kind: ClassVar[str] = "side_effects"
    path: str  # where graphctl reached it, e.g. "args[1].layers[0].cumulative_length"
    op: str  # the first op that wrote it, e.g. "aten::index_copy_"
    where: str  # the user's file:line of that op
    nbytes: int
    policy: str = ""  # the runner's side_effects= (set in reports)

    def __str__(self) -> str:
        return f"{self.path} ({self.nbytes:,} B): {self.op} at {self.where}"

    def line(self) -> str:
        return f"side effect ({self.policy}): {self.path} ({self.nbytes:,} B) written by {self.op} at {self.where}"


def no_path(t: torch.Tensor) -> str:
    """How a side effect on a tensor no walked path leads to is named."""
    return f"(no path) a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)} on {t.device}"


class Writes(Watcher):
    """The side effects of one tracked run (the track's ``found``), the copies that undo them, and
    the journal of its writes into Persistent buffers. In a lean run only writes into ``watched``
    (the walked tensors and what earlier runs found existing before them) are looked at."""

    stage = 2
    lean = True

    def __init__(self, track: Track) -> None:
        super().__init__(track)
        self.journal = Journal(track.journaled) if track.journaled else None
        self.watched = {k: v for k, v in track.watched.items() if k not in track.exclude}
        self.saved: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (live, copy before)
        self.hit: dict[tuple[str, int], torch.Tensor] = {}  # key -> the tensor written (what verify compares)

    def write(self, func: Any, args: tuple, kwargs: dict, t: torch.Tensor) -> None:
        key = storage_key(t)
        if self.journal is not None and key in self.journal.storages:
            self.journal.record(func, args, kwargs, t, key)
        elif key in self.watched and key not in self.track.found:
            self._save(key, self.watched[key][0], self.watched[key][1], func)

    def before(self, op: Op) -> None:
        tr = self.track
        for t in op.writes:
            key = storage_key(t)
            if self.journal is not None and key in self.journal.storages:
                self.journal.record(op.func, op.args, op.kwargs, t, key)
                continue
            hit = self.watched.get(key)
            if hit is None and (key not in tr.external or key in tr.exclude):
                continue  # a temporary of this run, or graphctl's own
            if key not in tr.found:
                self._save(key, hit[0] if hit is not None else no_path(t), hit[1] if hit is not None else t, op.func)

    def _save(self, key: tuple[str, int], path: str, live: torch.Tensor, func: Any) -> None:
        whole = storage_bytes(live)  # the whole storage: views of it are restored too
        with torch.no_grad():
            self.saved[key] = (whole, whole.clone())
        self.hit[key] = live
        self.track.found[key] = SideEffect(path, func._schema.name, user_frame(), whole.numel())

    def undo(self) -> None:
        with torch.no_grad():
            for live, before in self.saved.values():
                live.copy_(before)
        if self.journal is not None:
            self.journal.undo()

    def finish(self, ledger: Any) -> None:
        ledger.admit(dict(self.track.found), list(self.saved.values()), dict(self.hit))
        self.saved, self.hit = {}, {}  # GC is off during capture_all: hold nothing past the run


SideEffect.watcher = Writes

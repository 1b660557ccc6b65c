"""Reads: which storages a tracked run used, and the tensors it read that existed before it ran.

:class:`Reads` watches every op of a tracked warmup: each storage an op reads or writes is
``used`` (the path check keeps the walked ones), each one read before any op of the run made it
existed before the run (``external``, the tensors behind them ``before``): the write tracker
watches its writes like a walked tensor's, and one that no checked path reaches is
:class:`Unreached`, a finding (the replay reads its capture-time storage and nothing checks it is
still the one the caller means).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, ClassVar

from graphctl.graphs.findings.frames import user_frame
from graphctl.graphs.findings.reach import storage_key
from graphctl.graphs.findings.record import Finding
from graphctl.graphs.findings.stream import Op, Watcher

__all__ = ["Reads", "Unreached"]

_FRESH = {"aten::lift_fresh", "aten::lift_fresh_copy"}  # torch.tensor(data) inside the forward: made there

@dataclasses.dataclass(frozen=True, slots=True)
class Unreached(Finding):
    """A tensor the forward read that existed before it ran, yet no path graphctl walks leads
    to it (a ``__slots__`` object, a C++ holder, a function's return value)."""

    kind: ClassVar[str] = "unreached"
    shape: tuple[int, ...]
    dtype: str
    device: str
    op: str  # the first op that read it
    where: str  # user file:line of that op

    def __str__(self) -> str:
        return (f"a {self.dtype} tensor of shape {list(self.shape)} on {self.device}, read by {self.op} at "
                f"{self.where}: reached by no path graphctl checks (declare it, pass it as an argument, or keep it "
                f"on an object the forward reaches)")

    def line(self) -> str:
        return (f"reached by no path: a {self.dtype} tensor {list(self.shape)} on {self.device} read by {self.op} at "
                f"{self.where}: declare it or keep it where the forward's arguments reach")

class Reads(Watcher):
    """The track's ``used``, ``born``, ``external`` and ``before`` (``findings/stream.py``)."""

    stage = 1

    def before(self, op: Op) -> None:
        seen = self.track
        for t in op.tensors:
            if t.device.type == "meta":
                continue
            key = storage_key(t)
            seen.used.add(key)
            # a 0-dim CPU tensor is a wrapped Python number (or a scalar the graph bakes by value); graphctl's
            # own switch ops read what the state resolved itself (declared buffers, copy sources, arenas)
            if key not in seen.born and key not in seen.external and op.name not in _FRESH and not op.own and \
                    not (t.dim() == 0 and t.device.type == "cpu") and t.untyped_storage().nbytes():
                seen.external[key] = Unreached(tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device),
                                               op.name, user_frame())
                seen.before[key] = t

    def after(self, op: Op) -> None:
        seen = self.track
        for t in op.made:
            key = storage_key(t)
            seen.born.add(key)
            seen.external.pop(key, None)  # an address freed and handed out again: a new storage
            seen.before.pop(key, None)

    def finish(self, ledger: Any) -> None:
        ledger.used |= self.track.used
        for k, u in self.track.external.items():
            ledger.external.setdefault(k, u)
        for k, t in self.track.before.items():
            ledger.before.setdefault(k, weakref.ref(t))


Unreached.watcher = Reads

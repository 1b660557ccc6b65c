"""Tensors an eager region makes and keeps to itself, read by a later piece (``capture/pieces.py``).

A region publishes ``box.cache = h * 2`` and the next piece reads ``box.cache``: at every replay
the region runs again and publishes a new tensor while the piece reads the capture's. The
tracked warmup runs regions as plain calls; :class:`Boundaries`, told of each region's entry and
exit (``pieces.listening``) and of every op (a watcher of the op stream), knows the storages each
region made, which of them it returned, and every later use of one it kept to itself by an op
outside any region, or as a later region's argument (baked at capture): a :class:`Published`,
which the capture refuses (``CaptureError``: return the tensor from the region instead).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_flatten

from graphctl.graphs.capture import pieces
from graphctl.graphs.findings.frames import user_frame
from graphctl.graphs.findings.record import Finding
from graphctl.graphs.findings.stream import Op, Track, Watcher

__all__ = ["Boundaries", "Published"]


@dataclasses.dataclass(frozen=True)
class Published(Finding):
    """A tensor an eager region made and did not return, read by a later piece: a replay reads
    the capture's tensor while the region publishes a new one (refused at capture)."""

    kind: ClassVar[str] = "published"
    region: str
    op: str  # the first op of a piece that used it
    where: str  # that op's user file:line
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return (f"a {self.dtype} tensor of shape {list(self.shape)} made inside eager region {self.region} and not "
                f"returned, used by {self.op} at {self.where}")

    def line(self) -> str:
        return f"published by an eager region: {self}"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Boundaries(Watcher):
    """The region boundaries of one tracked warmup (see the module docstring)."""

    stage = 4

    def __init__(self, track: Track) -> None:
        super().__init__(track)
        self.depth = 0
        self.stack: list[str] = []
        self.born: dict[int, str] = {}  # storage -> the region that made it (not returned)
        self.found: dict[int, Published] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with pieces.listening(self):  # the eager wrapper's plain calls tell us their entry and exit
            yield

    def enter(self, name: str, args: tuple, kwargs: dict) -> None:
        if not self.depth:  # a region's arguments are baked at capture: one the region before made is stale
            self._seen(f"an argument of eager region {name}", [t for t in tree_flatten((args, kwargs))[0]
                                                               if isinstance(t, torch.Tensor)], [], lambda: "-")
        self.stack.append(name)
        self.depth += 1

    def leave(self, out: Any) -> None:
        self.depth -= 1
        self.stack.pop()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.born.pop(_storage(t), None)  # returned: it crosses the boundary as a result

    def after(self, op: Op) -> None:
        if self.depth or self.born:
            self._seen(op.name, op.tensors, op.made, user_frame)

    def _seen(self, name: str, used: list[torch.Tensor], made: list[torch.Tensor], where: Callable[[], str]) -> None:
        if self.depth:
            for t in made:
                self.born[_storage(t)] = self.stack[0]
            return
        for t in used:
            st = _storage(t)
            if st in self.born and st not in self.found:
                self.found[st] = Published(self.born[st], name, where(), tuple(t.shape),
                                           str(t.dtype).removeprefix("torch."))
        for t in made:  # a piece's op made it: an address handed out again is a new storage
            self.born.pop(_storage(t), None)

    def finish(self, ledger: Any) -> None:
        ledger.published += self.found.values()
        self.born, self.found = {}, {}


Published.watcher = Boundaries

"""What a graph's replay tells the runner while it runs (``graphs/capture/bucket.py`` implements it).

Both backends call the same two hooks. ``region(r)`` is entered around every eager region's call
(the runner closes its refresh switch around a region that uses the state). ``failed(at, inside,
exc, what)`` is called when a replay stops early, before the exception leaves the replay and,
on the emulated backend, while interrupts are still held: ``at`` is the recorded op (emulated) or
the node offset (CUDA pieces) where it stopped, ``inside`` whether a switch recorded in the graph
was open there when the backend knows it without the segment marks (a CUDA piece or region), else
None; ``what`` names the op. It restores such a switch or poisons the state; it may raise
``CorruptedStateError`` in place of ``exc``."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = ["ReplayHooks"]


class ReplayHooks(Protocol):
    def region(self, region: Any) -> AbstractContextManager[None]: ...
    def failed(self, at: int, inside: bool | None, exc: BaseException, what: str) -> None: ...

"""While the emulated recorder runs, this thread looks like a CUDA stream capture to libraries
that ask (``torch.cuda.is_current_stream_capturing()``), as under a real capture."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from graphctl.state.interrupts import deferred

__all__ = ["LooksLikeCapture"]


class LooksLikeCapture:
    """While the recorder runs, the stream-capture queries libraries ask before skipping host-side
    checks (transformers' ``is_tracing()`` calls ``torch.cuda.is_current_stream_capturing()``)
    answer as under a CUDA capture: True, in the recording thread only. Installed on entry of the
    first recording, the originals put back when the last one ends."""

    _lock = threading.Lock()
    _threads: dict[int, int] = {}  # thread id -> recording depth
    _saved: list[tuple[Any, str, Any]] = []
    _held = False  # this instance entered and has not left

    def __enter__(self) -> LooksLikeCapture:
        # held interrupts: a Ctrl-C at the exit of ``with self._lock`` would leave the lock taken
        # (every later recording deadlocks) and this thread answering "capturing" for good
        with deferred():
            me = threading.get_ident()
            with self._lock:
                if not self._threads:
                    original = torch.cuda.is_current_stream_capturing

                    def is_current_stream_capturing() -> bool:
                        return threading.get_ident() in LooksLikeCapture._threads or original()

                    owner: Any  # torch.cuda re-exports it from torch.cuda.graphs (stubs name neither)
                    for owner in (torch.cuda, torch.cuda.graphs):
                        self._saved.append((owner, "is_current_stream_capturing", owner.is_current_stream_capturing))
                        owner.is_current_stream_capturing = is_current_stream_capturing
                self._threads[me] = self._threads.get(me, 0) + 1
                self._held = True
        return self

    def __exit__(self, *exc: object) -> None:
        with deferred():
            if not self._held:  # already left (see ``leave``)
                return
            me = threading.get_ident()
            with self._lock:
                self._held = False
                depth = self._threads.pop(me, 1) - 1  # absent: a Ctrl-C skipped the end of paused()
                if depth:
                    self._threads[me] = depth
                if not self._threads:
                    while self._saved:
                        owner, name, fn = self._saved.pop()
                        setattr(owner, name, fn)

    def leave(self) -> None:
        """``__exit__`` if it has not run: an interrupt at the with-statement's exit skips it."""
        self.__exit__(None, None, None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """This thread answers as outside a capture (an eager region between two pieces)."""
        me = threading.get_ident()
        with deferred(), self._lock:
            depth = self._threads.pop(me, 0)
        try:
            yield
        finally:
            with deferred(), self._lock:
                if depth:
                    self._threads[me] = depth

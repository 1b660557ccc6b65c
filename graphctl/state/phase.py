"""Where a switch runs: eagerly, under a capture (CUDA stream capture or the emulated
recorder), or around a replay; and whether a CUDA capture is still alive.

The graphs layer announces its emulated recorder through :func:`recording`; the state layer
never imports the graphs layer, it only reads this flag."""
from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from graphctl import bindings
from graphctl.errors import CaptureError

__all__ = ["recording", "paused", "is_recording", "capturing", "resolve_phase", "capture_invalidated", "given",
           "check_given"]

# The frame that entered ``recording()``, or None. The flag is true only while that frame is on
# the stack: a Ctrl-C that lands in the cleanup of ``recording()`` (before its reset ran) can then
# never leave a stale "capture in progress" behind for every later switch to trip over.
_RECORDING: contextvars.ContextVar[Any] = contextvars.ContextVar("graphctl_recording", default=None)
# (the frame that entered given(), the bound states the graphctl capture running there was given), or None;
# like _RECORDING, true only while that frame is on the stack (an interrupt in its cleanup leaves nothing behind)
_GIVEN: contextvars.ContextVar[tuple[Any, tuple[Any, ...]] | None] = contextvars.ContextVar("graphctl_given",
                                                                                           default=None)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Mark a region as a capture that is not a CUDA stream capture (the emulated recorder),
    for as long as the frame running the with-statement is on the stack."""
    token = _RECORDING.set(sys._getframe(2))  # 0: this generator, 1: contextlib's __enter__, 2: the caller
    try:
        yield
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No recording inside (an eager region between two recorded pieces: its switches run eagerly)."""
    token = _RECORDING.set(None)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def _on_stack(owner: FrameType) -> bool:
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        if f is owner:
            return True
        f = f.f_back
    return False


def is_recording() -> bool:
    """True inside :func:`recording` (the emulated recorder is running)."""
    owner = _RECORDING.get()
    if owner is None:
        return False
    if _on_stack(owner):
        return True
    _RECORDING.set(None)  # its with-block was left without the reset (an interrupt in the cleanup)
    return False


def capturing(device: torch.device) -> bool:
    """True under the emulated recorder, or when ``device`` is CUDA and the current stream is
    capturing (an invalidated capture still counts: it must be ended, not forgotten)."""
    if is_recording():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def resolve_phase(phase: str, device: torch.device) -> str:
    """``"auto"`` becomes ``"capture"`` under a capture and ``"eager"`` otherwise, so one forward
    body serves the warmup, the capture and an eager fallback unchanged."""
    if phase != "auto":
        return phase
    return "capture" if capturing(device) else "eager"


def capture_invalidated(device: torch.device) -> bool:
    """True when the current CUDA stream's capture was invalidated (a host sync or an illegal
    call in the body). Nothing recorded into it will ever run, so device work recorded by a
    switch needs no undo; launching that undo would only fail and poison the state."""
    if device.type != "cuda" or is_recording():
        return False
    rt = bindings.runtime()
    if rt is None:  # without cuda-bindings an invalidated capture is not told apart
        return False
    err, status = rt.cudaStreamIsCapturing(torch.cuda.current_stream(device).cuda_stream)
    return int(err) == 0 and int(status) == int(rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated)


@contextlib.contextmanager
def given(*states: Any) -> Iterator[None]:
    """A graphctl capture runs in the block and was given ``states`` (None entries ignored): a
    switch of any other bound state entered there in the ``capture`` phase is refused."""
    token = _GIVEN.set((sys._getframe(2), tuple(s for s in states if s is not None)))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def check_given(state: Any) -> None:
    """Refuse a ``capture``-phase switch of ``state`` inside a graphctl capture that was not given
    it: the runner would neither refresh its draft twins around a replay nor check its buffers'
    addresses, so the graph would replay the capture's contents (on CUDA: draft outputs of zeros)."""
    entry = _GIVEN.get()
    if entry is None or not _on_stack(entry[0]):
        return
    known = entry[1]
    if any(s is state for s in known):
        return
    raise CaptureError("a switch of a bound state the graphed forward was not given, entered during its capture",
                      buffer=type(state.obj).__qualname__,
                      expected="the state passed to graphed(..., state=...)" if known else "no state (state=None)",
                      found=f"state.switch of a {type(state.obj).__qualname__} bound elsewhere",
                      fix="pass that bound state as state= to graphed() (the runner then refreshes and checks it "
                          "around every replay)")

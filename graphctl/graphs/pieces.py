"""Eager regions inside a graphed forward: ``@graphctl.eager``, and the record a capture keeps of each.

A function decorated with :func:`eager` always runs eagerly. Called outside a capture (warmups,
eager fallbacks, verify's eager run, plain use) it is a plain call. Called while a backend
captures, the capture becomes a sequence of pieces: the backend ends the piece recorded so far,
runs the function eagerly on real data (the emulated recorder has executed every op; a CUDA
capture replays the piece just ended first), keeps its results as the region's static outputs,
and records the next piece, which reads them. A replay runs piece, region, piece, ...: each
region calls the function again with the same arguments (the static tensors the previous pieces
wrote, and the capture-time host values) and copies its fresh results into the static outputs.

Constraints (each checked, a violation is a typed error):

- Inside a region anything eager code may do is allowed: host syncs, data-dependent shapes,
  other libraries; a nested ``@eager`` call is a plain call.
- What crosses a boundary has static shape: every tensor a region returns at replay has the
  capture's shape and dtype, and every host value it returns equals the capture's (later pieces
  baked it in); otherwise ``ReplayError`` naming the region and the output. A returned tensor
  that is one of its arguments (written in place) is not copied.
- No ``state.switch`` is open across a region (the capture raises ``CaptureError``): a switch's
  host side (rebound attributes) is not replayed around an eager call, so a region looking up
  the state itself would see the target's objects under a draft switch. Open and close the
  switch inside one piece, or inside the region; or declare ``@eager(in_switch=True)`` for a
  region that reads the state only through its arguments (a replay passes the capture's: under
  the switch, the draft's objects; its device-side buffers hold what the pieces before it
  wrote, the switch's swaps included).
- A region runs under the replay's interrupt deferral (emulated) like every recorded op: a
  Ctrl-C during it is raised once the replay ends.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_flatten

from graphctl.errors import ReplayError

__all__ = ["eager", "is_eager", "calls", "EagerRegion", "regions", "boundary_check", "run_region", "saved", "restore"]

F = TypeVar("F", bound=Callable[..., Any])
_tls = threading.local()  # .region: the running capture's handler; .check: the runner's boundary check


def eager(fn: F | None = None, /, *, in_switch: bool = False) -> Any:
    """Mark ``fn`` as a region that always runs eagerly: a graphed forward calling it is
    captured as pieces around it (see the module docstring). ``in_switch=True`` (as
    ``@eager(in_switch=True)``) lets it sit inside an open ``state.switch``: the region promises
    to read the state only through its arguments, which a replay passes as the capture saw them
    (under the switch: the draft's objects), never through attributes it looks up itself."""
    def wrap(f: F) -> F:
        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            handler = getattr(_tls, "region", None)
            if handler is None:
                _tls.calls = getattr(_tls, "calls", 0) + 1  # a warmup met a region (calls())
                return f(*args, **kwargs)
            check = getattr(_tls, "check", None)
            if check is not None and not in_switch:
                check(_name(f))
            return handler(f, args, kwargs)

        call.__graphctl_eager__ = f  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap if fn is None else wrap(fn)


def calls() -> int:
    """How many plain (uncaptured) region calls this thread has made: a runner compares the count
    across its warmups to learn whether its capture will run regions (and so replay pieces)."""
    return getattr(_tls, "calls", 0)


def is_eager(fn: Any) -> bool:
    """True for a function decorated with :func:`eager`."""
    return callable(getattr(fn, "__graphctl_eager__", None))


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def saved() -> tuple[Any, Any]:
    """This thread's handler and check, for :func:`restore` in a backend's ``finally``: a Ctrl-C
    landing inside the cleanup of :func:`regions` could skip its reset, and every later eager
    call (a warmup's) would then reach a dead capture."""
    return getattr(_tls, "region", None), getattr(_tls, "check", None)


def restore(state: tuple[Any, Any]) -> None:
    _tls.region, _tls.check = state


@contextlib.contextmanager
def _installed(slot: str, value: Any) -> Iterator[None]:
    """``value`` in this thread's ``slot`` for the with-block, the previous one back after it."""
    prev = getattr(_tls, slot, None)
    setattr(_tls, slot, value)
    try:
        yield
    finally:
        setattr(_tls, slot, prev)


def regions(handler: Callable[[Callable[..., Any], tuple, dict], Any]) -> contextlib.AbstractContextManager[None]:
    """While a backend captures in this thread: ``handler(fn, args, kwargs)`` takes every
    ``@eager`` call (ends the piece, runs the region, begins the next piece)."""
    return _installed("region", handler)


def boundary_check(check: Callable[[str], None] | None) -> contextlib.AbstractContextManager[None]:
    """``check(region name)`` before every region of the capture running in this thread (the
    runner refuses a switch open across a boundary)."""
    return _installed("check", check)


def run_region(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, EagerRegion]:
    """Run ``fn`` eagerly (a nested ``@eager`` call inside is a plain one); its result and the
    :class:`EagerRegion` a replay calls."""
    prev = getattr(_tls, "region", None)
    _tls.region = None
    try:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        first_us = (time.perf_counter() - t0) * 1e6
    finally:
        _tls.region = prev
    return out, EagerRegion(fn, args, kwargs, out, first_us)


class EagerRegion:
    """One eager call between two pieces: called again at every replay, its fresh results copied
    into the capture-time outputs (the static storage the next piece reads)."""

    __slots__ = ("fn", "name", "args", "kwargs", "outputs", "fresh", "host", "calls", "seconds", "capture_us")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, out: Any, capture_us: float) -> None:
        self.fn, self.name, self.args, self.kwargs = fn, _name(fn), args, kwargs
        self.capture_us = capture_us
        flat, _ = tree_flatten(out)
        mine = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.outputs = tuple(t for t in flat if isinstance(t, torch.Tensor))  # static: the next piece reads them
        # (index, static tensor) of results a replay copies; an argument written in place is already there
        self.fresh = tuple((i, t) for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and id(t) not in mine)
        self.host = tuple((i, v) for i, v in enumerate(flat) if not isinstance(v, torch.Tensor))
        self.calls, self.seconds = 0, 0.0

    @property
    def mean_us(self) -> float | None:
        """Host wall time of a region call at replay (its own work, the copies included)."""
        return self.seconds / self.calls * 1e6 if self.calls else None

    def run(self, *args: Any, **kwargs: Any) -> None:
        """One replay's call, with ``args``/``kwargs`` (the recorded ones: a re-pointed graph
        passes its own)."""
        t0 = time.perf_counter()
        res = self.fn(*args, **kwargs)
        flat, _ = tree_flatten(res)
        for i, want in self.host:
            got = flat[i] if i < len(flat) else "(missing)"
            if isinstance(got, torch.Tensor) or got != want:
                raise ReplayError("an eager region returned another host value than at capture", buffer=self.name,
                                  expected=f"output {i} = {want!r} (the pieces after it baked it in)",
                                  found=repr(got)[:80], fix="return host values that do not change, or compute "
                                                            "them outside the graphed forward")
        for i, static in self.fresh:
            got = flat[i] if i < len(flat) else None
            if not isinstance(got, torch.Tensor) or got.shape != static.shape or got.dtype != static.dtype:
                found = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)[:80]
                raise ReplayError("an eager region's output does not fit its static storage", buffer=self.name,
                                  expected=f"output {i}: {tuple(static.shape)} {static.dtype}", found=found,
                                  fix="return tensors of the capture's shapes (pad inside the region), or write "
                                      "into an argument in place")
            if got.data_ptr() != static.data_ptr():
                static.copy_(got)
        self.calls += 1
        self.seconds += time.perf_counter() - t0

"""A deterministic Ctrl-C sweep: interrupt an operation at every line graphctl executes in it.

CPython delivers a signal by calling the Python-level handler between two bytecodes of
whatever frame runs; the default ``SIGINT`` handler raises ``KeyboardInterrupt`` right there.
:func:`interrupt_sweep` does exactly that, on purpose and reproducibly: it runs the operation
once to count the lines executed in the watched files, then once per line, calling the
installed ``SIGINT`` handler at that line (so a section that holds interrupts, see
``graphctl.state.interrupts``, holds this one too). After each run it classifies the state:

- ``clean``: the interrupt propagated and every declared buffer is bitwise what it was before
  the operation or what the operation completes to, every attribute is bound as at ``bind``,
  no switch is active, derived buffers equal ``fn(inputs)``, and a new switch enters and exits;
- ``poisoned``: the state refuses every use (``CorruptedStateError``): loud, allowed;
- ``silent``: anything else with the state usable (the bug class this sweep exists to find);
- ``stuck``: a switch is still active or owned, or the next switch is refused;
- ``swallowed``: the operation returned normally, or raised something else: the Ctrl-C was
  lost or turned into another exception.

Run it on your own backend in your tests (``setup`` must build the same object every time)::

    report = interrupt_sweep(lambda: make_state(seed=1), op)
    assert report.silent == report.stuck == report.swallowed == ()
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

import torch

from graphctl.errors import CorruptedStateError, GraphctlError
from graphctl.state import BoundState

__all__ = ["SweepReport", "interrupt_sweep", "call_interrupted"]

_STATE_FILES = (os.path.join("graphctl", "state") + os.sep, os.path.join("graphctl", "ops") + os.sep)


@dataclasses.dataclass(frozen=True)
class SweepReport:
    points: int  # lines executed in the watched files by one uninterrupted run
    clean: tuple[int, ...]
    poisoned: tuple[int, ...]
    silent: tuple[tuple[int, str, str], ...]  # (point, file:line, what is wrong)
    stuck: tuple[tuple[int, str, str], ...]
    swallowed: tuple[tuple[int, str], ...]  # (point, file:line[ -> the exception raised instead])

    def __str__(self) -> str:
        return (f"{self.points} points: {len(self.clean)} clean, {len(self.poisoned)} poisoned, "
                f"{len(self.silent)} silent, {len(self.stuck)} stuck, {len(self.swallowed)} swallowed")


class _Tracer:
    def __init__(self, files: Sequence[str | CodeType], fire_at: int | None) -> None:
        self.files, self.fire_at, self.count, self.where = tuple(files), fire_at, 0, ""

    def _watched(self, code: CodeType) -> bool:
        return any(code is f if isinstance(f, CodeType) else f in code.co_filename for f in self.files)

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and self._watched(frame.f_code):
            return self._line
        return None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            self.count += 1
            if self.count == self.fire_at:
                self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
                handler = signal.getsignal(signal.SIGINT)
                if callable(handler):
                    handler(signal.SIGINT, frame)  # what CPython does when Ctrl-C arrives here
        return self._line


def call_interrupted(op: Callable[[], Any], at: int,
                     files: Sequence[str | CodeType] = _STATE_FILES) -> tuple[Any, str]:
    """Run ``op`` with Ctrl-C delivered at the ``at``-th line executed in ``files`` (path parts, or
    code objects: one function's own lines, e.g. ``Ledger.track.__code__``): returns
    ``(what op returned, or the exception it raised, and where the interrupt was delivered)``;
    ``where`` is empty when ``op`` ran fewer lines."""
    tracer = _Tracer(files, at)
    sys.settrace(tracer)
    try:
        out = op()
    except BaseException as exc:  # noqa: BLE001 - handed back to the caller
        out = exc
    finally:
        sys.settrace(None)
    return out, tracer.where


def _contents(state: BoundState) -> dict[str, torch.Tensor]:
    return {n: state.tensor(n).detach().reshape(-1).view(torch.uint8).cpu().clone() for n in state.restorable_names()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def _run(setup: Callable[[], tuple[BoundState, Callable[[], Any]]], files: Sequence[str], fire_at: int | None):
    state, op = setup()
    before = _contents(state)
    tracer = _Tracer(files, fire_at)
    interrupted: BaseException | None = None
    sys.settrace(tracer)
    try:
        op()
    except BaseException as exc:  # noqa: BLE001 - classified by the caller
        interrupted = exc
    finally:
        sys.settrace(None)
    return state, before, tracer, interrupted


def _diagnose(state: BoundState, before: dict, done: dict) -> tuple[str, str] | None:
    """(kind, what) when the state is not clean; None when it is."""
    if state.active_phase is not None:  # reading active_phase restores an orphaned switch first
        return "stuck", f"switch still active ({state.active_phase}) or owned"
    if state.poisoned is not None:
        return None
    obj = state.obj
    for name, want in state.bindings:
        if getattr(obj, name, None) is not want:
            return "silent", f"attribute '{name}' is not the bound object"
    now = _contents(state)
    if not (_same(now, before) or _same(now, done)):
        bad = next(n for n in now if not (torch.equal(now[n], before[n]) or torch.equal(now[n], done[n])))
        return "silent", f"buffer '{bad}' holds neither the old nor the completed contents"
    try:
        state.check()
    except GraphctlError as exc:
        return "silent", f"derived buffer stale: {exc.buffer}"
    try:
        with state.switch("draft", "eager"):
            pass
    except CorruptedStateError:
        return None
    except GraphctlError as exc:
        return "stuck", f"next switch refused: {type(exc).__name__}: {exc.what}"
    return None


def interrupt_sweep(setup: Callable[[], tuple[BoundState, Callable[[], Any]]], *,
                    files: Sequence[str] = _STATE_FILES, limit: int | None = None) -> SweepReport:
    """Interrupt ``op`` at every line executed in ``files`` (default: graphctl's state and ops
    layers) and classify each outcome. ``setup()`` returns ``(state, op)`` for a fresh,
    identical object each time; ``limit`` caps the points (evenly spread) for quick runs."""
    if sys.gettrace() is not None:
        raise RuntimeError("interrupt_sweep needs sys.settrace: run it without a debugger or coverage tracer")
    state, _, tracer, _ = _run(setup, files, None)
    done = _contents(state)  # what an uninterrupted run leaves
    points = list(range(1, tracer.count + 1))
    if limit is not None and len(points) > limit:
        step = len(points) / limit
        points = sorted({points[int(i * step)] for i in range(limit)})
    clean: list[int] = []
    poisoned: list[Any] = []
    silent: list[Any] = []
    stuck: list[Any] = []
    swallowed: list[tuple[int, str]] = []
    for p in points:
        state, before, tr, raised = _run(setup, files, p)
        if not tr.where:  # this run executed fewer lines (lazy set-up done once): nothing was delivered
            clean.append(p)
            continue
        if not isinstance(raised, KeyboardInterrupt):  # lost, or turned into another exception
            swallowed.append((p, tr.where if raised is None else f"{tr.where} -> {type(raised).__name__}"))
        bad = _diagnose(state, before, done)
        if bad is None:
            (poisoned if state.poisoned is not None else clean).append(p)
        else:
            (silent if bad[0] == "silent" else stuck).append((p, tr.where, bad[1]))
    return SweepReport(tracer.count, tuple(clean), tuple(poisoned), tuple(silent), tuple(stuck), tuple(swallowed))

"""Deferred interrupts: a few bookkeeping lines that must not be cut in half.

A ``KeyboardInterrupt`` (Ctrl-C, or any Python-level signal handler that raises) arrives
between two bytecodes, so it can land right after a fused snapshot returned and before the
switch recorded that it ran: undo would then skip a step that did run, or replay one that did
not. A CUDA graph replay cannot be stopped halfway either, and the emulated backend must not
be. :func:`deferred` holds Python-level signal handlers across such a section: a signal that
arrives inside it is remembered, and its handler runs once the section has ended, when the
state is consistent again (so the ``KeyboardInterrupt`` then propagates as itself). A second
Ctrl-C while one is held and a user callable runs is delivered at once (:class:`in_user_code`):
to the program's own SIGINT handler where it installed one (both signals, in order), else as a
``KeyboardInterrupt``.

Only the main thread receives signals, so elsewhere the section costs nothing. Handlers that
are not Python callables (``SIG_DFL``, ``SIG_IGN``) are left alone: they never raise into
Python code. Sections nest; the outermost one delivers. A long user callable inside a section
(a ``Recompute`` fn) delays the first Ctrl-C until the section ends; a second one gets through.
"""
from __future__ import annotations

# _signal: the C functions under ``signal.signal``/``getsignal``, which wrap every call's numbers
# and handlers in enums (~4 µs a call, four calls a section, two sections a switch)
import _signal
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["deferred", "drop_mode", "in_user_code", "ExitGuard", "DEFERRED_SIGNALS"]

# SIGINT is what Ctrl-C sends; SIGTERM only matters where a program installed a raising handler.
DEFERRED_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None))
                         if s is not None)
_MAIN = threading.main_thread()
_USER_CODE = [0]  # user callables (Recompute fns, CopyInPlace sources) running now: see in_user_code
_SIGINT = getattr(signal, "SIGINT", None)


class deferred:
    """Context manager: hold Python-level signal handlers for the body; run them after it.

    On exit every signal that arrived is handed to its own handler, in arrival order, while
    the hold is still in place. If a handler raises (``KeyboardInterrupt``), ``on_interrupt``
    runs first (still held: it undoes what the body did, e.g. a switch entry that must not
    survive an interrupted ``__enter__``), then the original handlers are reinstalled and the
    exception propagates as itself. Signals arriving during that cleanup are dropped: one
    interrupt is already on its way."""

    __slots__ = ("_saved", "_pending", "_active", "_on_interrupt")

    _depth = 0  # nesting depth in the main thread (only the main thread installs handlers)

    def __init__(self, on_interrupt: Callable[[], object] | None = None) -> None:
        self._saved: list[tuple[int, Any]] = []
        self._pending: list[tuple[int, Any]] = []
        self._active = False
        self._on_interrupt = on_interrupt

    @property
    def pending(self) -> bool:
        """True when a signal arrived inside the section and awaits delivery."""
        return bool(self._pending)

    def _hold(self, signum: int, frame: Any) -> None:
        if signum == _SIGINT and _USER_CODE[0] and any(p[0] == _SIGINT for p in self._pending):
            # a second Ctrl-C while the first is held and a user callable runs (a Recompute fn that hangs):
            # delivered at once, from inside that callable, which graphctl undoes like any callable that raises
            held = [p for p in self._pending if p[0] == _SIGINT]
            self._pending[:] = [p for p in self._pending if p[0] != _SIGINT]
            handler = dict(self._saved).get(_SIGINT, _signal.default_int_handler)
            if handler is _signal.default_int_handler:
                raise KeyboardInterrupt("a second Ctrl-C inside a user callable graphctl was running")
            # the program's own handler (a graceful shutdown) hears both, in order; if it raises, that propagates
            for _, first in held:
                handler(_SIGINT, first)
            handler(signum, frame)
            return
        self._pending.append((signum, frame))

    def __enter__(self) -> deferred:
        if threading.current_thread() is not _MAIN or deferred._depth:
            return self
        try:
            for s in DEFERRED_SIGNALS:
                h = _signal.getsignal(s)
                if callable(h):
                    _signal.signal(s, self._hold)
                    self._saved.append((s, h))
        except BaseException:  # a signal before the hold was in place: nothing has run yet
            self._restore()
            raise
        deferred._depth += 1
        self._active = True
        return self

    def _restore(self) -> None:
        # SIGINT is reinstalled last: until then every handler is ours, and ours never raises.
        for s, h in sorted(self._saved, key=lambda sh: sh[0] == _SIGINT):
            guard = getattr(h, "__self__", None)
            while isinstance(guard, ExitGuard) and not guard.active:  # removed while this section held it
                h = guard.saved
                guard = getattr(h, "__self__", None)
            _signal.signal(s, h)

    def __exit__(self, *exc: Any) -> None:
        if not self._active:
            return
        handlers = dict(self._saved)
        try:
            self._deliver(handlers)
            self._leave()
            self._deliver(handlers)  # what arrived while the originals were being reinstalled
        except BaseException:
            try:
                if self._on_interrupt is not None:
                    self._on_interrupt()
            finally:
                self._pending.clear()
                if self._active:
                    self._leave()
            raise

    def _deliver(self, handlers: dict[int, Any]) -> None:
        while self._pending:
            signum, frame = self._pending.pop(0)
            handlers[signum](signum, frame)  # the default SIGINT handler raises KeyboardInterrupt

    def _leave(self) -> None:
        deferred._depth -= 1
        self._active = False
        self._restore()


class ExitGuard:
    """While a switch is active in the main thread: a SIGINT whose handler runs in one of ``codes``
    (``Switch.__exit__`` before its restore section holds interrupts: a Ctrl-C lands at a call's
    first instruction) is held, and delivered by :meth:`remove` once the restore is done. Without
    it, that Ctrl-C left the switch active, and an ``except KeyboardInterrupt:`` handler or a
    checkpoint save read draft state until the state's next use. Any other SIGINT goes to the
    handler that was installed, at once. A guard never replaces a handler it did not save."""

    __slots__ = ("codes", "owner", "saved", "pending", "handle", "active")

    def __init__(self, codes: frozenset, owner: object) -> None:
        self.codes, self.active = codes, False
        self.saved: Callable[[int, Any], object] = _signal.default_int_handler  # replaced by install()
        self.pending: list[tuple[int, Any]] = []
        # the switch it guards, weakly (a guard left installed must not keep it alive); not by id(): a guard left
        # installed by a switch since collected took a new switch at the same address for its own, held that
        # switch's Ctrl-C at the last line of its __exit__ and never delivered it (a flake of the interrupt sweep)
        self.owner = weakref.ref(owner)
        self.handle = self._handle  # one bound method: compared by identity on removal

    def install(self) -> ExitGuard:
        if _SIGINT is not None and threading.current_thread() is _MAIN:
            cur = _signal.getsignal(_SIGINT)
            if callable(cur):
                self.saved, self.active = cur, True
                _signal.signal(_SIGINT, self.handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if frame is not None and (frame.f_code in self.codes or frame.f_code is _REMOVE):
            # in its own switch's __exit__ before the held section, or in its own remove() (which delivers what it
            # holds at its end); a guard left installed by a switch that never exited holds nothing of others
            me = frame.f_locals.get("self")
            mine = self.owner() is me if frame.f_code in self.codes else me is self
            if mine and (self.active or frame.f_code is _REMOVE):
                self.pending.append((signum, frame))
                return
        # removed but reinstalled by a section that saved it meanwhile: forwards, as the handler it replaced
        self.saved(signum, frame)

    def remove(self) -> None:
        """Put the saved handler back (when ours is still installed), then deliver what was held."""
        if not self.active:
            return
        self.active = False
        if _signal.getsignal(_SIGINT) is self.handle:
            _signal.signal(_SIGINT, self.saved)
        while self.pending:
            signum, _ = self.pending.pop(0)
            # no frame: a guard stacked under this one (another state's switch) forwards it instead of holding it
            self.saved(signum, None)  # the default handler raises KeyboardInterrupt: as itself


_REMOVE = ExitGuard.remove.__code__


class in_user_code:
    """Marks a user callable running inside a held section: there a second Ctrl-C is delivered at
    once (the usual "press Ctrl-C twice"), so a callable that never returns cannot make graphctl
    unstoppable; the first one is held as ever."""

    __slots__ = ()

    def __enter__(self) -> None:
        _USER_CODE[0] += 1

    def __exit__(self, *exc: Any) -> None:
        _USER_CODE[0] -= 1


def drop_mode(mode: Any) -> None:
    """Pop the dispatch ``mode`` if it is still the innermost one. A with-statement's exit runs a
    few bytecodes before it calls ``__exit__``: an interrupt delivered there skips the call, and a
    mode left on the stack would see (record, refuse) every later op of the thread. Call this in
    a ``finally`` around the with-statement; it does nothing when ``__exit__`` ran."""
    stack = _get_current_dispatch_mode_stack()
    if stack and stack[-1] is mode:
        mode.__exit__(None, None, None)

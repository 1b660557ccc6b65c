"""The switch transaction: reversible steps, applied in order and undone in reverse.

Generic: a ``Switch`` runs the steps its :class:`Owner` hands it and knows nothing else of it.
The owner (``BoundState``, ``graphctl.state.bound``) builds the steps of each phase once and
keeps the policy: who may switch (poisoned, nested, re-entrant, concurrent use), the checks on
entry (capture status, bindings, stale buffers), observers, fingerprints, poisoning.

A step counts as applied only after its ``apply`` returned, so an undo never "restores" from an
arena that was never filled. Any ``BaseException`` while applying undoes the applied
steps and re-raises the original exception; every undo and restore step runs even if an
earlier one failed, and any failure poisons the state (``CorruptedStateError``).
"""
from __future__ import annotations

import dis
import inspect
import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, Literal, Protocol

import torch

from graphctl.errors import SwitchError
from graphctl.state.interrupts import ExitGuard, deferred
from graphctl.state.phase import capture_invalidated

__all__ = ["FaultHook", "Owner", "Step", "StepFailures", "Switch"]

_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_WITH_OPS = frozenset(dis.opmap[n] for n in ("BEFORE_WITH", "SETUP_WITH") if n in dis.opmap)


def _with_frame(caller: Any) -> Any:
    """``caller`` when it is a plain function frame running a with-statement on the switch (the
    frame stays on the stack exactly as long as the with-block runs), else None: a manual
    ``__enter__()``, an ``ExitStack``, or a generator frame (it leaves the stack at each yield)
    say nothing about when the switch will be exited. On Pythons whose with-statement has no
    dedicated opcode (3.14) this is always None and no orphan is ever recovered."""
    if caller.f_code.co_flags & _SUSPENDABLE or caller.f_lasti < 0:
        return None
    return caller if caller.f_code.co_code[caller.f_lasti] in _WITH_OPS else None

FaultHook = Callable[[str, str, str], None]  # (stage, step, "before"|"after"), for fault-injection tests
Failures = list[tuple[str, BaseException]]  # (what could not be undone, why)


class StepFailures(Exception):
    """Raised by the undo of a step that restores several things (the native switch): every
    part that could not be undone, each with its own exception, reported as separate failures."""

    def __init__(self, failures: Failures) -> None:
        super().__init__("; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failures))
        self.failures = failures


class Step:
    """One reversible piece of a switch. ``apply`` and ``undo`` may raise. ``recorded`` marks
    device work that a CUDA capture records instead of running. ``idempotent`` marks a step
    whose ``undo`` is right whether ``apply`` ran fully, partly or not at all (a rebind, a
    recompute): the transaction records it as applied *before* applying it, so an apply that
    raises halfway is still undone. Other steps (a snapshot) count only once ``apply`` returned:
    undo never "restores" from an arena that was never filled. Their ``prepare`` (checks and
    source look-ups, which change nothing) runs first; an ``apply`` of theirs that raises may
    have written part of its buffers, which no undo can tell apart, so it poisons the state."""

    __slots__ = ("name", "apply", "undo", "recorded", "idempotent", "prepare")

    def __init__(self, name: str, apply: Callable[[], None], undo: Callable[[], None],
                 recorded: bool = False, idempotent: bool = False,
                 prepare: Callable[[], None] | None = None) -> None:
        self.name, self.apply, self.undo, self.recorded = name, apply, undo, recorded
        self.idempotent, self.prepare = idempotent, prepare


class Owner(Protocol):
    """What a switch needs of the state it switches; ``BoundState`` implements it."""

    device: torch.device
    _active: Switch | None  # the switch that owns the state now, if any

    def _claim(self, sw: Switch) -> None: ...  # own the state for ``sw``, or raise (nothing changed)
    def _release(self, sw: Switch) -> None: ...
    def _enter(self, sw: Switch) -> Any: ...  # entry checks and observers; what _leave verifies against
    def _notify(self, sw: Switch, event: str) -> None: ...  # observers: "applied" (entry done), "restore" (undo next)
    def _leave(self, sw: Switch, failed: bool) -> Failures: ...  # exit observers and verification
    def _stale_inside(self, sw: Switch) -> Exception | None: ...  # a derived buffer stale at exit (knob)
    def _steps(self, phase: str) -> tuple[Step, ...]: ...
    def _hook(self, stage: str, step: str, when: str) -> None: ...  # fault injection (tests)
    def _poison(self, failures: Failures) -> BaseException: ...  # later uses raise it


class Switch:
    """The context manager returned by :meth:`BoundState.switch`; one use. ``resolve`` maps a
    swapped name to its twin inside the switch (what a write inside it lands on).

    Entering and exiting each run as one :class:`~graphctl.state.interrupts.deferred`
    section: a ``KeyboardInterrupt`` that arrives while steps are applied or undone is held
    until the bookkeeping is consistent, then raised. An interrupt held during entry undoes
    the whole switch before it propagates (the ``with`` body never ran, so its ``__exit__``
    would not)."""

    __slots__ = ("state", "role", "phase", "resolve", "applied", "before", "used", "frame", "guard", "__weakref__")

    def __init__(self, state: Owner, role: str, phase: str, resolve: Mapping[str, str]) -> None:
        self.state, self.role, self.phase, self.resolve = state, role, phase, resolve
        self.applied: list[Step] = []
        self.before: Any = None
        self.used = False
        self.frame: Any = None  # the plain-function frame whose with-statement entered it
        self.guard: ExitGuard | None = None  # holds a Ctrl-C landing in __exit__ before its restore section

    def __enter__(self) -> Switch:
        st = self.state
        if self.used:
            raise SwitchError("a Switch object is entered twice", expected="a fresh state.switch(...) per use",
                              found=f"'{self.role}' ({self.phase}) already used",
                              fix="call state.switch(...) again for every with-statement")
        # A held interrupt is delivered as the section ends; if it raises, the entry is undone
        # (still held, by on_interrupt) since the with-statement never calls __exit__ for an
        # __enter__ that raised. The outer try covers the few bytecodes after the hold ends.
        partial: list[tuple[str, BaseException]] = []  # a snapshot that raised partway: cannot be undone
        try:
            with deferred(on_interrupt=self._unwind):
                st._claim(self)  # refuses poisoned, nested, re-entrant and concurrent use; owns the state
                self.used = True
                self.frame = _with_frame(sys._getframe(1))
                try:
                    self.before = st._enter(self)
                    for step in st._steps(self.phase):
                        st._hook("apply", step.name, "before")
                        if step.idempotent:
                            self.applied.append(step)
                            step.apply()
                        else:
                            if step.prepare is not None:
                                step.prepare()
                            try:
                                step.apply()
                            except BaseException as err:
                                partial.append((f"{step.name} (raised partway)", err))
                                raise
                            self.applied.append(step)
                        st._hook("apply", step.name, "after")
                    st._notify(self, "applied")
                except BaseException as exc:
                    failures = self._unwind() + partial
                    if partial:
                        st._poison(failures)
                    for name, why in failures:
                        exc.add_note(f"graphctl: {name} could not be undone ({type(why).__name__}: {why}); "
                                     "state poisoned")
                    raise
            self.guard = ExitGuard(_EXIT_CODES, self)  # assigned first: an interrupt in between finds it for _unwind
            self.guard.install()
            return self
        except BaseException:
            with deferred():
                self._unwind()  # idempotent: nothing left to undo when the inner handler ran
            raise

    def _unwind(self) -> Failures:
        """Undo an entry that will not complete; poison on a failed undo."""
        st = self.state
        if self.guard is not None:  # an interrupt right after the guard went in: it no longer guards anything
            guard, self.guard = self.guard, None
            guard.pending.clear()
            guard.remove()
        failures = self._undo("undo")
        st._release(self)
        if failures:
            st._poison(failures)
        return failures

    def _undo(self, stage: str) -> Failures:
        st, failures = self.state, []
        # A dead capture never runs what it recorded, so recorded device work has nothing to undo.
        dead = self.phase == "capture" and any(s.recorded for s in self.applied) and capture_invalidated(st.device)
        while self.applied:
            step = self.applied[-1]
            if not (dead and step.recorded):
                try:
                    st._hook(stage, step.name, "before")
                    step.undo()
                    st._hook(stage, step.name, "after")
                except StepFailures as err:
                    failures.extend(err.failures)
                except BaseException as err:  # keep restoring the rest; report all of them
                    failures.append((step.name, err))
            self.applied.pop()
        return failures

    def __exit__(self, et: Any, ev: Any, tb: Any) -> Literal[False]:
        try:
            self._restore(ev)
        except BaseException:
            # An interrupt before the restore section began: restore now, held, then raise it.
            if self.state._active is self:
                with deferred():
                    self._restore(None)
            raise
        return False

    def orphaned(self) -> bool:
        """True when the with-block that entered this switch has been left without its restore.

        A Ctrl-C at ``__exit__``'s first lines is held by the switch's ``ExitGuard``; one that
        still skips the restore (a handler that is not Python, a signal in another form) leaves
        the entering frame off the stack while the switch is active; the state's next use in this
        thread restores it (see ``BoundState``)."""
        if self.frame is None:
            return False
        f: FrameType | None = sys._getframe(1)
        while f is not None:
            if f is self.frame:
                return False
            f = f.f_back
        return True

    def _restore(self, ev: BaseException | None) -> None:
        st = self.state
        if st._active is not self:  # entry never completed (or a foreign exit): nothing is held
            return
        guard, self.guard = self.guard, None
        try:
            self._restore_held(ev)
        finally:
            if guard is not None:
                guard.remove()  # a Ctrl-C held by the guard is raised here, the switch restored

    def _restore_held(self, ev: BaseException | None) -> None:
        st = self.state
        with deferred():
            stale = st._stale_inside(self)  # before the restore hides it (never raises)
            failures: Failures = []
            try:
                st._notify(self, "restore")
            except BaseException as why:  # an observer that raises never skips the restore
                failures.append(("observer (restore)", why))
            failures += self._undo("restore")
            st._release(self)
            failures += st._leave(self, bool(failures))
            if failures:
                err = st._poison(failures)
                raise err from (ev if ev is not None else failures[0][1])
            if stale is not None and ev is None:  # restored cleanly; the body's own exception wins
                raise stale


# where a Ctrl-C is held by a switch's ExitGuard: __exit__ and the restore up to its held section
_EXIT_CODES = frozenset({Switch.__exit__.__code__, Switch._restore.__code__})

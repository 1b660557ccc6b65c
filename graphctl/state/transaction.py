"""The switch transaction: reversible steps, applied in order and undone in reverse.

``BoundState`` (``graphctl.state.bound``) builds the steps of each phase once; ``Switch`` runs
them. A step counts as applied only after its ``apply`` returned, so an undo never "restores"
from an arena that was never filled. Any ``BaseException`` while applying undoes the applied
steps and re-raises the original exception; every undo and restore step runs even if an
earlier one failed, and any failure poisons the state (``CorruptedStateError``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable


from graphctl.debug import knobs
from graphctl.errors import CorruptedStateError, NestedSwitchError, SwitchError
from graphctl.state.phase import capture_invalidated, capturing

if TYPE_CHECKING:
    from graphctl.state.bound import BoundState

__all__ = ["FaultHook", "Step", "Switch"]

FaultHook = Callable[[str, str, str], None]  # (stage, step, "before"|"after"), for fault-injection tests


class Step:
    """One reversible piece of a switch. ``apply`` and ``undo`` may raise; the transaction
    records a step as applied only after ``apply`` returned. ``recorded`` marks device work
    that a CUDA capture records instead of running."""

    __slots__ = ("name", "apply", "undo", "recorded")

    def __init__(self, name: str, apply: Callable[[], None], undo: Callable[[], None],
                 recorded: bool = False) -> None:
        self.name, self.apply, self.undo, self.recorded = name, apply, undo, recorded


class Switch:
    """The context manager returned by :meth:`BoundState.switch`; one use."""

    __slots__ = ("state", "role", "phase", "resolve", "applied", "before")

    def __init__(self, state: BoundState, role: str, phase: str) -> None:
        self.state, self.role, self.phase = state, role, phase
        self.resolve = state.plan.phases[phase].resolve
        self.applied: list[Step] = []
        self.before: list[list[int]] | None = None

    def _check_capture(self) -> None:
        st = self.state
        live = capturing(st.device)
        if st.device.type != "cuda" and not live:
            return  # a CPU state outside the recorder may rehearse any phase
        if live != (self.phase == "capture"):
            raise SwitchError("phase does not match the capture status", expected="capture" if live
                              else "eager or replay", found=self.phase,
                              fix="use phase='auto', or 'capture' exactly when a capture is running")

    def __enter__(self) -> "Switch":
        st = self.state
        st._check_usable()
        if st._active is not None:
            raise NestedSwitchError("switch entered while another switch is active on this state",
                                    expected="no active switch", found=f"active '{st._active.role}' "
                                    f"({st._active.phase})", fix="exit the active switch first; one switch per state")
        self._check_capture()
        st._check_bindings(entering=self.phase)
        for observe in st._observers:
            observe(self.role, self.phase, "enter")
        if self.phase != "capture":
            if knobs.check_stale:
                st.check()
            if knobs.verify_restore:
                self.before = st._fingerprints(self.phase)
        try:
            for step in st._steps(self.phase):
                st._hook("apply", step.name, "before")
                step.apply()
                self.applied.append(step)
                st._hook("apply", step.name, "after")
        except BaseException as exc:
            failures = self._undo("undo")
            if failures:
                st._poisoned = tuple(name for name, _ in failures)
                for name, err in failures:
                    exc.add_note(f"graphctl: undo of {name} failed ({type(err).__name__}: {err}); state poisoned")
            raise
        st._active = self
        return self

    def _undo(self, stage: str) -> list[tuple[str, BaseException]]:
        st, failures = self.state, []
        # A dead capture never runs what it recorded, so recorded device work has nothing to undo.
        dead = self.phase == "capture" and any(s.recorded for s in self.applied) and capture_invalidated(st.device)
        for step in reversed(self.applied):
            if dead and step.recorded:
                continue
            try:
                st._hook(stage, step.name, "before")
                step.undo()
                st._hook(stage, step.name, "after")
            except BaseException as err:  # keep restoring the rest; report all of them
                failures.append((step.name, err))
        self.applied.clear()
        return failures

    def __exit__(self, et, ev, tb) -> bool:
        st = self.state
        st._active = None
        failures = self._undo("restore")
        for observe in st._observers:
            observe(self.role, self.phase, "exit")
        if not failures and self.before is not None:
            after = st._fingerprints(self.phase)
            for g, b, a in zip(st._groups[self.phase], self.before, after):
                failures += [(f"verify({n})", RuntimeError("fingerprint changed"))
                             for n, x, y in zip(g.names, b, a) if x != y]
        if not failures:
            return False
        st._poisoned = tuple(name for name, _ in failures)
        err = CorruptedStateError(
            "restore after the switch failed; the state is poisoned", buffer=", ".join(st._poisoned),
            expected="every declared buffer and attribute restored",
            found="; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failures),
            fix="rebuild the metadata object and bind it again; later uses of this state raise",
            failures=st._poisoned)
        raise err from (ev if ev is not None else failures[0][1])

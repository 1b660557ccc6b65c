"""A spec bound to a live metadata object, and the transactional role switch.

``bind(obj)`` checks the object against its spec once and preallocates everything a switch needs
(one snapshot arena per device, the per-phase copy lists, the alias views of every twin), so a
switch allocates nothing. ``BoundState.switch(role, phase)`` then runs:

1. checks (not poisoned, not nested, no attribute rebound behind graphctl's back);
2. per device, one fused ``swap_through_``: snapshot every buffer the switch may write, and
   write the copy-in-place sources, in one pass;
3. rebind swapped attributes (and re-point their declared views) to their twins;
4. recompute the derived buffers whose inputs changed, in dependency order
   (2-4 as one ``graphctl._C`` call where it can: ``graphctl.state.native``).

Any ``BaseException`` while applying undoes the applied steps in reverse and re-raises it. On
exit every step is undone in reverse; a failed undo poisons the state (``CorruptedStateError``).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import ConcurrentUseError, CorruptedStateError, NestedSwitchError, SwitchError
from graphctl.knobs import knobs
from graphctl.state import paths, recorded, writes
from graphctl.state.arena import allocate_arenas, make_groups
from graphctl.state.binding import Binding
from graphctl.state.interrupts import deferred, in_user_code
from graphctl.state.native import native_step
from graphctl.state.phase import capturing, check_given, resolve_phase
from graphctl.state.plan import PHASES, Plan, compile_spec
from graphctl.state.recompute import refuse_return
from graphctl.state.registry import Registry, default_registry
from graphctl.state.spec import CopyInPlace
from graphctl.state.steps import python_steps
from graphctl.state.traced import TracedSwitch, traced_write
from graphctl.state.transaction import FaultHook, Step, Switch
from graphctl.state.validate import bind_aliases, check_bindings, expected_bindings, validate

__all__ = ["bind", "BoundState", "ROLES"]

ROLES = ("draft",)
_KNOBS = knobs.live()  # read on every switch: a dict read (a knob attribute costs ~1 µs through __getattr__)


def bind(obj: Any, *, registry: Registry | None = None, dims: Mapping[str, int] | None = None) -> BoundState:
    """Bind ``obj`` to the spec registered for its type (see :class:`BoundState`)."""
    spec = paths.expand_spec((registry or default_registry).lookup(type(obj)), obj)  # "[*]" entries, per object
    return BoundState(obj, compile_spec(spec), dims=dims)


class BoundState:
    """A metadata object bound to its compiled spec. Create with :func:`graphctl.bind`.

    Constraints (each checked; violations raise the typed errors of ``graphctl.errors``):

    - Declared buffers are dense, on one device (``host=True`` ones on the CPU, pinned when
      that device is CUDA), disjoint in memory except declared aliases, and never rebound or
      reallocated after ``bind``; call ``bind`` again after reallocating.
    - One switch at a time per state; a nested ``switch`` raises ``NestedSwitchError``, and so
      does a ``switch``, ``write``, ``pad`` or ``check`` issued from inside a ``Recompute`` fn
      or a ``CopyInPlace`` source that graphctl is running.
    - One thread at a time: while a switch (or a ``write``/``pad``) of one thread owns the
      state, another thread's use raises ``ConcurrentUseError`` (it never waits, and never
      corrupts). Bind one state per thread, or serialize the calls.
    - A switch restores every declared buffer except ``Stable`` scratch (and the originals a
      ``Swap`` unbinds), whoever wrote it: graphctl, the user or the forward's own kernels.
      Inside a switch, only ``mutable`` buffers may be written with ``write``.
    - ``write`` and ``pad`` are all-or-nothing: checked first, then applied with an undo copy;
      a recompute that raises rolls every written buffer back.
    - A ``KeyboardInterrupt`` arriving while a switch, ``write`` or ``pad`` changes state is
      held until the state is consistent again, then raised (``graphctl.state.interrupts``).
    - A bound state cannot be copied or pickled (``SwitchError``): its snapshot slots and its
      ownership belong to one object. Copy the metadata object and ``bind`` the copy.
    - Recompute functions and callable copy sources must be capturable (no host sync, no
      allocation) for the ``capture`` phase to be; graphctl's own work is.
    - Host buffers are copied on the host even in the ``capture`` phase: a graph never
      records host copies, so host mirrors must not be read by captured kernels.
    """

    def __init__(self, obj: Any, plan: Plan, *, dims: Mapping[str, int] | None = None) -> None:
        self.obj = obj
        self.plan = plan
        self.binding = b = Binding(obj, plan, dict(dims or {}))  # what binding produces (state/binding.py)
        self._active: Switch | None = None
        self._lock = threading.Lock()  # held by the switch (or write/pad) that owns the state
        self._owner: int | None = None  # thread id of that owner
        self._in_user: str | None = None  # the user callable graphctl is running, if any
        self._in_user_thread: int | None = None  # the thread running it: another thread's use is concurrent
        self._poisoned: tuple[str, ...] | None = None
        self._fault_hook: FaultHook | None = None
        self._user_hook: Callable[[str], None] | None = None  # test seam: runs as a user callable starts
        self._hooked_native = False  # test seam: hooks fire around the native step instead of forcing Python steps
        self._observers: list[Callable[[str, str, str], None]] = []
        self.uses = 0  # switches, writes and pads so far (a runner tells whether an eager region used the state)
        self._step_cache: dict[str, tuple[Step, ...]] = {}
        self._traced: TracedSwitch | None = None  # the switch a compiled function is in (state/traced.py)
        validate(self)  # fills the binding's tensors, objects, dims and device, or raises BindError
        b.manifest = tuple(list(b.tensors.items()) + list(b.objects.items()))
        b.index = {n: i for i, (n, _) in enumerate(b.manifest)}
        b.aliases = bind_aliases(self)
        b.arena = allocate_arenas(plan, b.tensors, b.device)
        b.groups = {p: make_groups(plan, p, b.tensors, b.arena) for p in PHASES}
        b.padded = tuple((n, d, b.tensors[n]) for n, d in plan.buffers.items()
                         if d.axis is not None and d.derive is None and not d.stable)
        # A fresh state is consistent: every derived buffer equals fn(inputs) from bind on.
        for name in plan.order:
            self._recompute(name)

    device = property(lambda self: self.binding.device, doc="The device of the declared device buffers.")
    dims = property(lambda self: self.binding.dims, doc="Shape symbol -> size, as bound.")

    # ------------------------------------------------------------------ copies, pickling

    def _refuse_copy(self, how: str) -> SwitchError:
        verb = {"copied": "copy", "deep-copied": "deep-copy", "pickled": "pickle"}[how]
        return SwitchError(f"a bound state cannot be {how}", buffer=None, expected="one BoundState per object",
                           found=f"an attempt to {verb} the state of {type(self.obj).__qualname__}",
                           fix="copy the metadata object itself and graphctl.bind() the copy: snapshot slots and "
                               "switch ownership belong to one state")

    def __copy__(self) -> BoundState:
        raise self._refuse_copy("copied")

    def __deepcopy__(self, memo: Any) -> BoundState:
        raise self._refuse_copy("deep-copied")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self._refuse_copy("pickled")

    # ---------------------------------------------------------------------- introspection

    @property
    def poisoned(self) -> tuple[str, ...] | None:
        """What could not be restored, or None when the state is healthy."""
        return self._poisoned

    active_switch = property(lambda self: self._active, doc="The switch open now (its role and phase), or None.")
    bindings = property(lambda self: self.binding.manifest, doc="((entry, tensor or object bound at bind time), ...).")
    in_user = property(lambda self: self._in_user, doc="The user callable graphctl runs now (its label), or None.")

    @property
    def active_phase(self) -> str | None:
        self._recover()
        return self._active.phase if self._active is not None else None

    def addresses(self) -> dict[str, int]:
        """The address manifest: every declared buffer's data pointer (twins included)."""
        return {n: t.data_ptr() for n, t in self.binding.tensors.items()}

    def live_addresses(self) -> dict[str, int | None]:
        """What the object's attributes point at now (``None`` where one is not a tensor); a
        graph captured against :meth:`addresses` reads stale memory wherever the two differ."""
        out: dict[str, int | None] = {}
        for n in self.binding.tensors:
            v = paths.get(self.obj, n, None)
            out[n] = v.data_ptr() if isinstance(v, torch.Tensor) else None
        return out

    def mutable_names(self) -> tuple[str, ...]:
        """Buffers declared ``mutable`` or ``Persistent`` and the derived buffers computed from
        them: what a warmup or capture run may accumulate into."""
        mutable = [n for n, d in self.plan.buffers.items() if n in self.plan.mutable or d.persistent]
        return tuple(mutable) + self.plan.closure(mutable)

    def restorable_names(self) -> tuple[str, ...]:
        """Every buffer except ``Stable`` scratch: what ``pad`` and a forward may change."""
        return tuple(n for n, d in self.plan.buffers.items() if not d.stable)

    def snapshot_names(self, phase: str) -> tuple[str, ...]:
        return self.plan.phases[self._phase(phase)].snapshot

    def snapshot_bytes(self, phase: str) -> int:
        ts = self.binding.tensors
        return sum(ts[n].numel() * ts[n].element_size() for n in self.snapshot_names(phase))

    def arenas(self) -> dict[str, torch.Tensor]:
        """graphctl's snapshot slots, ``"family:name"``: memory a captured switch reads and writes."""
        return {f"{fam}:{n}": t for (fam, n), t in self.binding.arena.items()}

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor bound to entry ``name`` at bind time (twins are entries too)."""
        return self.binding.tensors[name]

    # ------------------------------------------------------------------------ use checks

    def _phase(self, phase: str) -> str:
        if phase not in PHASES:
            raise SwitchError("unknown phase", expected=" / ".join(PHASES + ("auto",)), found=phase,
                              fix="eager for a plain forward, capture under a capture, replay around replay() "
                                  "(refresh is the graph runner's), auto to pick eager or capture")
        return phase

    def check_usable(self) -> None:
        """Raise ``CorruptedStateError`` when the state is poisoned (a restore failed earlier)."""
        if self._poisoned is not None:
            raise CorruptedStateError(
                f"state of {type(self.obj).__qualname__} is poisoned: a restore failed earlier",
                buffer=", ".join(self._poisoned), expected="every buffer restored", found="restore failed",
                fix="rebuild the metadata object (these buffers may hold draft-state contents) and bind it again",
                failures=self._poisoned)

    def _poison(self, failures: list[tuple[str, BaseException]]) -> CorruptedStateError:
        self._poisoned = tuple(name for name, _ in failures)
        return CorruptedStateError(
            "restore after the switch failed; the state is poisoned", buffer=", ".join(self._poisoned),
            expected="every declared buffer and attribute restored",
            found="; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in failures),
            fix="rebuild the metadata object and bind it again; later uses of this state raise",
            failures=self._poisoned)

    def _refuse_reentry(self, what: str) -> None:
        if self._in_user is not None:
            if self._in_user_thread != threading.get_ident():
                raise self._busy(what)  # another thread is inside a user callable of this state: not a nesting
            raise NestedSwitchError(f"{what} issued from inside {self._in_user}", buffer=None,
                                    expected="switches and writes from the caller's code only",
                                    found=f"a call from {self._in_user}",
                                    fix="a Recompute fn or CopyInPlace source must only compute: it runs in the "
                                        "middle of a switch or write, whose snapshot it would overwrite")

    def _begin_use(self, what: str) -> None:
        """The checks every use starts with: not from inside a user callable, an orphaned switch
        of this thread restored, not poisoned."""
        self._refuse_reentry(what)
        self._recover()
        self.check_usable()

    def _busy(self, what: str) -> ConcurrentUseError:
        holder = f"active '{self._active.role}' switch ({self._active.phase})" if self._active else "a write or pad"
        return ConcurrentUseError(f"{what} while another thread owns the state", buffer=None,
                                  expected="one thread at a time per bound state",
                                  found=f"{holder} owned by another thread",
                                  fix="bind one state per thread, or serialize the calls with a lock")

    def _claim(self, sw: Switch) -> None:
        """Make ``sw`` the state's one active switch, or raise (nothing changed)."""
        if self._owner is not None and self._owner != threading.get_ident():
            raise self._busy("switch")
        self._begin_use("switch")
        me = threading.get_ident()
        self.uses += 1
        if not self._lock.acquire(blocking=False):
            if self._owner == me and self._active is not None:
                raise NestedSwitchError("switch entered while another switch is active on this state",
                                        expected="no active switch",
                                        found=f"active '{self._active.role}' ({self._active.phase})",
                                        fix="exit the active switch first; one switch per state")
            raise self._busy("switch")
        self._owner, self._active = me, sw

    def _release(self, sw: Switch) -> None:
        if self._active is sw:
            sw.frame = None
            self._active, self._owner = None, None
            self._lock.release()

    def _recover(self) -> None:
        """Restore this thread's switch whose with-block was left without running its restore
        (an interrupt delivered as ``__exit__`` began: see ``Switch.orphaned``)."""
        sw = self._active
        if sw is not None and self._owner == threading.get_ident() and sw.orphaned():
            with deferred():
                sw._restore(None)

    @contextlib.contextmanager
    def _owned(self, what: str) -> Iterator[None]:
        """Own the state for a write/pad: inside this thread's active switch it already is."""
        me = threading.get_ident()
        self.uses += 1
        if self._owner == me:
            yield
            return
        if not self._lock.acquire(blocking=False):
            raise self._busy(what)
        self._owner = me
        try:
            yield
        finally:
            self._owner = None
            self._lock.release()

    def _call_user(self, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        prev, prev_thread = self._in_user, self._in_user_thread
        self._in_user = f"{label} ({getattr(fn, '__qualname__', type(fn).__name__)})"
        # traced by dynamo inside a compiled switch (state/traced.py): no thread id, no signal bookkeeping there
        traced = torch.compiler.is_compiling()
        self._in_user_thread = None if traced else threading.get_ident()
        try:
            if self._user_hook is not None:
                self._user_hook(self._in_user)
            if traced:
                return fn(*args)
            with in_user_code():  # a second Ctrl-C gets through a callable that hangs
                return fn(*args)
        finally:
            self._in_user, self._in_user_thread = prev, prev_thread

    def _expected(self, phase: str | None) -> tuple[tuple[str, Any], ...]:
        return expected_bindings(self, phase)

    def _check_bindings(self, entering: str | None = None) -> None:
        check_bindings(self, entering)

    def _hook(self, stage: str, step: str, when: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(stage, step, when)

    # ------------------------------------------------------------------------ the switch

    def switch(self, role: str, phase: str = "auto") -> Switch:
        """Context manager: enter ``role`` (``"draft"``) for ``phase`` (``eager``, ``capture``,
        ``replay``, or ``auto``: ``capture`` under a capture, else ``eager``) and restore
        everything on exit. See the module docstring."""
        if role not in ROLES:
            raise SwitchError("unknown role", expected=" / ".join(ROLES), found=role,
                              fix="the target role is the bound state itself; switch('draft', ...) enters the draft")
        if torch.compiler.is_compiling():  # torch.compile traces the plan as plain tensor code
            return TracedSwitch(self, role, "eager" if phase == "auto" else phase)  # type: ignore[return-value]
        phase = self._phase(resolve_phase(phase, self.device))
        return Switch(self, role, phase, self.plan.phases[phase].resolve)

    def _enter(self, sw: Switch) -> list[list[int]] | None:
        """The policy on entry (the switch owns the state, nothing applied yet): the phase
        matches the capture status, every attribute is bound as expected, observers hear of it,
        and (knobs) derived buffers are checked and fingerprints taken for :meth:`_leave`."""
        live = capturing(self.device)
        if sw.phase == "capture":
            check_given(self)
        if (self.device.type == "cuda" or live) and live != (sw.phase == "capture"):  # CPU: may rehearse any
            raise SwitchError("phase does not match the capture status", expected="capture" if live
                              else "eager or replay", found=sw.phase,
                              fix="use phase='auto', or 'capture' exactly when a capture is running")
        self._check_bindings(entering=sw.phase)
        for observe in self._observers:
            observe(sw.role, sw.phase, "enter")
        if sw.phase != "capture":
            if _KNOBS["check_stale"]:
                self.check()
            if _KNOBS["verify_restore"]:
                return self._fingerprints(sw.phase)
        return None

    def _stale_inside(self, sw: Switch) -> Exception | None:  # GRAPHCTL_CHECK_STALE at a switch's exit
        return writes.stale_at_exit(self, sw) if sw.phase != "capture" and _KNOBS["check_stale"] else None

    def _notify(self, sw: Switch, event: str) -> None:  # "applied" after the entry, "restore" before the undo
        for observe in self._observers:
            observe(sw.role, sw.phase, event)

    def _leave(self, sw: Switch, failed: bool) -> list[tuple[str, BaseException]]:
        """The policy on exit, after every step was undone: observers hear of it (one raising
        is a failure, not a skipped restore) and, when :meth:`_enter` fingerprinted, every
        snapshotted buffer must be back to those fingerprints."""
        failures: list[tuple[str, BaseException]] = []
        for observe in self._observers:
            try:
                observe(sw.role, sw.phase, "exit")
            except BaseException as err:
                failures.append((f"observer {getattr(observe, '__qualname__', observe)}", err))
        if not failed and not failures and sw.before is not None:
            after = self._fingerprints(sw.phase)
            for g, b, a in zip(self.binding.groups[sw.phase], sw.before, after):
                failures += [(f"verify({n})", RuntimeError("fingerprint changed"))
                             for n, x, y in zip(g.names, b, a) if x != y]
        return failures

    @contextlib.contextmanager
    def observe(self, callback: Callable[[str, str, str], None]) -> Iterator[None]:
        """Call ``callback(role, phase, event)`` at every switch boundary inside the region:
        ``"enter"`` before the entry, ``"applied"`` after it, ``"restore"`` before the undo and
        ``"exit"`` after it (the graph runner marks segments and their entry and exit sections)."""
        self._observers.append(callback)
        try:
            yield
        finally:
            self._observers.remove(callback)

    def _steps(self, phase: str) -> tuple[Step, ...]:
        # Built once per phase (the first switch in it) and reused: a switch creates no closures.
        # One native step (state/native.py) where it can; the Python steps when a hook reaches inside.
        hooked = (self._fault_hook is not None or self._user_hook is not None) and not self._hooked_native
        key = "py:" + phase if hooked or not _KNOBS["native_switch"] else phase
        steps = self._step_cache.get(key)
        if steps is None:
            one = native_step(self, phase) if key == phase else None
            steps = (one,) if one is not None else python_steps(self, phase)
            self._step_cache[key] = steps
        return steps

    def _source(self, act: CopyInPlace) -> Any:
        if callable(act.source):
            return self._call_user("a CopyInPlace source", act.source, self.obj)
        return paths.get(self.obj, act.source)

    def _recompute(self, name: str, out: torch.Tensor | None = None) -> None:
        rc = self.plan.buffers[name].derive
        assert rc is not None  # recompute steps exist for derived buffers only
        target = paths.get(self.obj, name) if out is None else out
        refuse_return(name, target, self._call_user(f"the Recompute fn of '{name}'", rc.fn, target,
                                                    *(paths.get(self.obj, i) for i in rc.inputs)))

    # --------------------------------------------------------------------- writes, checks

    def write(self, name: str, value: torch.Tensor) -> None:
        """Write ``value`` into buffer ``name`` in place and recompute every derived buffer
        that depends on it, transitively (on the device, capturable, no host sync).

        ``value`` has the buffer's shape, except along the declared axis where it may be
        shorter (``n`` rows): the tail ``[n:extent]`` then gets the padding policy. Inside a
        switch only ``mutable`` buffers may be written (they are snapshotted and restored), and
        the write lands where the attribute is bound now (a swapped buffer's twin): every
        buffer derived from that storage, under any of its names, is recomputed.

        All or nothing: everything is checked before a byte is written; a recompute that
        raises (or an interrupt) rolls the written buffers back. The value never brings
        autograd history into the static buffer."""
        (traced_write if torch.compiler.is_compiling() else writes.write)(self, name, value)

    def write_many(self, values: Mapping[str, torch.Tensor]) -> None:
        """:meth:`write` of several buffers as one: all checked first, one all-or-nothing
        section, and every derived buffer of any of them recomputed once (two lengths written
        one by one recompute their shared maps twice)."""
        if torch.compiler.is_compiling():
            for name, value in values.items():
                traced_write(self, name, value)
        else:
            writes.write_many(self, values)

    def pad(self, counts: Mapping[str, int], ends: Mapping[str, int] | None = None) -> None:
        """Each buffer's padding policy on ``[counts[axis]:ends[axis] or extent]`` along its axis,
        then the dependents of what was padded recomputed. All or nothing, like :meth:`write`."""
        writes.pad(self, counts, ends)

    def check(self) -> None:
        """Debug: recompute every derived buffer into scratch and raise ``StaleBufferError``
        on the first one that differs from the live buffer. Host sync; not for captures."""
        writes.check(self)

    def recover_recorded(self, where: str, cause: BaseException, partial: bool, device_type: str | None) -> None:
        """A graph replay stopped inside a switch it recorded (``where``): see ``state/recorded.py``."""
        recorded.recover(self, where, cause, partial, device_type)

    def _fingerprints(self, phase: str) -> list[list[int]]:
        return [ops.fingerprint(g.statics).tolist() for g in self.binding.groups[phase]]

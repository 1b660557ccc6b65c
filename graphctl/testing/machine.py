"""A Hypothesis ``RuleBasedStateMachine`` for the swap/restore invariants of a bound state.

Run it on your own backend by overriding :meth:`SwitchMachine.draw_case`, returning a
:class:`~graphctl.testing.strategies.Case` (your metadata object, the registry holding its
spec, a generator for values)::

    class MyBackendMachine(SwitchMachine):
        def draw_case(self, data):
            return Case(obj=make_my_metadata(), spec=my_spec, registry=my_registry,
                        gen=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1))))

    TestMyBackend = MyBackendMachine.TestCase

Rules: writes (outside and inside a switch, each followed by a consistency check), switch enter/exit in every
phase, bodies raising ``Exception`` and ``BaseException``, faults injected before/after any apply, undo or
restore step, *inside* the fused snapshot and restore ops (half the buffers written, then a raise) and at the
k-th op any entry or exit dispatches (``graphctl.testing.faults``: they reach inside the native table too),
nested switch attempts, switches and writes issued from inside the state's own user callables (``Recompute``
fns, ``CopyInPlace`` sources), and a second thread using the state while a switch owns it. Invariants after
every step: outside a switch every buffer is bitwise what the model says (or the state is poisoned and refuses
all use, exactly when an undo, restore or in-op fault fired); derived buffers equal ``fn(inputs)``, recomputed
here from the current bindings without going through graphctl; addresses and attribute bindings unchanged; no
allocation inside a switch.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from graphctl.errors import ConcurrentUseError, CorruptedStateError, NestedSwitchError, StaleBufferError, SwitchError
from graphctl.state import PHASES, bind, seams
from graphctl.state.transaction import Switch
from graphctl.testing.alloc import AllocationTracker
from graphctl.testing.faults import InjectedFault, InjectedInterrupt, fault_at_op, partial_op
from graphctl.testing.strategies import Case, cases

__all__ = ["SwitchMachine", "InjectedFault", "InjectedInterrupt"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


class SwitchMachine(RuleBasedStateMachine):
    #: Phases the machine enters. On CUDA, ``capture`` needs a real stream capture, which the
    #: graph tests exercise; a CUDA machine sets ("eager", "replay").
    phases: tuple[str, ...] = PHASES

    def draw_case(self, data: Any) -> Case:
        """Override to run the machine on your own backend."""
        return data.draw(cases())

    # -------------------------------------------------------------------------- setup

    @initialize(data=st.data())
    def setup(self, data: Any) -> None:
        self._start(self.draw_case(data))

    def _start(self, case: Case) -> None:
        self.case = case
        self.state = bind(case.obj, registry=case.registry)
        # half the runs drive the native switch table users get (hooks fire around its one step, in-op faults
        # reach inside it through the dispatcher), half the Python steps, its reference
        seams.install(self.state, fault=self._hook, native=case.native)
        note(f"switch: {'native table' if case.native else 'Python steps'}")
        self.plan = self.state.plan
        # entries declared by a path below an object (a manager's KV pool, ``kv.k[0]``) are the forward's
        # own (Persistent) or scratch (Stable): no rule writes them; every switch must leave them be
        self.deep = {n: _bytes(self.state.tensor(n)).clone() for n, d in self.plan.buffers.items()
                     if not n.isidentifier() and not d.stable}
        self.names = [n for n in self.plan.buffers if n.isidentifier()]
        self.model = {n: getattr(case.obj, n).detach().clone() for n in self.names}  # what outside should hold
        self.bindings = {n: getattr(case.obj, n) for n in self.names + list(self.plan.objects)}
        self.manifest = self.state.addresses()
        self.switch: Switch | None = None
        self.faults: list[list[Any]] = []  # [stage, when, countdown, exception type]
        self.fired: list[str] = []
        note(f"spec {case.spec.name}: " + ", ".join(f"{n}:{d}" for n, d in case.spec.entries.items()))

    def _hook(self, stage: str, step: str, when: str) -> None:
        for f in self.faults:
            if f[0] == stage and f[1] == when:
                f[2] -= 1
                if f[2] == 0:
                    self.faults.remove(f)
                    self.fired.append(stage)
                    note(f"fault {f[3].__name__} at {stage} {when} {step}")
                    raise f[3](f"injected at {stage} {when} {step}")

    def _rebuilt_if_poisoned(self, data: Any) -> bool:
        """A poisoned state (its refusals already checked by the invariants) is replaced by a
        fresh case, so rules drawing data stay enabled and no example is abandoned for want of
        an enabled rule (the thorough profile abandoned about 11% that way)."""
        if self.state.poisoned is None:
            return False
        self._start(self.draw_case(data))
        return True

    def _expect_poisoned(self) -> bool:
        return any(s in ("undo", "restore", "inside") for s in self.fired)

    # -------------------------------------------------------------------------- rules

    @rule(stage=st.sampled_from(["apply", "undo", "restore"]), when=st.sampled_from(["before", "after"]),
          countdown=st.integers(1, 4), kind=st.sampled_from([InjectedFault, InjectedInterrupt]))
    def arm_fault(self, stage: str, when: str, countdown: int, kind: type) -> None:
        self.faults.append([stage, when, countdown, kind])

    @rule(data=st.data())
    def write(self, data: Any) -> None:
        if self._rebuilt_if_poisoned(data):
            return
        name = data.draw(st.sampled_from(self.names), label="buffer")
        d = self.plan.buffers[name]
        live = getattr(self.case.obj, name)
        rows = None
        if d.axis is not None:
            rows = data.draw(st.integers(0, live.shape[d.axis_dim]), label="rows")
        value = self.case.value(name, rows)
        refused = d.derive is not None or (
            self.switch is not None and (not d.mutable or self.switch.phase == "refresh")
        )
        before = {n: _bytes(getattr(self.case.obj, n)) for n in self.names}
        if refused:
            try:
                self.state.write(name, value)
            except SwitchError:
                pass
            else:
                raise AssertionError(f"write to {name} should have been refused")
            for n in self.names:
                assert torch.equal(before[n], _bytes(getattr(self.case.obj, n))), f"refused write changed {n}"
            return
        if self.switch is None:
            self.state.write(name, value)
            self._model_write(name, value)
            return
        # inside a switch a write recomputes in the middle of the switch: the no-allocation rule holds there too
        with AllocationTracker(where=lambda: self.state.in_user) as alloc:
            self.state.write(name, value)
        assert not alloc.allocations, f"write('{name}') inside a switch allocated: {alloc.allocations}"
        self._check_inside()  # a write inside a switch leaves every derived buffer = fn(inputs) as bound now

    def _model_write(self, name: str, value: torch.Tensor) -> None:
        d = self.plan.buffers[name]
        m = self.model[name]
        if d.axis is not None and value.shape[d.axis_dim] < m.shape[d.axis_dim]:
            n = value.shape[d.axis_dim]
            m.narrow(d.axis_dim, 0, n).copy_(value)
            tail = m.narrow(d.axis_dim, n, m.shape[d.axis_dim] - n)
            pad = d.pad
            assert pad is not None  # a buffer with an axis has a padding policy (spec.py refuses one without)
            if pad.kind == "zero":
                tail.zero_()
            elif pad.kind == "fill":
                tail.fill_(pad.value)
            elif pad.kind == "clamp":
                tail.clamp_(pad.lo, pad.hi)
            elif pad.kind in ("edge", "arange"):  # row by row, from the last live row: an independent oracle
                ax, step = d.axis_dim, (pad.step or 0) if pad.kind == "arange" else 0
                prev = m.narrow(ax, n - 1, 1).clone() if n else None
                for i in range(tail.shape[ax]):
                    row = tail.narrow(ax, i, 1)
                    if prev is None:
                        row.fill_(i * step)
                    else:
                        row.copy_(prev + (i + 1) * step)
        else:
            m.copy_(value)
        for dep in self.plan.dependents[name]:
            rc = self.plan.buffers[dep].derive
            assert rc is not None  # a dependent is derived
            rc.fn(self.model[dep], *(self.model[i] for i in rc.inputs))

    @rule(data=st.data())
    def enter(self, data: Any) -> None:
        if self._rebuilt_if_poisoned(data):
            return
        phase = data.draw(st.sampled_from(self.phases), label="phase")
        if self.switch is not None:
            before = {n: _bytes(getattr(self.case.obj, n)) for n in self.names}
            try:
                with self.state.switch("draft", phase):
                    raise AssertionError("nested switch entered")
            except NestedSwitchError:
                pass
            for n in self.names:
                assert torch.equal(before[n], _bytes(getattr(self.case.obj, n))), f"nested attempt changed {n}"
            assert self.state.active_phase == self.switch.phase
            return
        cm = self.state.switch("draft", phase)
        n_fired = len(self.fired)
        with AllocationTracker(where=lambda: self.state.in_user) as alloc:
            try:
                cm.__enter__()
            except (InjectedFault, InjectedInterrupt):
                assert "apply" in self.fired[n_fired:], "an exception escaped without an apply fault"
                assert self.state.active_phase is None
                return
            except Exception as exc:  # a usable state's switch raised: a bug the machine reports as such
                raise AssertionError(f"entry into {phase} raised {exc!r}") from exc
        assert not alloc.allocations, f"switch entry allocated: {alloc.allocations}"
        assert len(self.fired) == n_fired, "a fault fired but entry succeeded"
        self.switch = cm
        self._check_inside()

    def _check_inside(self) -> None:
        assert self.switch is not None
        pp = self.plan.phases[self.switch.phase]
        for name, twin in pp.swaps:
            assert getattr(self.case.obj, name) is self.bindings[twin], f"{name} not swapped to {twin}"
        self._derived_consistent()
        self._state_check()

    def _state_check(self) -> None:
        """``state.check()`` where the model says every derived buffer is consistent: a stale one is
        graphctl disagreeing with the oracle (an invariant's failure, never a crash)."""
        try:
            self.state.check()
        except StaleBufferError as e:
            raise AssertionError(f"state.check() disagrees with the model: {e}") from e

    def _derived_consistent(self) -> None:
        """Every derived buffer equals its fn over the inputs bound *now*, recomputed here into a
        scratch copy, without graphctl's own recompute path (which could share a bug)."""
        obj = self.case.obj
        for name in self.plan.order:
            rc = self.plan.buffers[name].derive
            assert rc is not None  # plan.order lists derived buffers
            live = getattr(obj, name)
            want = torch.empty_like(live)
            rc.fn(want, *(getattr(obj, i) for i in rc.inputs))
            assert torch.equal(_bytes(live), _bytes(want)), f"derived buffer {name} != fn(inputs) as bound now"

    @precondition(lambda self: self.switch is not None)
    @rule(body=st.sampled_from([None, InjectedFault, InjectedInterrupt]))
    def exit(self, body: type | None) -> None:
        cm, self.switch = self.switch, None
        assert cm is not None  # the precondition
        exc = body("body raised") if body is not None else None
        n_fired = len(self.fired)
        with AllocationTracker(where=lambda: self.state.in_user) as alloc:
            try:
                swallowed = cm.__exit__(body, exc, None)
            except CorruptedStateError:
                assert "restore" in self.fired[n_fired:], "CorruptedStateError without a restore fault"
                return
        assert not swallowed, "a switch must never swallow the body's exception"
        assert not alloc.allocations, f"switch exit allocated: {alloc.allocations}"
        assert "restore" not in self.fired[n_fired:], "a restore fault fired but exit reported success"

    @precondition(lambda self: self.switch is None and not self.faults)
    @rule(data=st.data())
    def enter_with_fault_inside_the_snapshot(self, data: Any) -> None:
        """The fused snapshot raises after writing half its buffers: no undo can tell which
        half, so the state must be poisoned (never a silent partial restore)."""
        if self._rebuilt_if_poisoned(data):
            return
        phase = data.draw(st.sampled_from(self.phases), label="phase")
        cm = self.state.switch("draft", phase)
        n_fired = len(self.fired)
        with partial_op("swap_through_", self.fired, "inside"):
            try:
                cm.__enter__()
            except InjectedFault:
                assert self.state.poisoned is not None, "a snapshot that raised partway left the state usable"
                return
        assert len(self.fired) == n_fired, "an in-op fault fired but entry succeeded"
        self.switch = cm  # the phase snapshots nothing: entry completed
        self._check_inside()

    @precondition(lambda self: not self.faults)
    @rule(data=st.data(), k=st.integers(0, 6), kind=st.sampled_from([InjectedFault, InjectedInterrupt]))
    def fault_at_any_op(self, data: Any, k: int, kind: type) -> None:
        """A raise at the k-th op the switch's entry or exit dispatches (inside the native table's
        puts and recomputes, or a Python step's): entry rolls back (or poisons, where the fault hit
        a fused op that may have written part of its buffers); exit restores or poisons; the
        exception propagates as itself."""
        if self._rebuilt_if_poisoned(data):
            return
        entering = self.switch is None
        cm = self.state.switch("draft", data.draw(st.sampled_from(self.phases), label="phase")) if entering \
            else self.switch
        assert cm is not None
        n_fired = len(self.fired)
        raised = None
        with fault_at_op(k, kind, self.fired, "op") as seen:
            try:
                cm.__enter__() if entering else cm.__exit__(None, None, None)
            except BaseException as exc:  # noqa: BLE001 - checked below
                raised = exc
        if not entering:
            self.switch = None
        if len(self.fired) == n_fired:  # fewer than k + 1 ops: a plain entry or exit
            assert raised is None, raised
            if entering:
                self.switch = cm
                self._check_inside()
            return
        at = seen[k]  # the ops after it are the undo's or restore's
        note(f"fault at op {k} of {'entry' if entering else 'exit'}: {at}")
        poisoned = self.state.poisoned is not None
        if entering:
            assert isinstance(raised, kind), f"entry fault at {at} surfaced as {raised!r}"
            assert self.state.active_phase is None, "a failed entry left the switch active"
            # an undo can put back everything but what a fused op wrote part of: only that poisons
            assert not poisoned or at.startswith("graphctl."), f"entry fault at {at} poisoned the state"
        else:
            assert isinstance(raised, (kind, CorruptedStateError)), f"exit fault surfaced as {raised!r}"
            assert poisoned or isinstance(raised, kind), "exit raised CorruptedStateError but the state is usable"
        if poisoned:
            self.fired.append("inside")  # the invariants then check that a poisoned state refuses every use

    @precondition(lambda self: self.switch is not None and not self.faults)
    @rule()
    def exit_with_fault_inside_the_restore(self) -> None:
        """The fused restore raises after writing half its buffers: the state is poisoned."""
        cm, self.switch = self.switch, None
        assert cm is not None  # the precondition
        n_fired = len(self.fired)
        with partial_op("copy_", self.fired, "inside"):
            try:
                cm.__exit__(None, None, None)
            except CorruptedStateError:
                assert "inside" in self.fired[n_fired:], "CorruptedStateError without a fault"
                return
        assert len(self.fired) == n_fired, "an in-op fault fired but exit reported success"

    @precondition(lambda self: not self.faults)
    @rule(data=st.data())
    def reenter_from_a_user_callable(self, data: Any) -> None:
        if self._rebuilt_if_poisoned(data):
            return
        """A switch, write, pad or check issued from inside a Recompute fn or a CopyInPlace
        source is refused (NestedSwitchError) and changes nothing."""
        attempts: list[tuple[str, BaseException | None]] = []
        target = self.names[0]

        def reenter(label: str) -> None:
            for what, call in (("switch", lambda: self.state.switch("draft", "eager").__enter__()),
                               ("write", lambda: self.state.write(target, getattr(self.case.obj, target).clone())),
                               ("pad", lambda: self.state.pad({"seq": 0})), ("check", self.state.check)):
                try:
                    call()
                except NestedSwitchError as exc:
                    attempts.append((what, exc))
                    assert label in str(exc), f"the refusal does not name the callable: {exc}"
                else:
                    attempts.append((what, None))

        derived = list(self.plan.order)
        with seams.hooks(self.state, user=reenter):
            if self.switch is None and derived:
                # a write to an input of a derived buffer runs its Recompute fn
                name = next(
                    (n for n in self.names if self.plan.dependents[n] and not self.plan.buffers[n].derive), None
                )
                if name is None:
                    return
                value = self.case.value(name)
                self.state.write(name, value)
                self._model_write(name, value)
            elif self.switch is None:
                return
            else:
                self._state_check()
        bad = [w for w, e in attempts if e is None]
        assert not bad, f"re-entrant {bad} from a user callable were accepted"

    @precondition(lambda self: self.switch is not None and self.state.poisoned is None)
    @rule()
    def second_thread(self) -> None:
        """While this thread's switch owns the state, another thread's switch, write and pad
        get ConcurrentUseError and change nothing."""
        before = {n: _bytes(getattr(self.case.obj, n)) for n in self.names}
        target = next((n for n in self.names if not self.plan.buffers[n].derive), self.names[0])
        seen: list[BaseException | None] = []

        def other() -> None:
            for call in (lambda: self.state.switch("draft", "eager").__enter__(),
                         lambda: self.state.write(target, getattr(self.case.obj, target).clone()),
                         lambda: self.state.pad({"seq": 0})):
                try:
                    call()
                    seen.append(None)
                except BaseException as exc:  # noqa: BLE001 - checked below
                    seen.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        assert all(isinstance(e, ConcurrentUseError) for e in seen) and len(seen) == 3, seen
        for n in self.names:
            assert torch.equal(before[n], _bytes(getattr(self.case.obj, n))), f"another thread changed {n}"

    @precondition(lambda self: self.state.poisoned is not None)
    @rule(data=st.data())
    def rebuild(self, data: Any) -> None:
        self._start(self.draw_case(data))

    # ----------------------------------------------------------------------- invariants

    @invariant()
    def poisoned_iff_restore_failed(self) -> None:
        assert (self.state.poisoned is not None) == self._expect_poisoned(), (self.state.poisoned, self.fired)

    @invariant()
    def poisoned_state_refuses(self) -> None:
        if self.state.poisoned is None:
            return
        for use in (lambda: self.state.switch("draft", "eager").__enter__(),
                    lambda: self.state.write(self.names[0], getattr(self.case.obj, self.names[0]).clone()),
                    self.state.check):
            try:
                use()
            except CorruptedStateError:
                continue
            raise AssertionError("a poisoned state accepted a use")

    @invariant()
    def outside_matches_model(self) -> None:
        if self.switch is not None or self.state.poisoned is not None:
            return
        for n in self.names:
            live = getattr(self.case.obj, n)
            assert live is self.bindings[n], f"{n} not rebound to its original"
            if self.plan.buffers[n].stable:  # scratch: never snapshotted, so its contents are free
                continue
            assert torch.equal(_bytes(live), _bytes(self.model[n])), f"{n} differs from the model"
        for n in self.plan.objects:
            assert getattr(self.case.obj, n) is self.bindings[n], f"object {n} not restored"
        for n, was in self.deep.items():
            assert torch.equal(_bytes(self.state.tensor(n)), was), f"{n} (declared below an object) was written"
        for d in self.plan.buffers.values():
            for alias in d.aliases if d.name in self.bindings else ():
                v = getattr(self.case.obj, alias)
                assert v.data_ptr() >= self.bindings[d.name].data_ptr() and \
                    v.untyped_storage().data_ptr() == self.bindings[d.name].untyped_storage().data_ptr(), alias
        self._derived_consistent()
        self._state_check()

    @invariant()
    def addresses_unchanged(self) -> None:
        assert self.state.addresses() == self.manifest

"""The swap/restore state machine with capture and replay rules (:class:`GraphMachine`).

On top of :class:`~graphctl.testing.machine.SwitchMachine`'s rules, it captures a forward that
reads every device buffer of the random backend (in the target segment, and again through
the swapped attributes inside ``state.switch("draft")``) with ``@graphed``, and replays it
between writes and switches. Each replay is compared with the eager forward on the same state
(outputs poisoned before the replay, cloned after), and the machine's invariants (every
buffer bitwise what the model says, bindings and addresses unchanged) hold after capture and
replay too. Ctrl-C is delivered at a drawn line of graphctl's state and graphs layers during
``capture_all`` and during a replay (``graphctl.testing.interrupts``): afterwards the runner holds
every bucket or none, and the invariants hold. A ``replay``-phase switch wrapped around a replay
(whose graph recorded a ``capture`` switch) restores what it snapshotted. Set
``backend = "cuda"`` and draw CUDA cases to run it on real graphs."""
from __future__ import annotations

import os
from typing import Any

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from graphctl.graphs import GraphRunner
from graphctl.testing.interrupts import call_interrupted
from graphctl.testing.machine import SwitchMachine

__all__ = ["GraphMachine"]

_BUCKETS = (1, 2, 4)
_LAYERS = (os.path.join("graphctl", "state") + os.sep, os.path.join("graphctl", "graphs") + os.sep)


class GraphMachine(SwitchMachine):
    backend = "emulated"

    def _start(self, case: Any) -> None:
        super()._start(case)
        self.runner: GraphRunner | None = None

    def _forward(self, x: torch.Tensor, obj: Any) -> torch.Tensor:
        # Each segment reads only what the spec declares it reads: a target read of a buffer
        # refreshed before replay is the bug the declaration exists to refuse.
        bufs = self.plan.buffers
        # Stable scratch holds no state worth reading: its contents are free between calls
        names = [n for n in self.names if getattr(obj, n).device == x.device and not bufs[n].stable]
        acc = x * 1.0
        for n in names:
            if "target" in bufs[n].readers:
                acc = acc + getattr(obj, n).double().sum()
        with self.state.switch("draft"):
            for n in names:  # swapped attributes now name their twins
                if any(r.startswith("draft") for r in bufs[n].readers):
                    acc = acc * 0.5 + getattr(obj, n).double().sum()
        return acc

    def _quiet(self) -> bool:
        return self.switch is None and self.state.poisoned is None and not self.faults

    @property
    def live(self) -> GraphRunner:
        """The captured runner, in a rule whose precondition says there is one."""
        assert self.runner is not None
        return self.runner

    def _new_runner(self) -> tuple[GraphRunner, torch.Tensor]:
        runner = GraphRunner(self._forward, buckets=_BUCKETS, state=self.state, inputs=["x"],
                             backend=self.backend, pad_axes={}, warmup_iters=1, progress=False)
        return runner, torch.randn(3, 1, generator=self.case.gen, dtype=torch.float64).to(self.case.device)

    @precondition(lambda self: self._quiet() and self.runner is None)
    @rule()
    def capture(self) -> None:
        runner, x = self._new_runner()
        self.runner = runner.capture_all(x, self.case.obj)
        note(f"captured {runner.captured} on {self.backend}")

    @precondition(lambda self: self._quiet() and self.runner is None)
    @rule(at=st.integers(1, 3000))
    def capture_interrupted(self, at: int) -> None:
        """Ctrl-C at the ``at``-th line graphctl runs inside capture_all: every bucket or none."""
        runner, x = self._new_runner()
        out, where = call_interrupted(lambda: runner.capture_all(x, self.case.obj), at, _LAYERS)
        note(f"capture interrupted at {where or 'no line (it ran fewer)'}: {type(out).__name__}")
        if where:
            assert isinstance(out, KeyboardInterrupt), f"Ctrl-C at {where} surfaced as {out!r}"
        assert runner.captured in ((), _BUCKETS), f"a partial capture was kept: {runner.captured}"
        self.runner = runner if runner.captured else None

    @precondition(lambda self: self._quiet() and self.runner is not None)
    @rule(n=st.integers(1, _BUCKETS[-1]))
    def replay(self, n: int) -> None:
        x = torch.randn(n, 1, generator=self.case.gen, dtype=torch.float64).to(self.case.device)
        want = self._forward(x, self.case.obj).clone()
        for t in self.live.outputs(self.live.buckets.at(n)):
            t.fill_(float("nan"))
        got = self.live(x, self.case.obj).clone()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)

    @precondition(lambda self: self._quiet() and self.runner is not None)
    @rule(n=st.integers(1, _BUCKETS[-1]), at=st.integers(1, 400))
    def replay_interrupted(self, n: int, at: int) -> None:
        """Ctrl-C at the ``at``-th line graphctl runs inside a graphed call: like a CUDA graph,
        the replay either did not start or ran to its end; the state is as the model says."""
        x = torch.randn(n, 1, generator=self.case.gen, dtype=torch.float64).to(self.case.device)
        runner = self.live
        out, where = call_interrupted(lambda: runner(x, self.case.obj), at, _LAYERS)
        note(f"replay interrupted at {where or 'no line'}: {type(out).__name__}")
        if where:
            assert isinstance(out, KeyboardInterrupt), f"Ctrl-C at {where} surfaced as {out!r}"

    @precondition(lambda self: self._quiet() and self.runner is not None
                  and any(self.plan.buffers[n].mutable for n in self.names))
    @rule(b=st.sampled_from(_BUCKETS))
    def replay_inside_a_replay_switch(self, b: int) -> None:
        """``graph.replay()`` wrapped in a ``replay``-phase switch (the user guide's low-level
        form), with a mutable buffer written inside it: on exit every buffer is what it was
        before the switch, although the graph's recorded switch snapshotted in between."""
        name = next(m for m in self.names if self.plan.buffers[m].mutable)
        with self.state.switch("draft", "replay"):
            self.state.write(name, self.case.value(name))
            self.live.graph(b).replay()

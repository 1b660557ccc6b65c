"""The swap/restore state machine with capture and replay rules (:class:`GraphMachine`).

On top of :class:`~graphctl.testing.machine.SwitchMachine`'s rules, it captures a forward that
reads every device buffer of the random backend (in the target segment, and again through
the swapped attributes inside ``state.switch("draft")``) with ``@graphed``, and replays it
between writes and switches. Each replay is compared with the eager forward on the same state
(outputs poisoned before the replay, cloned after), and the machine's invariants (every
buffer bitwise what the model says, bindings and addresses unchanged) hold after capture and
replay too. Set ``backend = "cuda"`` and draw CUDA cases to run it on real graphs."""
from __future__ import annotations

from typing import Any

import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from graphctl.graphs import GraphRunner
from graphctl.testing.machine import SwitchMachine

__all__ = ["GraphMachine"]

_BUCKETS = (1, 2, 4)


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

    @precondition(lambda self: self._quiet() and self.runner is None)
    @rule()
    def capture(self) -> None:
        dev = self.case.device
        self.runner = GraphRunner(self._forward, buckets=_BUCKETS, state=self.state, inputs=["x"],
                                  backend=self.backend, pad_axes={}, warmup_iters=1, progress=False)
        x = torch.randn(3, 1, generator=self.case.gen, dtype=torch.float64).to(dev)
        self.runner.capture_all(x, self.case.obj)
        note(f"captured {self.runner.captured} on {self.backend}")

    @precondition(lambda self: self._quiet() and self.runner is not None)
    @rule(n=st.integers(1, _BUCKETS[-1]))
    def replay(self, n: int) -> None:
        x = torch.randn(n, 1, generator=self.case.gen, dtype=torch.float64).to(self.case.device)
        want = self._forward(x, self.case.obj).clone()
        for t in self.runner.outputs(self.runner.buckets.pick(n)):
            t.fill_(float("nan"))
        got = self.runner(x, self.case.obj).clone()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)

"""Random state a forward draws from (issue 34): which generators, declared or not.

A generator is declared as an object entry of the spec (``spec.object("generator",
draft=Swap(twin="draft_generator"))``: the draft role may draw from its own stream); its bound
value is a ``torch.Generator``. The runner's guards (``state/snapshot.py``) save and restore the
state of every declared generator and of torch's default generators around every warmup, capture,
measure and verify run, so they never advance the caller's streams, and a CUDA capture registers
the CUDA ones with the graph (a replay then draws on from the generator's state at that time).

:class:`Draws` watches every random op of a tracked warmup (``findings/stream.py``): a draw from
a default generator or from a generator the spec does not declare is a :class:`RandomUse`, a
finding of the report (an undeclared generator is restored like a side effect and registered with
the graph too).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_flatten

from graphctl.graphs.findings.frames import user_frame
from graphctl.graphs.findings.record import Finding
from graphctl.graphs.findings.stream import Op, Track, Watcher

__all__ = ["Draws", "RandomUse", "random_use", "declared_generators", "same_generator"]

_SEEDED = torch.Tag.nondeterministic_seeded


@dataclasses.dataclass(frozen=True, slots=True)
class RandomUse(Finding):
    """A random op's draw from a generator the spec does not declare."""

    kind: ClassVar[str] = "random_state"
    generator: str  # "the default cpu generator", "an undeclared torch.Generator on cuda:0"
    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.generator}, drawn from by {self.op} at {self.where}"

    def line(self) -> str:
        return (f"random state: {self.generator}, drawn from by {self.op} at {self.where} (its state restored around "
                "warmups, capture and verify; replays advance it): declare a generator in the spec to give the "
                "graph's draws a stream of their own")


def declared_generators(state: Any) -> dict[str, torch.Generator]:
    """The declared object entries of ``state`` (a BoundState or None) bound to generators."""
    return {} if state is None else {n: v for n, v in state.bindings if isinstance(v, torch.Generator)}


def same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether ``a`` and ``b`` are one generator. The dispatcher hands a random op a fresh Python
    wrapper of the generator it was given, so identity and ``==`` cannot tell: equal states, and
    a reseed of ``a`` showing in ``b`` (``a``'s state is put back whatever happens)."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    before = a.get_state()
    if not torch.equal(before, b.get_state()):
        return False
    try:
        a.manual_seed((a.initial_seed() + 1) % 2**63)
        return not torch.equal(before, b.get_state())
    finally:
        a.set_state(before)


def random_use(func: Any, args: tuple, kwargs: dict, known: list[torch.Generator]
               ) -> tuple[Any, RandomUse, torch.Generator | None] | None:
    """For a random op drawing from a default generator or one not in ``known`` (the declared
    ones and those already found): ``(key, use, generator or None for a default one)``; None for
    any other op."""
    if _SEEDED not in func.tags:
        return None
    gen = kwargs.get("generator")
    if gen is None:
        gen = next((a for a in args if isinstance(a, torch.Generator)), None)
    if gen is not None:
        if any(same_generator(gen, k) for k in known):
            return None
        return ("undeclared", len(known)), RandomUse(f"an undeclared torch.Generator on {gen.device}",
                                                     func._schema.name, user_frame()), gen
    dev = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
    dev = torch.device(kwargs["device"]) if kwargs.get("device") is not None else dev or torch.device("cpu")
    return ("default", dev.type), RandomUse(f"the default {dev.type} generator", func._schema.name, user_frame()), None


class Draws(Watcher):
    """Every random op's draw from a default generator or an undeclared one, and each undeclared
    generator's state before its first draw (put back after the run, as a side effect is)."""

    stage = 0

    def __init__(self, track: Track) -> None:
        super().__init__(track)
        # key -> (what drew, the generator or None for a default one, its state before the first draw)
        self.random: dict[Any, tuple[RandomUse, torch.Generator | None, torch.Tensor | None]] = {}

    def before(self, op: Op) -> None:
        known = self.track.declared + [g for _, g, _ in self.random.values() if g is not None]
        r = random_use(op.func, op.args, op.kwargs, known)
        if r is not None and r[0] not in self.random:  # an undeclared stream: its state before its first draw
            self.random[r[0]] = (r[1], r[2], r[2].get_state() if r[2] is not None else None)

    def undo(self) -> None:
        for _, gen, st in self.random.values():
            if gen is not None and st is not None:
                gen.set_state(st)  # an undeclared stream too, as a side effect (guarded from now on: passes)

    def finish(self, ledger: Any) -> None:
        for (kind, at), (use, gen, st) in self.random.items():
            if gen is not None and st is not None:  # unknown to this run's watcher: new to the ledger too
                ledger.generators.append((gen, st))
                at = len(ledger.generators)
            ledger.random.setdefault((kind, at), use)
        self.random = {}


RandomUse.watcher = Draws

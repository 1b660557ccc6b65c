"""The one place what a runner's tracked warmups found is merged: the :class:`Ledger`.

Each bucket's first warmup is tracked (a bucket may reach state another does not: a cache per batch
size): :meth:`Ledger.track` builds one watcher per finding kind (``findings/__init__.py``, each
kind's ``watcher``), runs the forward under their op stream (``findings/stream.py``), undoes what
the run wrote (whatever happened), and merges what every watcher found, first finding wins. The
side-effect policy is applied here: ``"restore"`` (the default: the copies are kept and the runner
puts them back after every warmup, capture, measure and verify run), ``"error"`` (refused),
``"ignore"`` (left). A compiled forward's compiled warmups run unwatched (dynamo never meets a
dispatch mode): :meth:`digest` and :meth:`untracked` find what they alone wrote.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from graphctl.errors import CaptureError
from graphctl.graphs import findings
from graphctl.graphs.findings.journal import storage_bytes
from graphctl.graphs.findings.padding import PaddingHazard
from graphctl.graphs.findings.randomness import RandomUse
from graphctl.graphs.findings.reach import storage_key
from graphctl.graphs.findings.reads import Unreached
from graphctl.graphs.findings.regions import Published
from graphctl.graphs.findings.side_effects import SideEffect, no_path
from graphctl.graphs.findings.stream import OpStream, Track, Watcher
from graphctl.state.interrupts import drop_mode

__all__ = ["Ledger"]


class Ledger:
    """A runner's findings from its tracked warmups, the policy, the cap, and the live storages to
    snapshot (see the module docstring)."""

    def __init__(self, policy: str, cap: int | None) -> None:
        self.policy, self.cap = policy, cap
        self.found: dict[tuple[str, int], SideEffect] = {}
        self.tensors: list[torch.Tensor] = []  # whole-storage views of what policy "restore" snapshots
        self.typed: dict[tuple[str, int], torch.Tensor] = {}  # key -> the tensor at the effect's path (verify)
        self.hazards: dict[tuple[str, str], PaddingHazard] = {}  # (input, target) -> the first write seen
        self.used: set[tuple[str, int]] = set()  # storages the tracked warmups' ops touched
        self.external: dict[tuple[str, int], Unreached] = {}  # read before any op made them (findings/reads.py)
        self.unreached: tuple[Unreached, ...] = ()  # those no path leads to (set after the passes)
        self.declared: list[torch.Generator] = []  # the state's declared generators (findings/randomness.py)
        self.random: dict[Any, RandomUse] = {}  # draws from default or undeclared generators, first seen
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []  # undeclared ones, state before
        self.before: dict[tuple[str, int], weakref.ref] = {}  # the tensors behind ``external``, while they live
        self.published: list[Published] = []  # tensors eager regions kept to themselves that pieces read
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last run's new (live, copy) pairs

    @property
    def effects(self) -> tuple[SideEffect, ...]:
        return tuple(self.found.values())

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.found.values())

    def records(self) -> list[Any]:
        """Every finding found so far that a report lists (side effects without their policy)."""
        return [*self.hazards.values(), *self.unreached, *self.random.values(), *self.found.values()]

    def before_tensors(self) -> list[torch.Tensor]:
        """The tensors the tracked runs read that existed before them, while they live."""
        return [t for ref in self.before.values() if (t := ref()) is not None]

    def written(self) -> list[tuple[SideEffect, torch.Tensor]]:
        """Each restored side effect with the tensor at its path (what ``verify()`` compares)."""
        return [(self.found[k], t) for k, t in self.typed.items()]

    def later(self, watched: dict[tuple[str, int], tuple[str, torch.Tensor]]) -> dict:
        """What a bucket's later (lean) runs watch: the walked tensors, and the storages the
        tracked runs found existing before them (no path needed), while they live."""
        out = dict(watched)
        for k, ref in self.before.items():
            t = ref()
            if t is not None and k not in out and storage_key(t) == k:
                out[k] = (no_path(t), t)
        return out

    def track(self, run: Callable[[], Any], watched: dict, owned: set, sync: Callable[[], None],
              padded: dict[tuple[str, int], str] | None = None, lean: bool = False,
              journaled: dict[tuple[str, int], torch.Tensor] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run ``run`` (one eager warmup) under every kind's watcher (only the lean ones when
        ``lean``), undo what it wrote (whatever happened), merge what they found (the policy applied
        to new side effects), and hand back ``(live, copy)`` pairs of the new tensors to snapshot:
        the watcher's copies, so nothing is cloned twice."""
        track = Track(self.later(watched) if lean else watched, owned | set(self.found),
                      None if lean else dict(padded or {}), self.declared + [g for g, _ in self.generators],
                      journaled or {})
        watchers: list[Watcher] = [k.watcher(track) for k in findings.KINDS
                                   if k.watcher is not None and (k.watcher.lean or not lean)]
        stream = OpStream(watchers, lean)
        try:
            with contextlib.ExitStack() as hold:
                for w in watchers:
                    hold.enter_context(w.installed())
                with stream:
                    run()
        finally:
            drop_mode(stream)  # an interrupt at the with-statement's exit skips its __exit__
            sync()
            for w in watchers:
                w.undo()  # the caller's state as it was, whatever happened
            sync()
        self._pairs = []
        for w in watchers:
            w.finish(self)
        pairs, self._pairs = self._pairs, []
        return pairs if self.policy != "ignore" else []

    def admit(self, new: dict[tuple[str, int], SideEffect], pairs: list[tuple[torch.Tensor, torch.Tensor]],
              hit: dict[tuple[str, int], torch.Tensor]) -> None:
        """A run's side effects: the policy applied to the new ones (raising under "error" or past
        the cap), their copies kept to snapshot (``restore``) and the tensors verify compares."""
        new = {k: e for k, e in new.items() if k not in self.found}
        self._admit(new)
        if self.policy != "ignore":
            self.tensors += [live for live, _ in pairs]
            self.typed.update({k: hit[k] for k in new})
            self._pairs += pairs

    def _admit(self, new: dict[tuple[str, int], SideEffect]) -> None:
        if new and self.policy != "ignore":
            effects = (*self.found.values(), *new.values())
            listing = "; ".join(map(str, effects))
            total = sum(e.nbytes for e in effects)
            if self.policy == "error":
                raise CaptureError("the forward writes state graphctl does not own", buffer=effects[0].path,
                                   expected="no writes outside static inputs, outputs and declared buffers",
                                   found=listing, fix="declare them in a StateSpec (mutable=True), or pass "
                                                      "side_effects='restore' to have graphctl undo them")
            if self.cap is not None and total > self.cap:
                raise CaptureError("side effects exceed the snapshot cap", buffer=effects[0].path,
                                   expected=f"at most {self.cap:,} B of snapshots", found=f"{total:,} B: {listing}",
                                   fix="raise max_side_effect_bytes, declare the state in a StateSpec, or pass "
                                       "side_effects='ignore' and reset it yourself")
        self.found.update(new)

    def digest(self, watched: dict[tuple[str, int], tuple[str, torch.Tensor]]) -> dict:
        """A digest per watched storage not yet found: what :meth:`untracked` compares after
        runs no watcher could see (a compiled forward's compiled warmups)."""
        out = {}
        with torch.no_grad():
            for k, (path, t) in self.later(watched).items():
                if k not in self.found:
                    out[k] = (path, t, _digest(t))
        return out

    def untracked(self, before: dict) -> list[SideEffect]:
        """Storages whose digest moved since ``before``: written by a run no watcher saw, so
        never restored. Raises under "error"; recorded (and returned, to be logged) otherwise."""
        new = {}
        with torch.no_grad():
            for k, (path, t, d) in before.items():
                if k not in self.found and not torch.equal(_digest(t), d):
                    new[k] = SideEffect(path, "(a compiled run: untracked, cannot restore)", "-",
                                        t.untyped_storage().nbytes())
        self._admit(new)
        return list(new.values())


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Three int64 sums over a storage's words: a change that keeps all three is contrived."""
    b = storage_bytes(t)
    n = b.numel() // 8 * 8
    w = b[:n].view(torch.int64)
    return torch.stack((w.sum(), w[1::3].sum(), b[n:].to(torch.int64).sum()))

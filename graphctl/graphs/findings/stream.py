"""Side effects of a forward on state graphctl was never told about, found and undone.

Model code graphctl did not write keeps state of its own: a Hugging Face ``StaticCache`` layer
advances a device-side ``cumulative_length`` and writes K/V with ``index_copy_`` at it. Every
warmup and capture run of such a forward moves the caller's cache, so the first replay starts
late, on garbage. No spec declares those tensors, and users should not have to.

:func:`reachable` walks what a forward can reach (its arguments, a bound method's ``self``, the
closure cells and the globals its code names, ``params``) and names every tensor by its path
(``args[1].layers[0].keys``, ``model.embed_tokens.weight``). :class:`WriteTracker` runs each
bucket's first eager warmup under a ``TorchDispatchMode``: every in-place or ``out=`` write into
the storage of such a tensor is a side effect, recorded with the op and the user's file:line,
and the storage is copied *before* the first write (copy on first write), so the warmup itself
can be undone. The :class:`Ledger` applies the policy: ``"restore"`` keeps those copies (one
per storage) and the runner puts them back after every warmup, capture, measure and verify
run; ``"error"`` refuses them; ``"ignore"`` leaves them. Whole storages, not the rows an
``index_copy_`` touched: a replay writes where device data says, which the host cannot see.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphctl.errors import CaptureError
from graphctl.graphs.capture import pieces
from graphctl.graphs.findings.frames import user_frame
from graphctl.graphs.findings.journal import Journal, arguments, fresh_results, op_tensors, storage_bytes
from graphctl.graphs.findings.randomness import RandomUse, random_use
from graphctl.graphs.findings.reach import storage_key
from graphctl.state.interrupts import drop_mode

__all__ = ["Ledger", "PaddingHazard", "SideEffect", "Unreached", "WriteTracker", "storage_bytes", "storage_key"]



@dataclasses.dataclass(frozen=True)
class SideEffect:
    """One tensor the forward wrote that graphctl does not own."""

    path: str  # where graphctl reached it, e.g. "args[1].layers[0].cumulative_length"
    op: str  # the first op that wrote it, e.g. "aten::index_copy_"
    where: str  # the user's file:line of that op
    nbytes: int

    def __str__(self) -> str:
        return f"{self.path} ({self.nbytes:,} B): {self.op} at {self.where}"


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of the arguments it writes


def _written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    where = _WRITES.get(func)
    if where is None:  # once per op: most ops write nothing, and then cost one dict lookup a call
        where = _WRITES[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write)
    out: list[torch.Tensor] = []
    for i, name in where:
        v = args[i] if i < len(args) else kwargs.get(name)
        out += op_tensors(v)
    return out


def no_path(t: torch.Tensor) -> str:
    """How a side effect on a tensor no walked path leads to is named."""
    return f"(no path) a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)} on {t.device}"


def _integral(t: torch.Tensor) -> bool:
    """Indices are integers: taint follows integer tensors only (a float activation computed from
    token ids says nothing about which slot a write lands in)."""
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


@dataclasses.dataclass(frozen=True)
class PaddingHazard:
    """Padded rows of a static input become the index of a write into state that outlives the
    call: the replay's padded lanes write there (a live request's slot, when the pad is a valid
    index) where eager writes nothing."""

    input: str
    op: str
    where: str
    target: str

    def __str__(self) -> str:
        return (f"padded rows of input '{self.input}' index {self.op} into {self.target} at {self.where}: padded "
                f"lanes write there; pad with a sentinel the write skips (Pad.fill(-1)) or a scratch slot")


@dataclasses.dataclass(frozen=True, slots=True)
class Unreached:
    """A tensor the forward read that existed before it ran, yet no path graphctl walks leads
    to it (a ``__slots__`` object, a C++ holder, a function's return value): the replay reads
    its capture-time storage and nothing checks that it is still the one the caller means."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    op: str  # the first op that read it
    where: str  # user file:line of that op

    def __str__(self) -> str:
        return (f"a {self.dtype} tensor of shape {list(self.shape)} on {self.device}, read by {self.op} at "
                f"{self.where}: reached by no path graphctl checks (declare it, pass it as an argument, or keep it "
                f"on an object the forward reaches)")


_FRESH = {"aten::lift_fresh", "aten::lift_fresh_copy"}  # torch.tensor(data) inside the forward: made there


class WriteTracker(TorchDispatchMode):
    """Record the writes of one eager run into the storages of ``watched`` (key -> (path,
    tensor)) and of tensors that existed before the run (found by it: read before any op made
    them, reached or not), saving each one's contents before its first write. ``exclude`` holds
    storage keys graphctl owns (declared buffers, static inputs, arenas): never side effects.

    ``lean``: a later warmup of a bucket. Only writes into ``watched`` are checked (pass what the
    first run found existing beforehand there too); no padding taint, no reads, no op outputs
    followed, so the run costs a dict lookup per op that writes nothing."""

    def __init__(self, watched: dict[tuple[str, int], tuple[str, torch.Tensor]], exclude: set[tuple[str, int]],
                 padded: dict[tuple[str, int], str] | None = None, lean: bool = False,
                 declared: list[torch.Generator] | None = None,
                 journaled: dict[tuple[str, int], torch.Tensor] | None = None) -> None:
        super().__init__()
        # declared lasting state (Persistent buffers) undone by the rows written (graphs/findings/journal.py)
        self.journal = Journal(journaled) if journaled else None
        self.declared = declared  # the declared generators (None: random ops are not looked at)
        # key -> (what drew, the generator or None for a default one, its state before the first draw)
        self.random: dict[Any, tuple[RandomUse, torch.Generator | None, torch.Tensor | None]] = {}
        self.watched = {k: v for k, v in watched.items() if k not in exclude}
        self.exclude = exclude
        self.lean = lean
        self.found: dict[tuple[str, int], SideEffect] = {}
        self.saved: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (live, copy before)
        self.hit: dict[tuple[str, int], torch.Tensor] = {}  # key -> the tensor written (what verify compares)
        # storages whose padded rows hold valid indices (static inputs padded with one), and what
        # was computed from them: an index of a write into state that outlives the call is a hazard
        self.tainted: dict[tuple[str, int], str] = dict(padded or {}) if not lean else {}
        self.hazards: dict[tuple[str, str], PaddingHazard] = {}
        self._alive: list[torch.Tensor] = []  # tainted results kept alive: a freed address reused is no taint
        self.used: set[tuple[str, int]] = set()  # every storage an op read or wrote (graphs/replay/rebinding.py)
        self.born: set[tuple[str, int]] = set()  # storages an op of this run produced
        self.external: dict[tuple[str, int], Unreached] = {}  # read before any op produced them
        self.before: dict[tuple[str, int], torch.Tensor] = {}  # the tensors behind ``external``
        # eager regions' boundaries (graphs/capture/pieces.py): a tensor a region made, kept and a piece read
        self.boundaries = pieces.Boundaries() if not lean else None

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.lean:
            if self.watched or self.journal is not None:
                for t in _written(func, args, kwargs):
                    key = storage_key(t)
                    if self.journal is not None and key in self.journal.storages:
                        self.journal.record(func, args, kwargs, t, key)
                    elif key in self.watched and key not in self.found:
                        self._save(key, self.watched[key][0], self.watched[key][1], func)
            return func(*args, **kwargs)
        name = func._schema.name
        own = name.startswith("graphctl::")
        if self.declared is not None:
            known = self.declared + [g for _, g, _ in self.random.values() if g is not None]
            r = random_use(func, args, kwargs, known)
            if r is not None and r[0] not in self.random:  # an undeclared stream: its state before its first draw
                self.random[r[0]] = (r[1], r[2], r[2].get_state() if r[2] is not None else None)
        for t in op_tensors(args, kwargs):
            if t.device.type == "meta":
                continue
            key = storage_key(t)
            self.used.add(key)
            # a 0-dim CPU tensor is a wrapped Python number (or a scalar the graph bakes by value); graphctl's
            # own switch ops read what the state resolved itself (declared buffers, copy sources, arenas)
            if key not in self.born and key not in self.external and name not in _FRESH and not own and \
                    not (t.dim() == 0 and t.device.type == "cpu") and t.untyped_storage().nbytes():
                self.external[key] = Unreached(tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device),
                                               name, user_frame())
                self.before[key] = t
        for t in _written(func, args, kwargs):
            key = storage_key(t)
            if self.journal is not None and key in self.journal.storages:
                self.journal.record(func, args, kwargs, t, key)
                continue
            hit = self.watched.get(key)
            if hit is None and (key not in self.external or key in self.exclude):
                continue  # a temporary of this run, or graphctl's own
            if key not in self.found:
                self._save(key, hit[0] if hit is not None else no_path(t), hit[1] if hit is not None else t, func)
            if self.tainted:
                self._check_index(func, args, kwargs, self.found[key].path)
        out = func(*args, **kwargs)
        made = [t for _, t in fresh_results(func, out)]
        for t in made:
            key = storage_key(t)
            self.born.add(key)
            self.external.pop(key, None)  # an address freed and handed out again: a new storage
            self.before.pop(key, None)
        if self.boundaries is not None and (self.boundaries.depth or self.boundaries.born):
            self.boundaries.op(name, op_tensors(args, kwargs), made, user_frame)
        if self.tainted:  # integer results computed from a padded input carry its padded rows on
            src = next((self.tainted[k] for t in op_tensors(args, kwargs)
                        if _integral(t) and (k := storage_key(t)) in self.tainted), None)
            if src is not None:
                for t in op_tensors(out):
                    if _integral(t) and t.untyped_storage().nbytes():
                        self.tainted.setdefault(storage_key(t), src)
                        self._alive.append(t)
        return out

    def _save(self, key: tuple[str, int], path: str, live: torch.Tensor, func: Any) -> None:
        whole = storage_bytes(live)  # the whole storage: views of it are restored too
        with torch.no_grad():
            self.saved[key] = (whole, whole.clone())
        self.hit[key] = live
        self.found[key] = SideEffect(path, func._schema.name, user_frame(), whole.numel())

    def _check_index(self, func, args: tuple, kwargs: dict, target: str) -> None:
        given = arguments(func, args, kwargs)
        for v in (given.get("index"), given.get("indices")):
            for t in op_tensors(v):
                if (src := self.tainted.get(storage_key(t))) is not None:
                    self.hazards.setdefault((src, target), PaddingHazard(src, func._schema.name, user_frame(), target))

    def undo(self) -> None:
        """Put every written tensor back as it was before the run."""
        with torch.no_grad():
            for live, before in self.saved.values():
                live.copy_(before)
        if self.journal is not None:
            self.journal.undo()

    @property
    def effects(self) -> tuple[SideEffect, ...]:
        return tuple(self.found.values())


class Ledger:
    """A runner's side effects: the policy, the cap, what the tracked warmups found, and the
    live storages to snapshot. Each bucket's first warmup is tracked (a bucket may reach state
    another does not: a cache per batch size); effects accumulate, first finding wins."""

    def __init__(self, policy: str, cap: int | None) -> None:
        self.policy, self.cap = policy, cap
        self.found: dict[tuple[str, int], SideEffect] = {}
        self.tensors: list[torch.Tensor] = []  # whole-storage views of what policy "restore" snapshots
        self.typed: dict[tuple[str, int], torch.Tensor] = {}  # key -> the tensor at the effect's path (verify)
        self.hazards: dict[tuple[str, str], PaddingHazard] = {}  # (input, target) -> the first write seen
        self.used: set[tuple[str, int]] = set()  # storages the tracked warmups' ops touched
        self.external: dict[tuple[str, int], Unreached] = {}  # read before produced (see WriteTracker)
        self.unreached: tuple[Unreached, ...] = ()  # those no path leads to (set after the passes)
        self.declared: list[torch.Generator] = []  # the state's declared generators (graphs/findings/randomness.py)
        self.random: dict[Any, RandomUse] = {}  # draws from default or undeclared generators, first seen
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []  # undeclared ones, state before
        self.before: dict[tuple[str, int], weakref.ref] = {}  # the tensors behind ``external``, while they live
        self.published: list[pieces.Published] = []  # tensors eager regions kept to themselves that pieces read

    @property
    def effects(self) -> tuple[SideEffect, ...]:
        return tuple(self.found.values())

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.found.values())

    def clear(self) -> None:
        self.found.clear()
        self.tensors = []
        self.typed.clear()
        self.hazards.clear()
        self.used.clear()
        self.external.clear()
        self.before.clear()
        self.unreached = ()
        self.random.clear()
        self.generators.clear()
        self.published.clear()

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
        """Run ``run`` (one eager warmup) under a :class:`WriteTracker`, undo what it wrote
        (whatever happened), apply the policy to what is new, and hand back ``(live, copy)``
        pairs of the new tensors to snapshot: the tracker's copies, so nothing is cloned twice."""
        tracker = WriteTracker(self.later(watched) if lean else watched, owned | set(self.found), padded, lean,
                               self.declared + [g for g, _ in self.generators], journaled)
        try:
            with tracker, pieces.listening(tracker.boundaries):
                run()
        finally:
            drop_mode(tracker)  # an interrupt at the with-statement's exit skips its __exit__
            sync()
            tracker.undo()  # the caller's state as it was, whatever happened
            for _, gen, st in tracker.random.values():
                if gen is not None and st is not None:
                    gen.set_state(st)  # an undeclared stream too, as a side effect (guarded from now on: passes)
            sync()
        for (kind, at), (use, gen, st) in tracker.random.items():
            if gen is not None and st is not None:  # unknown to this run's tracker: new to the ledger too
                self.generators.append((gen, st))
                at = len(self.generators)
            self.random.setdefault((kind, at), use)
        new, hit = dict(tracker.found), dict(tracker.hit)
        pairs = list(tracker.saved.values())
        for pair, h in tracker.hazards.items():
            self.hazards.setdefault(pair, h)
        self.used |= tracker.used
        for k, u in tracker.external.items():
            self.external.setdefault(k, u)
        for k, t in tracker.before.items():
            self.before.setdefault(k, weakref.ref(t))
        if tracker.boundaries is not None:
            self.published += tracker.boundaries.found.values()
            tracker.boundaries = None
        # GC is off during capture_all: drop the tracker's references now, or every tensor it
        # watched would look held by someone (the audit would call a freed temporary "live")
        for held in (tracker.tainted, tracker._alive, tracker.born, tracker.watched, tracker.saved, tracker.before,
                     tracker.hit):
            held.clear()
        self._admit(new)
        if self.policy != "ignore":
            self.tensors += [live for live, _ in pairs]
            self.typed.update({k: hit[k] for k in new})
        return pairs if self.policy != "ignore" else []

    def _admit(self, new: dict[tuple[str, int], SideEffect]) -> None:
        """Apply the policy to newly found effects (raising under "error" or past the cap)."""
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
        runs no tracker could watch (a compiled forward's compiled warmups)."""
        out = {}
        with torch.no_grad():
            for k, (path, t) in self.later(watched).items():
                if k not in self.found:
                    out[k] = (path, t, _digest(t))
        return out

    def untracked(self, before: dict) -> list[SideEffect]:
        """Storages whose digest moved since ``before``: written by a run no tracker watched, so
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

"""One op stream, many watchers: what a tracked warmup sees of the forward, op by op.

A tracked warmup runs the forward eagerly under :class:`OpStream`, a ``TorchDispatchMode``. For
every op it builds one :class:`Op` (its tensors, the ones it writes, after it runs the ones it
made) and hands it to each :class:`Watcher`, before the op runs and after. Each finding kind has
its watcher in its own module (``findings/__init__.py`` lists them); they share one
:class:`Track`: what the run was asked to watch, and what the watchers found that others use
(the storages read before the run made them, the side effects found so far). The ledger
(``findings/ledger.py``) builds the watchers, runs the stream and merges what they found.

A *lean* run (a bucket's later warmups) needs only the writes into storages already known: no
``Op`` is built, the side-effect watcher sees each written tensor alone (a dict lookup per op that
writes nothing).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphctl.graphs.findings.journal import fresh_results, op_tensors

__all__ = ["Op", "Track", "Watcher", "OpStream", "written"]

_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}  # op -> (position, name) of the arguments it writes


def written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes (in-place and ``out=`` arguments, by its schema)."""
    where = _WRITES.get(func)
    if where is None:  # once per op: most ops write nothing, and then cost one dict lookup a call
        where = _WRITES[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                      if a.alias_info is not None and a.alias_info.is_write)
    out: list[torch.Tensor] = []
    for i, name in where:
        v = args[i] if i < len(args) else kwargs.get(name)
        out += op_tensors(v)
    return out


class Op:
    """One op of the stream: what every watcher reads of it."""

    __slots__ = ("func", "name", "args", "kwargs", "own", "tensors", "writes", "out", "made")

    def __init__(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.name = func._schema.name
        self.own = self.name.startswith("graphctl::")  # graphctl's own switch ops
        self.tensors = op_tensors(args, kwargs)  # every tensor it reads or writes
        self.writes = written(func, args, kwargs)
        self.out: Any = None
        self.made: list[torch.Tensor] = []  # its results with storage of their own (after it ran)


@dataclasses.dataclass(eq=False)
class Track:
    """One tracked run: what it watches (given), and what its watchers found that others read."""

    watched: dict[tuple[str, int], tuple[str, torch.Tensor]]  # storage key -> (path, tensor): walked tensors
    exclude: set[tuple[str, int]]  # storages graphctl owns (declared buffers, static inputs, arenas)
    padded: dict[tuple[str, int], str] | None  # static inputs whose padded rows hold valid indices (None: lean)
    declared: list[torch.Generator]  # the state's declared generators and those found before
    journaled: dict[tuple[str, int], torch.Tensor]  # Persistent buffers, undone by the rows written
    used: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # every storage an op read or wrote
    born: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # storages an op of the run made
    external: dict[tuple[str, int], Any] = dataclasses.field(default_factory=dict)  # read before made: Unreached
    before: dict[tuple[str, int], torch.Tensor] = dataclasses.field(default_factory=dict)  # the tensors behind it
    found: dict[tuple[str, int], Any] = dataclasses.field(default_factory=dict)  # side effects found (SideEffect)

    @property
    def lean(self) -> bool:
        return self.padded is None


class Watcher:
    """What one finding kind's watcher does with the stream; ``stage`` orders the watchers (an
    earlier one's view of an op is there for a later one: the reads before the writes)."""

    stage: ClassVar[int] = 0
    lean: ClassVar[bool] = False  # it runs in lean runs too (then only ``write`` is called)

    def __init__(self, track: Track) -> None:
        self.track = track

    def before(self, op: Op) -> None:
        """Before the op runs (what it is about to read and write)."""

    def after(self, op: Op) -> None:
        """After it ran (its results)."""

    def write(self, func: Any, args: tuple, kwargs: dict, t: torch.Tensor) -> None:
        """A lean run's one call: ``t``, a tensor the op is about to write."""

    def undo(self) -> None:
        """Put back what the run changed that this watcher saved (whatever happened)."""

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """What it needs in place while the run goes (regions: the eager wrapper's listener)."""
        return contextlib.nullcontext()

    def finish(self, ledger: Any) -> None:
        """Merge what it found into the ledger (``findings/ledger.py``)."""


class OpStream(TorchDispatchMode):
    """The dispatch mode of a tracked run: every op to every watcher, in stage order."""

    def __init__(self, watchers: list[Watcher], lean: bool) -> None:
        super().__init__()
        self.watchers = sorted(watchers, key=lambda w: w.stage)
        self.lean = lean
        self.writers = [w for w in self.watchers if w.lean]

    def __torch_dispatch__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.lean:
            if self.writers:
                for t in written(func, args, kwargs):
                    for w in self.writers:
                        w.write(func, args, kwargs, t)
            return func(*args, **kwargs)
        op = Op(func, args, kwargs)
        for w in self.watchers:
            w.before(op)
        op.out = func(*args, **kwargs)
        op.made = [t for _, t in fresh_results(func, op.out)]
        for w in self.watchers:
            w.after(op)
        return op.out

"""A snapshot of tensors a run may change, put back after it: the graph runner's guard around
its warmup, capture, measure and verify runs (declared buffers, and the side effects of
``graphctl/graphs/findings/stream.py``). The copies are allocated once, at construction; taking and
restoring them go through :func:`graphctl.ops.copy_`, one fused call per device. Random state
too: the state of each generator it guards (the declared ones and torch's defaults, through
:meth:`Snapshot.of`) is saved with the tensors and put back with them, so a guarded run never
advances a stream the caller draws from.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from graphctl import ops

if TYPE_CHECKING:
    from graphctl.state.bound import BoundState

__all__ = ["Snapshot", "default_generators"]


class Snapshot:
    """Copies of ``tensors`` (and ``extra`` ones), taken on entry, put back on exit and on
    :meth:`restore`. ``tensors`` are a state's declared buffers; ``extra`` (and what
    :meth:`add`/:meth:`adopt` bring) are not, so ``restore(added_only=True)`` can put back side
    effects without undoing a bucket's padding of the state."""

    def __init__(self, tensors: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = (),
                 generators: Sequence[torch.Generator] = ()) -> None:
        self._live = list(tensors) + list(extra)
        self._saved = [t.clone() for t in self._live]
        self._declared = len(tensors)
        self._gens: list[torch.Generator] = []
        self._gstates: list[torch.Tensor] = []
        self.add_generators(generators)

    @classmethod
    def of(cls, state: BoundState | None, names: Callable[[BoundState], Sequence[str]],
           extra: Sequence[torch.Tensor] = (), generators: Sequence[torch.Generator] = ()) -> Snapshot:
        """A snapshot of ``names(state)`` (e.g. ``BoundState.mutable_names``) and ``extra``, and
        of the state's declared generators, torch's default ones and ``generators``."""
        gens = [v for _, v in state.bindings if isinstance(v, torch.Generator)] if state is not None else []
        return cls([state.tensor(n) for n in names(state)] if state is not None else [], extra,
                   gens + default_generators() + list(generators))

    def add_generators(self, generators: Sequence[torch.Generator]) -> None:
        """Guard these generators' states too, from their states now."""
        for g in generators:
            if all(g is not h for h in self._gens):
                self._gens.append(g)
                self._gstates.append(g.get_state())

    def add(self, tensors: Sequence[torch.Tensor]) -> None:
        """Guard ``tensors`` too, from their contents now."""
        self._live += list(tensors)
        self._saved += [t.clone() for t in tensors]

    def adopt(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Guard each ``(live, copy)`` with the copy given (already the contents to restore)."""
        self._live += [live for live, _ in pairs]
        self._saved += [copy for _, copy in pairs]

    def adopt_generators(self, pairs: Sequence[tuple[torch.Generator, torch.Tensor]]) -> None:
        """Guard each ``(generator, state)`` with the state given (what to restore it to)."""
        for g, st in pairs:
            if all(g is not h for h in self._gens):
                self._gens.append(g)
                self._gstates.append(st)

    def __enter__(self) -> Snapshot:
        _copy(self._saved, self._live)
        self._gstates = [g.get_state() for g in self._gens]
        return self

    def restore(self, added_only: bool = False) -> None:
        """Put everything back (random state included), or (``added_only``) only what is not a
        declared buffer (random state included: a run's draws are never the state's)."""
        start = self._declared if added_only else 0
        _copy(self._live[start:], self._saved[start:])
        for g, st in zip(self._gens, self._gstates):
            g.set_state(st)

    def __exit__(self, *exc: object) -> None:
        self.restore()


def default_generators() -> list[torch.Generator]:
    """torch's default generators: the CPU one, and each CUDA device's once CUDA is initialized."""
    gens = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gens += list(torch.cuda.default_generators)
    return gens


def _copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i] = src[i]``, one fused call per device (the buffers of a state may live on the
    GPU and, as pinned host mirrors, on the CPU)."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        if d.numel():
            pair = by_device.setdefault(d.device, ([], []))
            pair[0].append(d)
            pair[1].append(s)
    with torch.no_grad():
        for ds, ss in by_device.values():
            ops.copy_(ds, ss)

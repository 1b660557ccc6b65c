"""Padding hazards: padded rows of a static input that become the index of a write into state
that outlives the call. A replay's padded lanes write there (a live request's slot, when the pad
is a valid index) where eager writes nothing (SGLang #25529, rvllm #32, xLLM #1939).

:class:`Taint` follows, through the ops of the first tracked warmup of a bucket with padded rows,
the integer tensors computed from a static input padded with a valid index (a float activation
computed from token ids says nothing about which slot a write lands in), and flags a write into
a side-effect target (``findings/side_effects.py``) indexed by one of them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from graphctl.graphs.findings.frames import user_frame
from graphctl.graphs.findings.journal import arguments, op_tensors
from graphctl.graphs.findings.reach import storage_key
from graphctl.graphs.findings.record import Finding
from graphctl.graphs.findings.stream import Op, Track, Watcher

__all__ = ["PaddingHazard", "Taint"]


@dataclasses.dataclass(frozen=True)
class PaddingHazard(Finding):
    """A write into state that outlives the call, indexed by the padded rows of ``input``."""

    kind: ClassVar[str] = "padding_hazards"
    input: str
    op: str
    where: str
    target: str

    def __str__(self) -> str:
        return (f"padded rows of input '{self.input}' index {self.op} into {self.target} at {self.where}: padded "
                f"lanes write there; pad with a sentinel the write skips (Pad.fill(-1)) or a scratch slot")

    def line(self) -> str:
        return (f"padding hazard: padded rows of input '{self.input}' index {self.op} into {self.target} at "
                f"{self.where}: pad with a sentinel the write skips, or a scratch slot")


def _integral(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


class Taint(Watcher):
    """Integer storages computed from a padded input (``tainted``) and the writes they index."""

    stage = 3

    def __init__(self, track: Track) -> None:
        super().__init__(track)
        self.tainted: dict[tuple[str, int], str] = dict(track.padded or {})
        self.hazards: dict[tuple[str, str], PaddingHazard] = {}
        self._alive: list[torch.Tensor] = []  # tainted results kept alive: a freed address reused is no taint

    def before(self, op: Op) -> None:
        if not self.tainted:
            return
        for t in op.writes:
            effect = self.track.found.get(storage_key(t))
            if effect is None:
                continue
            given = arguments(op.func, op.args, op.kwargs)
            for v in (given.get("index"), given.get("indices")):
                for i in op_tensors(v):
                    if (src := self.tainted.get(storage_key(i))) is not None:
                        self.hazards.setdefault((src, effect.path), PaddingHazard(src, op.name, user_frame(),
                                                                                  effect.path))

    def after(self, op: Op) -> None:
        if not self.tainted:
            return
        src = next((self.tainted[k] for t in op.tensors if _integral(t) and (k := storage_key(t)) in self.tainted),
                   None)
        if src is not None:  # integer results computed from a padded input carry its padded rows on
            for t in op_tensors(op.out):
                if _integral(t) and t.untyped_storage().nbytes():
                    self.tainted.setdefault(storage_key(t), src)
                    self._alive.append(t)

    def finish(self, ledger: Any) -> None:
        for pair, h in self.hazards.items():
            ledger.hazards.setdefault(pair, h)
        self.tainted, self._alive = {}, []


PaddingHazard.watcher = Taint

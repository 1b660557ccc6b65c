"""Snapshot arenas and copy groups: the storage a switch snapshots into, allocated once at bind.

One flat, 64-byte-aligned allocation per device holds a slot for every buffer any phase
snapshots (pinned when it is host memory of a CUDA state). Every phase has slots of its own:
a ``replay`` or ``refresh`` switch is open while a graph that recorded a ``capture`` switch
replays, and an eager switch may wrap a replay too, so shared slots would let the inner
snapshot overwrite the outer one. The ``write`` family holds the undo copy of
``BoundState.write``/``pad``. A :class:`Group` is one phase's buffers on one device: one fused
op per direction."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphctl.state.plan import PHASES, Plan
from graphctl.state.spec import CopyInPlace

__all__ = ["Group", "allocate_arenas", "make_groups"]

_ALIGN = 64  # arena slots start on 64-byte boundaries (typed views and vector loads need it)


class Group:
    """The buffers of one phase on one device: one fused op per direction."""

    __slots__ = ("device", "names", "statics", "arenas", "copies")

    def __init__(self, device: torch.device, names: tuple[str, ...], statics: tuple[torch.Tensor, ...],
                 arenas: tuple[torch.Tensor, ...], copies: tuple[Any, ...]) -> None:
        self.device = device
        self.names: tuple[str, ...] = names
        self.statics: tuple[torch.Tensor, ...] = statics
        self.arenas: tuple[torch.Tensor, ...] = arenas
        self.copies: tuple[tuple[int, str, CopyInPlace], ...] = copies  # (index, buffer, action)


def allocate_arenas(plan: Plan, tensors: Mapping[str, torch.Tensor],
                    state_device: torch.device) -> dict[tuple[str, str], torch.Tensor]:
    """Snapshot slots keyed ``(family, name)``: one family per phase, plus ``write``."""
    names: list[tuple[str, str]] = []
    for p in PHASES:
        names.extend((p, n) for n in plan.phases[p].snapshot)
    names.extend(("write", n) for n, d in plan.buffers.items() if d.switched)
    by_dev: dict[torch.device, list[tuple[str, str]]] = {}
    for key in names:
        by_dev.setdefault(tensors[key[1]].device, []).append(key)
    arena: dict[tuple[str, str], torch.Tensor] = {}
    for dev, group in by_dev.items():
        offsets, total = [], 0
        for _, n in group:
            offsets.append(total)
            t = tensors[n]
            total += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
        pin = dev.type == "cpu" and state_device.type == "cuda"
        flat = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=dev, pin_memory=pin)
        for key, off in zip(group, offsets):
            t = tensors[key[1]]
            nbytes = t.numel() * t.element_size()
            arena[key] = flat[off:off + nbytes].view(t.dtype).view(t.shape)
    return arena


def make_groups(plan: Plan, phase: str, tensors: Mapping[str, torch.Tensor],
                arena: Mapping[tuple[str, str], torch.Tensor]) -> tuple[Group, ...]:
    """Per device, the buffers ``phase`` snapshots, their arena slots, and which are copy targets."""
    pp = plan.phases[phase]
    copies = {n: act for n, act in pp.copies}
    by_dev: dict[torch.device, list[str]] = {}
    for n in pp.snapshot:
        by_dev.setdefault(tensors[n].device, []).append(n)
    groups = []
    fam = phase
    for dev, names in by_dev.items():
        cps = tuple((i, n, copies[n]) for i, n in enumerate(names) if n in copies)
        groups.append(Group(dev, tuple(names), tuple(tensors[n] for n in names),
                            tuple(arena[fam, n] for n in names), cps))
    return tuple(groups)

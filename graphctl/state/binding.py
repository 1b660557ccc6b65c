"""What binding a live object to its compiled spec produced: one record, read by the state's helpers.

``bind(obj)`` (``state/bound.py``) checks the live object against its plan (``state/validate.py``)
and preallocates what every switch needs; all of it lands here, in a :class:`Binding`, filled once
while the state is made and only read after (its caches, filled on first use, aside). The helper
modules (``validate``, ``writes``, ``traced``, ``steps``, ``native``, ``chains``, ``recorded``)
read the state's binding through ``st.binding``; what the state's ownership and policy keep
changing stays on the state (``state/core.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphctl.state.arena import Group
from graphctl.state.plan import Plan
from graphctl.state.spec import BufferDecl

__all__ = ["Aliases", "Binding"]

# per base buffer: (alias, view of the original, the same view of the twin or None)
Aliases = dict[str, tuple[tuple[str, torch.Tensor, torch.Tensor | None], ...]]


@dataclasses.dataclass(eq=False)
class Binding:
    """One bound object: its plan, the tensors and objects bound at bind time, the snapshot
    arenas and copy groups, and the caches its checks fill on first use."""

    obj: Any
    plan: Plan
    dims: dict[str, int]  # shape symbol -> size (given, or fixed by the first buffer that names it)
    device: torch.device = torch.device("cpu")  # the device of the device buffers (host mirrors aside)
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # entry -> tensor (twins too)
    objects: dict[str, Any] = dataclasses.field(default_factory=dict)  # entry -> object (Swap'd managers)
    dim_source: dict[str, str] = dataclasses.field(default_factory=dict)  # shape symbol -> the entry that fixed it
    manifest: tuple[tuple[str, Any], ...] = ()  # (entry, tensor or object), tensors first
    index: dict[str, int] = dataclasses.field(default_factory=dict)  # entry -> its position in ``manifest``
    aliases: Aliases = dataclasses.field(default_factory=dict)
    arena: dict[tuple[str, str], torch.Tensor] = dataclasses.field(default_factory=dict)  # (family, entry) -> slot
    groups: dict[str, tuple[Group, ...]] = dataclasses.field(default_factory=dict)  # phase -> per-device copy groups
    padded: tuple[tuple[str, BufferDecl, torch.Tensor], ...] = ()  # buffers with a padding axis
    # caches the checks fill on first use
    expect: dict[str | None, tuple[tuple[str, Any], ...]] = dataclasses.field(default_factory=dict)
    expect_split: dict[str | None, Any] = dataclasses.field(default_factory=dict)  # (plain, paths) per phase
    write_groups: dict[Any, Any] = dataclasses.field(default_factory=dict)
    scratch: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

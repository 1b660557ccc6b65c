"""What the state layer's helper modules see of a bound state: one typed protocol.

``validate``, ``writes``, ``traced``, ``steps`` and ``native`` are functions over a bound state
(they hold no state of their own). They take it as :class:`StateCore`, so every field and method
they use is declared here with its type and checked by mypy, while ``bound.py`` keeps the one class
(a concrete type here would close an import cycle: ``bound`` imports each of them). The fields
are in two groups: what binding produced (a record, fixed after ``bind``) and what the state's
ownership and policy keep (changing with every switch).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from graphctl.errors import ConcurrentUseError, CorruptedStateError
from graphctl.state.arena import Group
from graphctl.state.plan import Plan
from graphctl.state.spec import BufferDecl, CopyInPlace
from graphctl.state.transaction import Step, Switch

__all__ = ["Aliases", "StateCore"]

# per base buffer: (alias, view of the original, the same view of the twin or None)
Aliases = dict[str, tuple[tuple[str, torch.Tensor, torch.Tensor | None], ...]]


class StateCore(Protocol):
    """A ``BoundState`` as its helper modules use it (see the module docstring)."""

    obj: Any
    plan: Plan
    dims: dict[str, int]
    device: torch.device
    # what binding produced
    _tensors: dict[str, torch.Tensor]  # entry -> the tensor bound at bind time (twins too)
    _objects: dict[str, Any]  # entry -> the object bound at bind time (Swap'd managers)
    _dim_source: dict[str, str]  # shape symbol -> the entry that fixed it
    _manifest: tuple[tuple[str, Any], ...]
    _index: dict[str, int]
    _aliases: Aliases
    _arena: dict[tuple[str, str], torch.Tensor]  # (family, entry) -> snapshot slot
    _groups: dict[str, tuple[Group, ...]]  # phase -> per-device copy groups
    _padded: tuple[tuple[str, BufferDecl, torch.Tensor], ...]
    _expect: dict[str | None, tuple[tuple[str, Any], ...]]
    _expect_split: dict[str | None, tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]]  # plain, paths
    _write_groups: dict[Any, Any]
    _scratch: dict[str, torch.Tensor]
    # ownership and policy
    _active: Switch | None
    _owner: int | None
    _traced: Any  # the TracedSwitch a compiled function is in (state/traced.py)

    def _recompute(self, name: str, out: torch.Tensor | None = None) -> None: ...
    def _poison(self, failures: list[tuple[str, BaseException]]) -> CorruptedStateError: ...
    def _hook(self, stage: str, step: str, when: str) -> None: ...
    def _source(self, act: CopyInPlace) -> Any: ...
    def _begin_use(self, what: str) -> None: ...
    def _busy(self, what: str) -> ConcurrentUseError: ...
    def _claim(self, sw: Switch) -> None: ...
    def _release(self, sw: Switch) -> None: ...
    def _owned(self, what: str) -> contextlib.AbstractContextManager[None]: ...
    def _call_user(self, label: str, fn: Callable[..., Any], *args: Any) -> Any: ...
    def _expected(self, phase: str | None) -> tuple[tuple[str, Any], ...]: ...
    def _check_bindings(self, entering: str | None = None) -> None: ...
    def _steps(self, phase: str) -> tuple[Step, ...]: ...

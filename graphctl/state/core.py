"""What the state layer's helper modules see of a bound state: one typed protocol.

``validate``, ``writes``, ``traced``, ``steps`` and ``native`` are functions over a bound state
(they hold no state of their own). They take it as :class:`StateCore`, so every field and method
they use is declared here with its type and checked by mypy, while ``bound.py`` keeps the one class
(a concrete type here would close an import cycle: ``bound`` imports each of them). What binding
produced is one record, ``binding`` (``state/binding.py``), fixed after ``bind``; the rest is what
the state's ownership and policy keep (changing with every switch) and the methods they call.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from graphctl.errors import ConcurrentUseError, CorruptedStateError
from graphctl.state.binding import Aliases, Binding
from graphctl.state.plan import Plan
from graphctl.state.spec import CopyInPlace
from graphctl.state.transaction import Step, Switch

__all__ = ["Aliases", "StateCore"]  # Aliases: the binding's, named here for the helpers' annotations


class StateCore(Protocol):
    """A ``BoundState`` as its helper modules use it (see the module docstring)."""

    obj: Any
    plan: Plan
    binding: Binding  # what binding produced (state/binding.py): read, never rebound
    @property
    def device(self) -> torch.device: ...
    @property
    def dims(self) -> dict[str, int]: ...
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

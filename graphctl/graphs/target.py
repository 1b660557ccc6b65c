"""What a capture is asked to capture: a forward, one example call with the largest batch, its
state, its static inputs and its parameters. ``graphctl capture`` loads one from a factory
(``cli/target.py``); a user's own script may build one and hand its fields to ``graphed``.
Fields are checked where the factory builds it: a wrong field found later is a traceback far
from its cause."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graphctl.errors import DeclarationError
from graphctl.graphs.capture.inputs import StaticInput

__all__ = ["CaptureTarget"]


@dataclasses.dataclass(frozen=True)
class CaptureTarget:
    """A forward to capture, its example call and what the runner needs to know of it."""

    forward: Callable[..., Any]
    example: tuple  # positional arguments of one call with ``max_batch`` batch items
    state: Any = None  # a BoundState (or a registered metadata object)
    inputs: Sequence[str | StaticInput] | None = None
    params: Any = None  # model tensors for the audit (nn.Module, mapping or iterable)
    name: str = ""
    variants: Mapping[str, Any] | None = None  # graphed(variants=...): a graph set per host-argument value
    prepare: Callable[..., None] | None = None  # graphed(prepare=...): the state for a batch of n (and variant values)

    def __post_init__(self) -> None:
        # checked here, where the factory builds it: a wrong field found later is a traceback far from its cause
        if not callable(self.forward):
            raise DeclarationError("CaptureTarget.forward is not callable", expected="the forward to capture",
                                   found=type(self.forward).__name__, fix="CaptureTarget(forward=model.step, ...)")
        if not isinstance(self.example, (tuple, list)):
            raise DeclarationError("CaptureTarget.example is not a tuple of arguments",
                                   expected="the positional arguments of one call, e.g. (ids, meta)",
                                   found=type(self.example).__name__, fix="example=(ids, meta), even for one argument")
        object.__setattr__(self, "example", tuple(self.example))
        if self.inputs is not None and (isinstance(self.inputs, str) or not all(
                isinstance(i, (str, StaticInput)) for i in self.inputs)):
            raise DeclarationError("CaptureTarget.inputs is not a list of input names or StaticInputs",
                                   expected="e.g. [StaticInput('input_ids', per_item=4)] or ['x']",
                                   found=repr(self.inputs)[:80], fix="inputs=[...] naming the forward's parameters")

    @property
    def per_item(self) -> int:
        """Rows of the first static input per batch item (``k + 1`` tokens for a draft step; with
        variants, a runner's own ``inputs[0].per_item`` says it per variant)."""
        first = StaticInput.of(self.inputs[0]) if self.inputs else None
        return first.per_item if first is not None else 1

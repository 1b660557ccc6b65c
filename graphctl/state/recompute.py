"""Derived buffers: :class:`Recompute` (``fn(out, *inputs)`` rebuilds a buffer from its inputs)
and :class:`OpCall` (a Recompute fn that is one graphctl op, launched by the native switch from
C++). Both are checked where their buffer is declared (``StateSpec.buffer``), so every error
names the buffer: a fn of the wrong arity, an OpCall that does not fit its op's schema or writes
anything but its output."""
from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch

from graphctl.errors import DeclarationError

__all__ = ["OpCall", "Recompute", "refuse_return"]


@dataclasses.dataclass(frozen=True, slots=True)
class Recompute:
    """A derived buffer: ``fn(out, *inputs)`` rebuilds ``out`` in place from the current
    bindings of ``inputs`` (buffer or object entries), on the device, without host sync or
    allocation. Run whenever an input is written, copied or swapped through graphctl."""

    inputs: tuple[str, ...]
    fn: Callable[..., None]

    def __post_init__(self) -> None:
        inputs = (self.inputs,) if isinstance(self.inputs, str) else tuple(self.inputs)
        object.__setattr__(self, "inputs", inputs)
        if not inputs or not all(isinstance(i, str) and i for i in inputs):
            raise DeclarationError("Recompute inputs must be entry names", expected="a non-empty list of str",
                                   found=self.inputs, fix="write Recompute(inputs=['seq_lens'], fn=...)")
        if len(set(inputs)) != len(inputs):
            raise DeclarationError("Recompute lists an input twice", expected="distinct names", found=inputs,
                                   fix="list each input once")

    def check(self, buffer: str) -> None:
        """Refuse a fn that cannot derive ``buffer`` (called where the buffer is declared, so the
        error names it): a callable of the wrong arity, an OpCall that does not fit its op."""
        if isinstance(self.fn, OpCall):
            self.fn.check(buffer, self.inputs)
            return
        if not callable(self.fn):
            raise DeclarationError("Recompute fn must be callable", buffer=buffer, expected="fn(out, *inputs)",
                                   found=type(self.fn).__name__, fix="pass a function")
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a builtin without a signature: checked when it runs
            return
        try:
            sig.bind(object(), *self.inputs)
        except TypeError:
            name = getattr(self.fn, "__qualname__", repr(self.fn))
            raise DeclarationError("Recompute fn cannot take (out, *inputs)", buffer=buffer,
                                   expected=f"fn(out, {', '.join(self.inputs)}): {1 + len(self.inputs)} positional "
                                            "arguments",
                                   found=f"{name}{sig}",
                                   fix="take the output buffer first, then one argument per input, in order") from None


_PLACEHOLDER = re.compile(r"(out|in(\d+))(\.numel)?")


@dataclasses.dataclass(frozen=True, slots=True)
class OpCall:
    """A ``Recompute`` fn that is one call of a graphctl op, so the native switch launches it from
    C++ with no Python in between. ``op`` names the op (``"token_to_request_"``, see
    ``graphctl.ops.RECOMPUTE_OPS``); in ``args``, ``"out"`` is the derived buffer, ``"in0"``,
    ``"in1"``... the recompute's inputs in order, ``"out.numel"``/``"in0.numel"`` their element
    counts (fixed at bind), anything else a constant (int, float, bool). Called from Python it runs
    ``graphctl.ops.<op>`` (the Python steps, capture, traces; the reference without the extension)::

        Recompute(["seq_lens"], OpCall("token_to_request_", ("out", "in0", "out.numel", -1)))
    """

    op: str
    args: tuple[Any, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))

    def check(self, buffer: str, inputs: tuple[str, ...]) -> None:
        """The call against its op's schema (``graphctl.ops.RECOMPUTE_OPS``): argument count and
        kinds, the one written argument ``"out"`` and no other, each placeholder an input the
        Recompute has. A mismatch would otherwise surface at the first native switch as a C++
        assertion, or write a declared input on every switch."""
        from graphctl.ops import RECOMPUTE_OPS

        def refuse(what: str, expected: Any, found: Any, fix: str) -> DeclarationError:
            return DeclarationError(what, buffer=buffer, expected=expected, found=found, fix=fix)

        schema = RECOMPUTE_OPS.get(self.op)
        if schema is None:
            raise refuse("OpCall names no graphctl recompute op", " / ".join(RECOMPUTE_OPS), repr(self.op),
                         "use one of those, or a plain Recompute fn")
        sig = f"{self.op}({', '.join(a.name + ('!' if a.writes else '') for a in schema)})"
        if len(self.args) != len(schema):
            raise refuse("OpCall passes the wrong number of arguments", f"{len(schema)}: {sig}",
                         f"{len(self.args)}: {self.args}", "pass one value per argument of the op")
        for a, spec in zip(self.args, schema):
            m = _PLACEHOLDER.fullmatch(a) if isinstance(a, str) else None
            if isinstance(a, str) and m is None:
                raise refuse("OpCall argument is neither a placeholder nor a constant",
                             '"out", "in0", "out.numel", "in0.numel"... or an int, float or bool', repr(a),
                             "reach tensors through the Recompute's inputs")
            if m is not None and m.group(2) is not None and int(m.group(2)) >= len(inputs):
                raise refuse("OpCall names an input the Recompute does not have",
                             f"in0..in{len(inputs) - 1} (inputs {list(inputs)})", a,
                             "list the input in Recompute(inputs=...)")
            if spec.kind == "tensor":
                want = "out" if spec.writes else "in0, in1..."
                ok = m is not None and m.group(3) is None and (m.group(1) == "out") == spec.writes
                if not ok:
                    what = ("OpCall writes something other than its output" if spec.writes or a == "out"
                            else "OpCall passes a non-tensor where the op reads a tensor")
                    raise refuse(what, f"{spec.name} = {want} in {sig}", repr(a),
                                 'the op writes "out" (the derived buffer) and only reads its inputs: a recompute '
                                 "never writes a declared input")
                continue
            if m is not None:  # only an element count ("in0.numel") stands for a number
                ok = m.group(3) is not None and spec.kind == "int"
            elif spec.kind == "bool":
                ok = isinstance(a, bool)
            elif spec.kind == "int":
                ok = isinstance(a, int) and not isinstance(a, bool)
            else:
                ok = isinstance(a, (int, float)) and not isinstance(a, bool)
            if not ok:
                raise refuse("OpCall argument does not fit the op's schema", f"{spec.name}: {spec.kind} in {sig}",
                             repr(a), f"pass an {spec.kind}" + (' or "out.numel" / "inN.numel"'
                                                                 if spec.kind == "int" else ""))

    def length_inputs(self, inputs: tuple[str, ...]) -> tuple[str, ...]:
        """The Recompute inputs the op reads as lengths (checked under ``GRAPHCTL_CHECK_LENGTHS``)."""
        from graphctl.ops import RECOMPUTE_OPS

        out = []
        for a, spec in zip(self.args, RECOMPUTE_OPS.get(self.op, ())):
            m = _PLACEHOLDER.fullmatch(a) if isinstance(a, str) else None
            if spec.lengths and m is not None and m.group(2) is not None:
                out.append(inputs[int(m.group(2))])
        return tuple(out)

    def bind(self, out: Any, inputs: tuple[Any, ...]) -> list[Any]:
        """The op's arguments with the placeholders replaced."""
        vals = []
        for a in self.args:
            m = _PLACEHOLDER.fullmatch(a) if isinstance(a, str) else None
            if m is None:
                vals.append(a)
                continue
            t = out if m.group(1) == "out" else inputs[int(m.group(2))]
            vals.append(t.numel() if m.group(3) else t)
        return vals

    def __call__(self, out: Any, *inputs: Any) -> None:
        from graphctl import ops

        getattr(ops, self.op)(*self.bind(out, inputs))


def refuse_return(buffer: str, out: Any, got: Any) -> None:
    """A Recompute fn that returns its result instead of writing ``out`` leaves the derived buffer
    stale (``fn=lambda out, lens: lens.cumsum(0)``): refused at its first call. Returning ``out``
    itself, a view of it (``out.copy_(...)``, ``out[:n].copy_(...)``) or nothing is fine."""
    if got is None or got is out or not isinstance(got, torch.Tensor) or torch.compiler.is_compiling():
        return
    if isinstance(out, torch.Tensor) and got.untyped_storage()._cdata == out.untyped_storage()._cdata:
        return  # a view of out: it wrote in place
    raise DeclarationError(
        "Recompute fn returned its result instead of writing it into out", buffer=buffer,
        expected="fn(out, *inputs) writes out in place and returns None (or out)",
        found=f"it returned a new {str(got.dtype).removeprefix('torch.')} tensor of shape {list(got.shape)}; "
              f"'{buffer}' was not written",
        fix="write into out: out.copy_(lens.cumsum(0)), or torch.cumsum(lens, 0, out=out)")

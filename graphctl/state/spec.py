"""Declarations: what a captured graph reads, and what the draft role does to each of it.

Everything here is a frozen value. A :class:`StateSpec` collects declarations for one
metadata family; ``extends=`` starts from another spec's entries. Local contradictions (an
axis without a padding policy, two actions that cannot both hold) are refused as soon as a
declaration is made; contradictions between entries (cycles, twins, readers) are refused when
the spec is compiled, which ``register`` does (see ``graphctl.state.plan``).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch

from graphctl.errors import DeclarationError
from graphctl.state.recompute import OpCall, Recompute

__all__ = ["AXES", "Pad", "Swap", "CopyInPlace", "Recompute", "OpCall", "Stable", "Persistent", "BufferDecl",
           "ObjectDecl", "StateSpec"]

AXES = ("seq", "token", "step")
DEFAULT_READERS = frozenset({"target", "draft"})
_SEGMENT = re.compile(r"^(target|draft)(\[\d+\])?$")


def is_draft_segment(seg: str) -> bool:
    return seg.startswith("draft")


@dataclasses.dataclass(frozen=True, slots=True)
class Pad:
    """Padding policy for the tail ``[n:extent]`` of an axis: ``zero``, ``fill(v)``,
    ``clamp(lo, hi)`` (tail values clamped into range, so stale indices stay in bounds),
    ``keep`` (tail left as is), ``edge`` (every padded row repeats the last live one: cumulative
    offsets such as ``cu_seqlens`` or ``query_start_loc`` whose padded requests are empty), or
    ``arange(step)`` (padded rows continue the last live one by ``step`` each: offsets of
    fixed-width padded requests). With no live row, ``edge`` pads with zero and ``arange`` counts
    from zero."""

    kind: str
    value: float | int | None = None
    lo: float | int | None = None
    hi: float | int | None = None
    step: float | int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("zero", "fill", "clamp", "keep", "edge", "arange"):
            raise DeclarationError("unknown padding policy", expected="zero, fill, clamp, keep, edge or arange",
                                   found=self.kind, fix="use Pad.zero(), Pad.fill(v), Pad.clamp(lo, hi), Pad.keep(), "
                                                        "Pad.edge() or Pad.arange(step)")
        if self.kind == "arange" and (self.step is None or isinstance(self.step, bool)
                                      or not isinstance(self.step, (int, float))):
            raise DeclarationError("Pad.arange needs a numeric step", expected="an int or float", found=self.step,
                                   fix="write Pad.arange(step), e.g. the fixed width of a padded request")
        if self.kind == "fill" and self.value is None:
            raise DeclarationError("Pad.fill needs a value", expected="a number", found=None,
                                   fix="write Pad.fill(v)")
        if self.kind == "clamp":
            if self.lo is None and self.hi is None:
                raise DeclarationError("Pad.clamp needs a bound", expected="lo and/or hi", found="neither",
                                       fix="write Pad.clamp(0) or Pad.clamp(lo, hi)")
            if self.lo is not None and self.hi is not None and self.lo > self.hi:
                raise DeclarationError("Pad.clamp bounds are inverted", expected="lo <= hi",
                                       found=f"lo={self.lo}, hi={self.hi}", fix="swap the bounds")

    @classmethod
    def zero(cls) -> Pad:
        return cls("zero")

    @classmethod
    def fill(cls, value: float | int) -> Pad:
        return cls("fill", value=value)

    @classmethod
    def clamp(cls, lo: float | int | None = None, hi: float | int | None = None) -> Pad:
        return cls("clamp", lo=lo, hi=hi)

    @classmethod
    def keep(cls) -> Pad:
        return cls("keep")

    @classmethod
    def edge(cls) -> Pad:
        return cls("edge")

    @classmethod
    def arange(cls, step: float | int) -> Pad:
        return cls("arange", step=step)

    def unfit(self, dtype: torch.dtype) -> str | None:
        """Why this policy's values cannot be stored in ``dtype`` (torch would wrap ``-3`` to
        ``253`` in ``uint8`` or raise halfway through a write), or None when they fit."""
        for label, v in (("fill value", self.value), ("clamp lo", self.lo), ("clamp hi", self.hi),
                         ("arange step", self.step)):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                if dtype != torch.bool and not isinstance(v, bool):
                    return f"{label} {v!r} of type {type(v).__name__}"
                continue
            if dtype == torch.bool:
                if label == "arange step":
                    return "an arange over bool"
                if v not in (0, 1):
                    return f"{label} {v!r} for bool"
            elif dtype.is_floating_point:
                if v == v and abs(v) != float("inf") and abs(v) > torch.finfo(dtype).max:
                    return f"{label} {v!r} outside [{torch.finfo(dtype).min}, {torch.finfo(dtype).max}]"
            elif not dtype.is_complex:
                info = torch.iinfo(dtype)
                if float(v) != int(v) if v == v and abs(v) != float("inf") else True:
                    return f"{label} {v!r} is not an integer"
                if not info.min <= int(v) <= info.max:
                    return f"{label} {v!r} outside [{info.min}, {info.max}]"
        return None

    def apply(self, tail: torch.Tensor, last: torch.Tensor | None = None, dim: int = 0) -> None:
        """Apply in place to ``tail`` (already narrowed to ``[n:extent]`` along ``dim``);
        ``last`` is the last live row (``[n-1:n]``), or None when nothing is live. Capturable."""
        if tail.numel() == 0 or self.kind == "keep":
            return
        if self.kind == "zero" or (self.kind == "edge" and last is None):
            tail.zero_()
        elif self.kind == "edge" and last is not None:
            tail.copy_(last.expand_as(tail))
        elif self.kind == "arange":
            step = self.step
            assert step is not None  # Pad.arange(step) sets it
            # in place, no temporary (a write inside a switch allocates nothing): step everywhere, a running sum
            # along dim gives (i + 1) * step, then shifted to start after the last live row (or at 0)
            tail.fill_(step)
            torch.cumsum(tail, dim, out=tail)
            if last is None:
                tail.sub_(step)
            else:
                tail.add_(last.expand_as(tail))
        elif self.kind == "fill":
            assert self.value is not None  # Pad.fill(value) sets it
            tail.fill_(self.value)
        else:
            tail.clamp_(min=self.lo, max=self.hi)


@dataclasses.dataclass(frozen=True, slots=True)
class Swap:
    """Rebind the attribute to the declared entry ``twin`` during ``eager`` and ``capture``;
    kernels recorded after the swap bake the twin's address. Restore rebinds the original."""

    twin: str

    def __post_init__(self) -> None:
        if not isinstance(self.twin, str) or not self.twin:
            raise DeclarationError("Swap twin must be an entry name", expected="a non-empty str",
                                   found=self.twin, fix="write Swap(twin='draft_<name>')")


Source = str | Callable[[Any], torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class CopyInPlace:
    """Write new contents into the same storage after snapshotting the old ones. ``source`` is
    an attribute name on the metadata object, or ``fn(obj) -> Tensor`` returning an existing
    tensor of the buffer's shape and dtype (it should not allocate)."""

    source: Source

    def __post_init__(self) -> None:
        if not (isinstance(self.source, str) and self.source) and not callable(self.source):
            raise DeclarationError("CopyInPlace source must be an attribute name or a callable",
                                   expected="str or fn(obj) -> Tensor", found=type(self.source).__name__,
                                   fix="write CopyInPlace(source='attr') or CopyInPlace(source=lambda m: m.x)")


@dataclasses.dataclass(frozen=True, slots=True)
class Stable:
    """Large scratch whose address must stay fixed but whose contents are never snapshotted
    (top-k scratch, radix buffers): audited, never cloned, never written by a switch."""


class Persistent:
    """Lasting state the forward itself writes, such as a model's KV-cache pools: a switch
    neither snapshots nor restores it (the draft's cache writes must stay), nothing of it is
    cloned per switch or write, yet its contents matter: warmups and capture are undone on it
    and verify compares it. Declaring it is what makes it graphctl's: audited by name, its
    address checked, never reported as a side effect of the forward."""


DraftAction = Swap | CopyInPlace | Stable | Persistent | None


@dataclasses.dataclass(frozen=True, slots=True)
class BufferDecl:
    """A tensor attribute read or written by address by a captured graph."""

    name: str
    shape: tuple[str | int, ...] | None = None
    dtype: torch.dtype | None = None
    axis: str | None = None
    axis_dim: int = 0
    pad: Pad | None = None
    readers: frozenset[str] = DEFAULT_READERS
    mutable: bool = False
    host: bool = False
    aliases: tuple[str, ...] = ()
    draft: DraftAction = None
    refresh: CopyInPlace | None = None
    derive: Recompute | None = None

    kind = "buffer"

    @property
    def stable(self) -> bool:
        return isinstance(self.draft, Stable)

    @property
    def persistent(self) -> bool:
        return isinstance(self.draft, Persistent)

    @property
    def switched(self) -> bool:
        """Snapshotted by switches and cloned by writes: every buffer but scratch and lasting state."""
        return not isinstance(self.draft, (Stable, Persistent))

    @property
    def padding(self) -> Pad:
        """``pad`` of a buffer with an axis (the plan refuses an axis without one)."""
        assert self.pad is not None, f"'{self.name}' has no padding policy"
        return self.pad

    @property
    def recompute(self) -> Recompute:
        """``derive`` of a derived buffer (callers hold a name from the plan's derived order)."""
        assert self.derive is not None, f"'{self.name}' is not derived"
        return self.derive


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectDecl:
    """A plain attribute (a KV-cache manager, a host scalar) that may be swapped or read."""

    name: str
    draft: Swap | None = None

    kind = "object"


Decl = BufferDecl | ObjectDecl
_D = TypeVar("_D", BufferDecl, ObjectDecl)


def _err(name: str, what: str, expected: Any, found: Any, fix: str) -> DeclarationError:
    return DeclarationError(what, buffer=name, expected=expected, found=found, fix=fix)


def _check_buffer(d: BufferDecl) -> None:
    n = d.name
    if d.axis is not None and d.axis not in AXES:
        raise _err(n, "unknown axis", "one of seq, token, step or None", d.axis, "pick a declared axis")
    if d.axis is not None and d.pad is None:
        raise _err(n, "a buffer with an axis needs a padding policy", "pad=Pad.zero()/fill/clamp/keep", None,
                   "declare what the tail [n:bucket] holds; Pad.keep() if it does not matter")
    if d.axis is None and d.pad is not None:
        raise _err(n, "a padding policy without an axis", "axis='seq'/'token'/'step'", None,
                   "declare the axis the policy pads, or drop pad=")
    if d.shape is not None:
        if not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in d.shape):
            raise _err(n, "shape entries must be dim names or ints", "tuple of str/int", d.shape,
                       "write shape=('S', 'B')")
        if d.axis is not None and not 0 <= d.axis_dim < len(d.shape):
            raise _err(n, "axis_dim is outside the declared shape", f"0 <= axis_dim < {len(d.shape)}",
                       d.axis_dim, "point axis_dim at the batch/token dimension")
    if d.dtype is not None and not isinstance(d.dtype, torch.dtype):
        raise _err(n, "dtype must be a torch.dtype", "torch.dtype", d.dtype, "write dtype=torch.int32")
    if not d.readers or not all(isinstance(r, str) and _SEGMENT.match(r) for r in d.readers):
        raise _err(n, "readers must name segments", "a non-empty set of 'target', 'draft' or 'draft[i]'",
                   sorted(map(str, d.readers)), "list the segments that read this buffer")
    if d.draft is not None and not isinstance(d.draft, (Swap, CopyInPlace, Stable, Persistent)):
        raise _err(n, "draft= takes Swap, CopyInPlace, Stable or Persistent", "Swap/CopyInPlace/Stable/Persistent",
                   type(d.draft).__name__, "wrap the twin or source in an action")
    if d.refresh is not None and not isinstance(d.refresh, CopyInPlace):
        raise _err(n, "refresh= takes CopyInPlace", "CopyInPlace", type(d.refresh).__name__,
                   "write refresh=CopyInPlace(source=...)")
    if d.derive is not None and not isinstance(d.derive, Recompute):
        raise _err(n, "derive= takes Recompute", "Recompute", type(d.derive).__name__,
                   "write derive=Recompute(inputs=[...], fn=...)")
    if d.derive is not None:
        d.derive.check(n)
    if d.derive is not None and (d.refresh is not None or isinstance(d.draft, CopyInPlace)):
        raise _err(n, "a derived buffer cannot also be copied in place", "derive= alone", "derive= and CopyInPlace",
                   "drop the CopyInPlace: a derived buffer's contents come from its inputs")
    if d.derive is not None and d.mutable:
        raise _err(n, "a derived buffer cannot be mutable", "mutable=False", "mutable=True",
                   "write its inputs instead; graphctl recomputes it")
    if isinstance(d.draft, Swap) and d.refresh is not None:
        raise _err(n, "a swapped buffer cannot also be refreshed", "Swap or refresh", "both",
                   f"declare refresh= on the twin '{d.draft.twin}', which is what the draft reads")
    if d.stable and (d.mutable or d.derive is not None or d.refresh is not None):
        raise _err(n, "a Stable buffer is never snapshotted, so it cannot be mutable, derived or refreshed",
                   "Stable() alone", "Stable() with mutable/derive/refresh",
                   "drop Stable() to have graphctl restore it, or drop the other action")
    if d.persistent and (d.mutable or d.derive is not None or d.refresh is not None or d.axis is not None):
        raise _err(n, "a Persistent buffer is the forward's own lasting state, never snapshotted or padded",
                   "Persistent() alone", "Persistent() with mutable/derive/refresh/axis",
                   "drop Persistent() to have graphctl switch it, or drop the other declaration")
    if len(set(d.aliases)) != len(d.aliases) or n in d.aliases:
        raise _err(n, "aliases must be distinct names other than the base", "distinct alias names", d.aliases,
                   "list each view attribute once")


class StateSpec:
    """The declarations of one metadata family.

    ``StateSpec("dsa", extends=trtllm_spec)`` starts from the parent's entries; redeclaring a
    parent entry needs ``override=True``. Once registered (or compiled) a spec is frozen.
    """

    def __init__(self, name: str, *, extends: StateSpec | None = None) -> None:
        if extends is not None and not isinstance(extends, StateSpec):
            raise DeclarationError("extends= takes a StateSpec", buffer=None, expected="StateSpec",
                                   found=type(extends).__name__, fix="pass the parent spec object")
        self.name = name
        self.parent = extends
        self._entries: dict[str, Decl] = dict(extends.entries) if extends is not None else {}
        self._own: set[str] = set()
        self._frozen = False
        self._plan: Any = None  # the Plan, compiled lazily by graphctl.state.plan.compile_spec

    @property
    def entries(self) -> Mapping[str, Decl]:
        return dict(self._entries)

    @property
    def frozen(self) -> bool:
        return self._frozen

    def _add(self, decl: _D, override: bool) -> _D:
        if self._frozen:
            raise DeclarationError(f"spec '{self.name}' is frozen (registered or compiled)", buffer=decl.name,
                                   expected="an unfrozen spec", found="frozen",
                                   fix=f"declare a new StateSpec(..., extends=<spec '{self.name}'>)")
        if decl.name in self._entries:
            inherited = decl.name not in self._own
            if not (override and inherited):
                raise DeclarationError(
                    "declared twice" if not inherited else "redeclares an entry of the parent spec",
                    buffer=decl.name, expected="one declaration per name",
                    found=f"a second declaration in spec '{self.name}'",
                    fix="pass override=True to replace a parent's entry" if inherited else "remove the duplicate")
        self._entries[decl.name] = decl
        self._own.add(decl.name)
        return decl

    def buffer(self, name: str, *, shape: Iterable[str | int] | None = None, dtype: torch.dtype | None = None,
               axis: str | None = None, axis_dim: int = 0, pad: Pad | None = None,
               readers: Iterable[str] = DEFAULT_READERS, mutable: bool = False, host: bool = False,
               aliases: Iterable[str] = (), draft: DraftAction = None, refresh: CopyInPlace | None = None,
               derive: Recompute | None = None, override: bool = False) -> BufferDecl:
        """Declare a tensor attribute. See docs/families.md for every field."""
        readers_set = frozenset([readers] if isinstance(readers, str) else readers)
        decl = BufferDecl(name=name, shape=tuple(shape) if shape is not None else None, dtype=dtype, axis=axis,
                          axis_dim=axis_dim, pad=pad, readers=readers_set, mutable=bool(mutable), host=bool(host),
                          aliases=tuple([aliases] if isinstance(aliases, str) else aliases),
                          draft=draft, refresh=refresh, derive=derive)
        _check_buffer(decl)
        return self._add(decl, override)

    def object(self, name: str, *, draft: Swap | None = None, override: bool = False) -> ObjectDecl:
        """Declare a plain attribute (a KV-cache manager, a host scalar)."""
        if draft is not None and not isinstance(draft, Swap):
            raise DeclarationError("an object entry can only be swapped", buffer=name, expected="draft=Swap(...)",
                                   found=type(draft).__name__, fix="declare tensors with spec.buffer(...)")
        return self._add(ObjectDecl(name=name, draft=draft), override)

    def freeze(self) -> None:
        self._frozen = True

    def __repr__(self) -> str:
        return f"StateSpec({self.name!r}, {len(self._entries)} entries)"

"""Static inputs and buckets: how a live batch of size ``n`` is mapped onto a captured graph.

A :class:`StaticInput` names a forward argument that changes every call (token ids,
positions). The runner allocates its static buffer once, at the largest bucket, copies the
live rows into ``[:rows]`` before each replay and applies the input's padding policy to
``[rows:bucket_rows]``, so a smaller batch never sees the previous call's tail.
"""
from __future__ import annotations

import bisect
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from graphctl.errors import DeclarationError, ReplayError
from graphctl.state import Pad

__all__ = ["StaticInput", "InputSlot", "Buckets", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True, slots=True)
class StaticInput:
    """A forward argument copied into a static buffer before every replay.

    ``per_item`` rows along ``dim`` belong to one batch item (``k + 1`` tokens per request in
    a target forward); ``pad`` fills ``[rows:bucket_rows]`` (zero by default: a valid index).
    Under ``variants=`` the rows per item may be a function of the variant arguments it names:
    ``per_item_of=lambda k: k + 1`` (or ``per_item=`` a function, moved there), resolved once per
    variant (:meth:`resolved`); until then ``per_item`` reads 1."""

    name: str
    per_item: int = 1
    dim: int = 0
    pad: Pad = Pad.zero()
    per_item_of: Callable[..., int] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DeclarationError("StaticInput needs an argument name", expected="a non-empty str", found=self.name,
                                   fix="write StaticInput('input_ids')")
        if callable(self.per_item):  # per_item=lambda k: k + 1: the function is per_item_of
            object.__setattr__(self, "per_item_of", self.per_item)
            object.__setattr__(self, "per_item", 1)
        if self.per_item_of is not None and not callable(self.per_item_of):
            raise DeclarationError("StaticInput.per_item_of must be a function of variant arguments", buffer=self.name,
                                   expected="e.g. lambda k: k + 1", found=repr(self.per_item_of),
                                   fix="pass per_item_of=lambda k: k + 1 (with variants={'k': ...})")
        if not isinstance(self.per_item, int) or isinstance(self.per_item, bool) or self.per_item < 1:
            raise DeclarationError("StaticInput.per_item must be a positive int", buffer=self.name,
                                   expected="an int >= 1", found=self.per_item,
                                   fix="rows per batch item along dim, e.g. k + 1 tokens per request")
        if self.dim < 0:
            raise DeclarationError("StaticInput.dim must be non-negative", buffer=self.name, expected=">= 0",
                                   found=self.dim, fix="count dimensions from the front")

    @classmethod
    def of(cls, spec: str | StaticInput) -> StaticInput:
        return spec if isinstance(spec, StaticInput) else cls(spec)

    def resolved(self, values: Mapping[str, Any]) -> StaticInput:
        """This input for one variant: a callable ``per_item`` called with the variant values its
        parameters name (every one under ``**kwargs``); an int ``per_item`` as it is."""
        fn = self.per_item_of
        if fn is None:
            return self
        params = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            given = dict(values)
        else:
            missing = [n for n, p in params.items() if n not in values and p.default is p.empty]
            if missing:
                raise DeclarationError("per_item names an argument that is no variant", buffer=self.name,
                                       expected=f"parameters among the variants {sorted(values)}", found=missing,
                                       fix="name variant arguments only, e.g. per_item=lambda k: k + 1")
            given = {n: values[n] for n in params if n in values}
        return dataclasses.replace(self, per_item=fn(**given), per_item_of=None)

    def allocate(self, example: torch.Tensor, max_bucket: int) -> torch.Tensor:
        """The static buffer: ``example``'s dtype, device and other dims; ``max_bucket`` items."""
        if not isinstance(example, torch.Tensor):
            listed = isinstance(example, (list, tuple)) and all(isinstance(v, (int, float, bool)) for v in example)
            raise DeclarationError("a static input is not a tensor", buffer=self.name, expected="torch.Tensor",
                                   found=type(example).__name__,
                                   fix=f"pass a tensor: torch.tensor({self.name})" if listed else
                                   "pass a tensor for it, or leave it out of inputs= (then it is frozen at capture)")
        if example.dim() <= self.dim:
            raise DeclarationError("a static input has no batch dimension", buffer=self.name,
                                   expected=f"at least {self.dim + 1} dims", found=tuple(example.shape),
                                   fix="set StaticInput(dim=...) to the batch dimension")
        why = self.pad.unfit(example.dtype)
        if why is not None:
            raise DeclarationError("a static input's padding does not fit its dtype", buffer=self.name,
                                   expected=f"values representable in {example.dtype}", found=why,
                                   fix="pick a padding value inside the dtype's range")
        shape = list(example.shape)
        shape[self.dim] = max_bucket * self.per_item
        buf = torch.empty(shape, dtype=example.dtype, device=example.device)
        with torch.no_grad():
            self.pad.apply(buf)  # never leave uninitialised memory for a warmup to read
        return buf

    def check(self, live: object, static: torch.Tensor, n: int) -> ReplayError | None:
        """Why ``live`` cannot be copied into ``static`` for a batch of ``n`` (None if it can)."""
        if not isinstance(live, torch.Tensor):
            return ReplayError("static input is not a tensor", buffer=self.name, expected="torch.Tensor",
                               found=type(live).__name__, fix="pass a tensor for this argument")
        want = list(static.shape)
        want[self.dim] = n * self.per_item
        if live.dtype != static.dtype or live.device != static.device or list(live.shape) != want:
            return ReplayError("live input does not fit its static buffer", buffer=self.name,
                               expected=f"{tuple(want)} {static.dtype} on {static.device}",
                               found=f"{tuple(live.shape)} {live.dtype} on {live.device}",
                               fix="pass inputs shaped like the capture's example (only the batch dimension may "
                                   "vary), or capture again with such an example")
        return None

    def view(self, static: torch.Tensor, bucket: int) -> torch.Tensor:
        return static.narrow(self.dim, 0, bucket * self.per_item)


class InputSlot:
    """A static input's buffer and the hot-path work on it: the fit check, and the copy and
    padding views per ``(n, bucket)``, built once (slicing a tensor costs a microsecond)."""

    __slots__ = ("spec", "static", "dtype", "device", "ndim", "lead", "tail", "_views")

    def __init__(self, spec: StaticInput, static: torch.Tensor) -> None:
        self.spec, self.static = spec, static
        self.dtype, self.device, self.ndim = static.dtype, static.device, static.dim()
        self.lead, self.tail = static.shape[:spec.dim], static.shape[spec.dim + 1:]
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}

    def fits(self, live: torch.Tensor, n: int) -> bool:
        """The hot-path form of :meth:`StaticInput.check` (no error built)."""
        shape, d = live.shape, self.spec.dim
        return (live.dtype == self.dtype and live.device == self.device and len(shape) == self.ndim
                and shape[d] == n * self.spec.per_item and shape[d + 1:] == self.tail and shape[:d] == self.lead)

    def load(self, live: torch.Tensor, n: int, bucket: int) -> None:
        """Copy ``live`` into ``[:rows]`` and apply the padding policy to ``[rows:bucket_rows]``."""
        views = self._views.get((n, bucket))
        if views is None:
            views = self._views[n, bucket] = self._make_views(n, bucket)
        # a static buffer never records autograd history (nor keeps inputs alive): a detached source
        # (a view, ~0.3 µs, only when it needs one) instead of a no_grad section (~1.5 µs a call)
        views[0].copy_(live.detach() if live.requires_grad else live)
        if views[1] is not None:  # constants and the buffer's own rows: no history either
            self.spec.pad.apply(views[1], views[2], self.spec.dim)

    def _make_views(self, n: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        d, per = self.spec.dim, self.spec.per_item
        rows, brows = n * per, bucket * per
        pad = self.static.narrow(d, rows, brows - rows) if brows > rows and self.spec.pad.kind != "keep" else None
        return self.static.narrow(d, 0, rows), pad, self.static.narrow(d, rows - 1, 1) if rows else None


class Buckets:
    """Sorted capture sizes; ``pick(n)`` is the smallest bucket >= n (None past the largest)."""

    __slots__ = ("sizes", "_table")

    def __init__(self, sizes: Iterable[int]) -> None:
        if isinstance(sizes, (int, str, bytes)) or not isinstance(sizes, Iterable):
            raise DeclarationError("buckets must be a list of batch sizes", expected="e.g. buckets=[1, 2, 4, 8]",
                                   found=f"{type(sizes).__name__} {sizes!r}",
                                   fix=f"pass a list: buckets=[{sizes}]" if isinstance(sizes, int) else
                                   "list the batch sizes to capture")
        raw = list(sizes)
        if not raw or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in raw):
            raise DeclarationError("buckets must be positive ints", expected="e.g. [1, 2, 4, 8]", found=raw,
                                   fix="list the batch sizes to capture")
        self.sizes: tuple[int, ...] = tuple(sorted(set(raw)))
        # A lookup table makes pick() one index on the hot path (buckets are small numbers).
        self._table = [self.sizes[bisect.bisect_left(self.sizes, n)] for n in range(self.sizes[-1] + 1)]

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def pick(self, n: int) -> int | None:
        return self._table[n] if 0 < n <= self.sizes[-1] else None

    def at(self, n: int) -> int:
        """``pick(n)`` where ``n`` is known to fit (``1 <= n <= largest``)."""
        return self._table[n]


"""Eager regions inside a graphed forward: ``@graphctl.eager``, and the record a capture keeps of each.

A function decorated with :func:`eager` always runs eagerly. Called outside a capture (warmups,
eager fallbacks, verify's eager run, plain use) it is a plain call. Called while a backend
captures, the capture becomes a sequence of pieces: the backend ends the piece recorded so far,
runs the function eagerly on real data (the emulated recorder has executed every op; a CUDA
capture replays the piece just ended first), keeps its results as the region's static outputs,
and records the next piece, which reads them. A replay runs piece, region, piece, ...: each
region calls the function again with the same arguments (the static tensors the previous pieces
wrote, and the capture-time host values) and its fresh results reach the static outputs.

For ``torch.compile`` the decorated function is a graph break (``torch.compiler.disable``): a
compiled forward calling it is compiled as pieces around it, and captured as graphs of those
pieces with the region between them. ``fullgraph=True`` cannot break there: refused by name.

Constraints (each checked, a violation is a typed error):

- Inside a region anything eager code may do is allowed: host syncs, data-dependent shapes,
  other libraries, exceptions (they propagate as themselves at replay too); a nested ``@eager``
  call is a plain call.
- What crosses a boundary is exact. A result that was a new tensor at capture is the static
  storage the next piece reads: at every replay the result is copied there whatever it is (a
  new tensor, an argument, another result), unless it aliases an argument or another result
  that a later piece writes in place (``ReplayError``: the copy would hide that write). A result
  that aliased an argument, another result or memory that existed before the capture is that
  very memory for the next piece: at replay it must alias it the same way (``ReplayError``
  naming region and output otherwise; return a new tensor, ``h.clone()``, in every branch).
  Tensors keep the capture's shapes and dtypes and host results the capture's values (later
  pieces baked them in).
- A tensor a region makes and does not return, published elsewhere (``box.cache = h * 2``) and
  read by a later piece, is found by the tracked warmup (``findings/regions.py``) and refused
  (``CaptureError``): a replay would read the capture's tensor while the region publishes a new
  one. Return it instead.
- No ``state.switch`` is open across a region (the capture raises ``CaptureError``): a switch's
  host side (rebound attributes) is not replayed around an eager call, so a region looking up
  the state itself would see the target's objects under a draft switch. Open and close the
  switch inside one piece, or inside the region; or declare ``@eager(in_switch=True)`` for a
  region that reads the state only through its arguments (a replay passes the capture's: under
  the switch, the draft's objects; its device-side buffers hold what the pieces before it
  wrote, the switch's swaps included). Such a region must not use the state (switch, write or
  pad: ``CaptureError``). A region outside every switch may: a replay closes the runner's
  refresh switch around it, so it sees the state as at capture.
- A region is user code for interrupts: a replay holds a first Ctrl-C until the replay ends
  (the state stays consistent), and a second one reaches a region that hangs; the runner then
  restores any switch recorded open across it (``graphs/capture/bucket.py``).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch
from torch.utils._pytree import tree_flatten

from graphctl.errors import CaptureError, ReplayError
from graphctl.state.interrupts import in_user_code

__all__ = ["eager", "is_eager", "calls", "EagerRegion", "Listener", "Watch", "regions", "watching", "listening",
           "admit", "run_region", "saved", "restore", "fullgraph_error"]

F = TypeVar("F", bound=Callable[..., Any])
# .region: the running capture's handler; .watch: the runner's per-capture checks; .listener: a tracked
# warmup's Boundaries; .calls: plain region calls made so far
_tls = threading.local()
_REASON = "reason" in inspect.signature(torch.compiler.disable).parameters  # torch names the region in its errors
_NAMES: set[str] = set()  # every region's qualified name (told apart in dynamo's errors where it gives no reason)


class Watch(Protocol):
    """What the runner checks at each region of a capture (``graphs/capture/passes.py``)."""

    def admit(self, name: str, in_switch: bool) -> bool: ...  # before the piece ends: refuse an open switch;
    # whether a switch is open across the region (an in_switch one)
    def uses(self) -> int: ...  # the state's use count (switch, write, pad), to tell whether a region used it
    def used(self, name: str, in_switch: bool) -> None: ...  # the region used the state: refuse where it must not


def eager(fn: F | None = None, /, *, in_switch: bool = False) -> Any:
    """Mark ``fn`` as a region that always runs eagerly: a graphed forward calling it is
    captured as pieces around it (see the module docstring). ``in_switch=True`` (as
    ``@eager(in_switch=True)``) lets it sit inside an open ``state.switch``: the region promises
    to read the state only through its arguments, which a replay passes as the capture saw them
    (under the switch: the draft's objects), never through attributes it looks up itself."""
    def wrap(f: F) -> F:
        name = _name(f)

        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            handler = getattr(_tls, "region", None)
            if handler is None:
                _tls.calls = getattr(_tls, "calls", 0) + 1  # a warmup met a region (calls())
                listener = getattr(_tls, "listener", None)
                if listener is None:
                    return f(*args, **kwargs)
                listener.enter(name, args, kwargs)
                out = None
                try:
                    out = f(*args, **kwargs)
                finally:
                    listener.leave(out)
                return out
            return handler(f, args, kwargs, in_switch)

        # dynamo never traces into a region: a compiled caller breaks its graph here and calls it as Python
        _NAMES.add(name)
        out = torch.compiler.disable(call, recursive=True, **({"reason": f"graphctl eager region {name}"}
                                                               if _REASON else {}))
        out.__graphctl_eager__ = f
        out.__graphctl_in_switch__ = in_switch
        return out

    return wrap if fn is None else wrap(fn)


def fullgraph_error(exc: BaseException) -> CaptureError | None:
    """The typed error for dynamo's refusal to break a ``fullgraph=True`` graph at a region (None
    when ``exc`` is something else): it names the region and the compiled function calling it."""
    if not isinstance(exc, torch._dynamo.exc.Unsupported):
        return None
    msg = str(exc)
    m = re.search(r"graphctl eager region (\S+?)\)", msg) or re.search(r"<function (\S+) at 0x", msg)
    if m is None or m.group(1) not in _NAMES:
        return None
    caller = re.search(r"from user code:\s+File \"[^\"]+\", line \d+, in (\S+)", msg)
    return CaptureError("an eager region inside a fullgraph=True compiled function", buffer=m.group(1),
                        expected="a graph break at the region (a compiled function is captured as pieces around it)",
                        found=f"torch.compile(fullgraph=True) of {caller.group(1) if caller else 'its caller'}",
                        fix="compile that function without fullgraph=True, or call the region outside it")


def calls() -> int:
    """How many plain (uncaptured) region calls this thread has made: a runner compares the count
    across its warmups to learn whether its capture will run regions (and so replay pieces)."""
    return getattr(_tls, "calls", 0)


def is_eager(fn: Any) -> bool:
    """True for a function decorated with :func:`eager`."""
    return callable(getattr(fn, "__graphctl_eager__", None))


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def saved() -> tuple[Any, Any]:
    """This thread's handler and watch, for :func:`restore` in a backend's ``finally``: a Ctrl-C
    landing inside the cleanup of :func:`regions` could skip its reset, and every later eager
    call (a warmup's) would then reach a dead capture."""
    return getattr(_tls, "region", None), getattr(_tls, "watch", None)


def restore(state: tuple[Any, Any]) -> None:
    _tls.region, _tls.watch = state


@contextlib.contextmanager
def _installed(slot: str, value: Any) -> Iterator[None]:
    """``value`` in this thread's ``slot`` for the with-block, the previous one back after it."""
    prev = getattr(_tls, slot, None)
    setattr(_tls, slot, value)
    try:
        yield
    finally:
        setattr(_tls, slot, prev)


def regions(handler: Callable[[Callable[..., Any], tuple, dict, bool], Any]) -> contextlib.AbstractContextManager[None]:
    """While a backend captures in this thread: ``handler(fn, args, kwargs, in_switch)`` takes
    every ``@eager`` call (ends the piece, runs the region, begins the next piece)."""
    return _installed("region", handler)


def watching(watch: Watch | None) -> contextlib.AbstractContextManager[None]:
    """The runner's :class:`Watch` over every region of the capture running in this thread."""
    return _installed("watch", watch)


class Listener(Protocol):
    """Told of every plain region call in this thread (a tracked warmup's, ``findings/regions.py``)."""

    def enter(self, name: str, args: tuple, kwargs: dict) -> None: ...
    def leave(self, out: Any) -> None: ...


def listening(listener: Listener | None) -> contextlib.AbstractContextManager[None]:
    """A tracked warmup's :class:`Listener`, told of every plain region call in this thread."""
    return _installed("listener", listener)


def admit(fn: Callable[..., Any], in_switch: bool) -> bool:
    """A backend's first step at a region, before its piece ends: the runner's checks (no switch
    open across it unless ``in_switch``); whether a switch is open across it."""
    watch = getattr(_tls, "watch", None)
    return watch.admit(_name(fn), in_switch) if watch is not None else False


def run_region(fn: Callable[..., Any], args: tuple, kwargs: dict, in_switch: bool = False,
               inside: bool = False) -> tuple[Any, EagerRegion]:
    """Run ``fn`` eagerly (a nested ``@eager`` call inside is a plain one); its result and the
    :class:`EagerRegion` a replay calls. ``inside``: a switch is open across it (:func:`admit`)."""
    prev = getattr(_tls, "region", None)
    watch = getattr(_tls, "watch", None)
    before = watch.uses() if watch is not None else 0
    _tls.region = None
    try:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        first_us = (time.perf_counter() - t0) * 1e6
    finally:
        _tls.region = prev
    uses = watch is not None and watch.uses() != before
    if uses:
        watch.used(_name(fn), in_switch)  # type: ignore[union-attr]
    return out, EagerRegion(fn, args, kwargs, out, first_us, uses, inside)


_ALIAS_FIX = {  # by what a result aliased at capture
    "argument": "return a new tensor in every branch (h.clone() where nothing changes), or write the result into "
                "that argument in place in every branch",
    "result": "return distinct tensors in every branch ((a, a.clone()) where both are one)",
    "memory": "return a new tensor (a clone) where the region returns a tensor that existed before the capture: a "
              "replay must not write into it, and the pieces after it read that memory",
}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _geometry(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class EagerRegion:
    """One eager call between two pieces: called again at every replay, its fresh results reach
    the capture-time outputs (the static storage the next piece reads). ``outputs``: the static
    tensors, in result order. Per result the capture fixed a kind: ``own`` (a new tensor at
    capture: the replay copies into it), ``alias`` (an argument, another result or memory that
    existed before: the replay's result must be that memory again) or ``host`` (a value later
    pieces baked in)."""

    __slots__ = ("fn", "name", "args", "kwargs", "outputs", "kinds", "host", "spec", "calls", "seconds",
                 "capture_us", "uses_state", "inside", "_arg_storages", "_versions", "_strict", "_described")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, out: Any, capture_us: float,
                 uses_state: bool = False, inside: bool = False) -> None:
        self.fn, self.name, self.args, self.kwargs = fn, _name(fn), args, kwargs
        # uses_state: it switched, wrote or padded the state at capture; inside: a switch was open across it
        self.capture_us, self.uses_state, self.inside = capture_us, uses_state, inside
        flat, self.spec = tree_flatten(out)
        self.outputs = tuple(t for t in flat if isinstance(t, torch.Tensor))  # static: the next piece reads them
        self.host = tuple((i, v) for i, v in enumerate(flat) if not isinstance(v, torch.Tensor))
        args_flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self._arg_storages = {_storage(t): j for j, t in enumerate(args_flat)}
        kinds: list[tuple] = []
        seen: dict[int, int] = {}  # storage -> the first result on it
        for i, v in enumerate(flat):
            if not isinstance(v, torch.Tensor):
                continue
            st = _storage(v)
            if st in self._arg_storages:
                kinds.append((i, "alias", _geometry(v), f"argument {self._arg_storages[st]}"))
            elif st in seen:
                kinds.append((i, "alias", _geometry(v), f"result {seen[st]}"))
            else:
                kinds.append((i, "own", v))
            seen.setdefault(st, i)
        self.kinds = tuple(kinds)
        # versions right after the region returned: seal() learns which the later pieces write in place
        self._versions = ([(i, v._version) for i, _, v in (k for k in kinds if k[1] == "own")],
                          [(t, t._version) for t in args_flat])
        self._strict: frozenset[int] = frozenset()  # own results whose aliasing at replay must be refused
        self._described = ""
        self.calls, self.seconds = 0, 0.0

    def seal(self, existing: Callable[[torch.Tensor], bool]) -> None:
        """At the end of the capture: own results on memory that ``existing`` says was there
        before the capture (a model's buffer the region returned) become aliases (a replay must
        return that very memory: copying into it would change the caller's tensor), and the
        own results that a later piece writes in place, or whose replay result may alias an
        argument a later piece writes, are refused at replay when they alias anything."""
        own_versions, arg_versions = self._versions
        written_args = [t for t, v in arg_versions if t._version != v]
        kinds, strict = [], set()
        before = dict(own_versions)
        for k in self.kinds:
            if k[1] == "own" and existing(k[2]):
                kinds.append((k[0], "alias", _geometry(k[2]), "memory that existed before the capture"))
                continue
            if k[1] == "own" and (k[2]._version != before.get(k[0]) or written_args):
                strict.add(k[0])
            kinds.append(k)
        self.kinds, self._strict, self._versions = tuple(kinds), frozenset(strict), ([], [])
        if written_args:
            self._described = "an argument of the region that a later piece writes in place"

    def repointed(self, args: tuple, kwargs: dict) -> None:
        """A re-pointed graph passes these arguments from now on (``graphs/replay/repoint.py``): a result
        that aliased a moved argument must alias it at its new address."""
        def tensors(a: tuple, k: dict) -> list[torch.Tensor]:
            return [t for t in tree_flatten((a, k))[0] if isinstance(t, torch.Tensor)]

        old, new = tensors(self.args, self.kwargs), tensors(args, kwargs)
        kinds = []
        for k in self.kinds:
            if k[1] == "alias" and k[3].startswith("argument "):
                j = int(k[3].split()[1])
                ptr, shape, stride, dtype = k[2]
                k = (k[0], "alias", (ptr - old[j].data_ptr() + new[j].data_ptr(), shape, stride, dtype), k[3])
            kinds.append(k)
        self.kinds, self.args, self.kwargs = tuple(kinds), args, kwargs
        self._arg_storages = {_storage(t): j for j, t in enumerate(new)}

    @property
    def mean_us(self) -> float | None:
        """Host wall time of a region call at replay (its own work, the copies included)."""
        return self.seconds / self.calls * 1e6 if self.calls else None

    def run(self, *args: Any, **kwargs: Any) -> None:
        """One replay's call, with ``args``/``kwargs`` (the recorded ones: a re-pointed graph
        passes its own), as user code for interrupts (a second Ctrl-C reaches it)."""
        t0 = time.perf_counter()
        with in_user_code():
            res = self.fn(*args, **kwargs)
        flat, spec = tree_flatten(res)
        if spec != self.spec:
            raise self._error(None, f"results shaped {self.spec}", str(spec)[:120],
                              "return the same structure (tuple, list, dict keys) at every call")
        for i, want in self.host:
            got = flat[i]
            if isinstance(got, torch.Tensor) or got != want:
                raise self._error(i, f"{want!r} (the pieces after it baked it in)", repr(got)[:80],
                                  "return host values that do not change, or compute them outside the graphed forward",
                                  "an eager region returned another host value than at capture")
        for k in self.kinds:
            i, got = k[0], flat[k[0]]
            if not isinstance(got, torch.Tensor):
                raise self._error(i, "a tensor", repr(got)[:80], "return a tensor in every branch")
            if k[1] == "alias":
                if _geometry(got) != k[2]:
                    raise self._error(i, f"the memory of {k[3]}, as at capture (the pieces after it read it)",
                                      "a tensor on other memory" if got.data_ptr() != k[2][0] else
                                      f"{tuple(got.shape)} {got.dtype} there", _ALIAS_FIX[k[3].split()[0]],
                                      "an eager region's result aliases other memory than at capture")
                continue
            static = k[2]
            if got.shape != static.shape or got.dtype != static.dtype:
                raise self._error(i, f"{tuple(static.shape)} {static.dtype}", f"{tuple(got.shape)} {got.dtype}",
                                  "return tensors of the capture's shapes (pad inside the region), or write "
                                  "into an argument in place", "an eager region's output does not fit its static "
                                                               "storage")
            if got.data_ptr() == static.data_ptr():
                continue
            if i in self._strict and self._aliases(got, flat, i):
                raise self._error(i, "a new tensor, as at capture", "a tensor aliasing an argument or another result",
                                  "return a new tensor (h.clone()): a later piece writes in place what this result "
                                  f"aliases ({self._described or 'the result itself'}), which a copy would hide",
                                  "an eager region's result aliases memory a later piece writes")
            static.copy_(got)
        self.calls += 1
        self.seconds += time.perf_counter() - t0

    def _aliases(self, got: torch.Tensor, flat: list, i: int) -> bool:
        st = _storage(got)
        return st in self._arg_storages or any(
            isinstance(o, torch.Tensor) and j != i and _storage(o) == st for j, o in enumerate(flat))

    def _error(self, i: int | None, expected: str, found: str, fix: str,
               what: str = "an eager region returned another structure than at capture") -> ReplayError:
        return ReplayError(what, buffer=self.name, expected=(f"output {i}: " if i is not None else "") + expected,
                           found=found, fix=fix)

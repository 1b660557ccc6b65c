"""A graphed forward's options, declared once: one field each, its default, its check and its doc.

Every option of :func:`graphctl.graphed` / :class:`GraphRunner` is a field of :class:`Options`
whose metadata holds what it means (``doc``) and how a given value is checked and normalised
(``take``: raises a ``DeclarationError`` naming the option, what it takes and what was given).
:meth:`Options.of` applies them; the user guide's options table is :func:`table`. A decorated
method's per-instance runner gets the same record with its instance's state
(``dataclasses.replace``), never a copy kept in step by hand. The closed sets of modes are enums
(:class:`Fallback`, :class:`SideEffects`, :class:`HostState`; a string naming a member is taken
too, and members compare equal to their strings).
"""
from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Callable, Mapping
from typing import Any

from graphctl.errors import DeclarationError, did_you_mean
from graphctl.graphs.backends import BACKENDS
from graphctl.graphs.capture.inputs import DEFAULT_BUCKETS, Buckets, StaticInput

__all__ = ["Options", "Fallback", "SideEffects", "HostState", "FALLBACKS", "VariantValues", "SharedPool",
           "per_instance", "variant_key", "table"]


class Fallback(enum.StrEnum):
    ERROR = "error"  # a batch no graph can serve raises ReplayError
    EAGER = "eager"  # it runs the forward eagerly, logged and counted


class SideEffects(enum.StrEnum):
    RESTORE = "restore"  # undo what warmups and captures write to state graphctl does not own
    ERROR = "error"  # refuse such a forward
    IGNORE = "ignore"  # leave it


class HostState(enum.StrEnum):
    WARN = "warn"  # log and report host values the warmups changed
    RESTORE = "restore"  # write them back after the capture
    ERROR = "error"  # refuse such a forward


FALLBACKS = tuple(Fallback)
# a variant argument's values: (value, its own buckets or None), per argument name, in declared order
VariantValues = tuple[tuple[str, tuple[tuple[Any, tuple[int, ...] | None], ...]], ...]
_HOST = (int, str, bool, type(None))  # a variant value: one of these, or a small tuple of them
_MAX_TUPLE = 8


class SharedPool:
    """One graph memory pool handed to several runners (a variant runner's): the first capture
    makes it on its backend, the others capture into it."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        self.handle: Any = None


def _mode(kind: type[enum.StrEnum], what: str, fix: str) -> Callable[[str, Any], Any]:
    def take(name: str, v: Any) -> Any:
        try:
            return kind(v)
        except ValueError:
            raise DeclarationError(f"unknown {what}", expected=" / ".join(repr(m.value) for m in kind),
                                   found=repr(v), fix=fix) from None
    return take


def _backend(name: str, v: Any) -> str:
    if v not in ("auto", *BACKENDS):
        raise DeclarationError("unknown backend", expected=" / ".join(map(repr, ("auto", *BACKENDS))), found=repr(v),
                               fix="backend='auto' picks cuda on a GPU, emulated elsewhere")
    return str(v)


def _int_at_least(low: int, expected: str, fix: str, optional: bool = False) -> Callable[[str, Any], Any]:
    def take(name: str, v: Any) -> Any:
        if optional and v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise DeclarationError(f"{name} takes an int" + (" or None" if optional else f" >= {low}"),
                                   expected=expected, found=repr(v), fix=fix)
        return v
    return take


def _bool_or_none(name: str, v: Any) -> bool | None:
    if v is not None and not isinstance(v, bool):
        raise DeclarationError(f"{name} takes a bool or None", expected="True, False or None (the knob)",
                               found=repr(v), fix=f"pass {name}=False to skip the {name[6:-1]} check"
                               if name.startswith("check_") else f"pass {name}=False to turn it off")
    return v


def _pad_axes(name: str, v: Any) -> dict[str, int] | None:
    if v is None:
        return None
    if not isinstance(v, Mapping) or any(not isinstance(k, str) or isinstance(n, bool) or not isinstance(n, int)
                                         or n < 1 for k, n in v.items()):
        raise DeclarationError("pad_axes maps a state axis to rows per batch item",
                               expected="e.g. {'seq': 1, 'token': 4}", found=repr(v),
                               fix="name each axis (str) with a positive int")
    return dict(v)


def _callable_or_none(name: str, v: Any) -> Any:
    if v is not None and not callable(v):
        raise DeclarationError(f"{name} takes a callable or None", expected="a function (n, **variant values) -> None",
                               found=type(v).__name__, fix=f"pass {name}=lambda n: meta.prepare(...)")
    return v


def _inputs(name: str, v: Any) -> tuple[StaticInput, ...] | None:
    return None if v is None else tuple(StaticInput.of(i) for i in v)


def _same(name: str, v: Any) -> Any:
    return v


def _opt(default: Any, take: Callable[[str, Any], Any], doc: str, **kw: Any) -> Any:
    """One option: its default, how a given value is checked and normalised, what it means."""
    return dataclasses.field(default=default, metadata={"take": take, "doc": doc}, **kw)


@dataclasses.dataclass(frozen=True)
class Options:
    """What a runner was asked for: one field per option (its doc in the field's metadata,
    :func:`table`). ``pool`` is set by a variant runner for its per-variant runners, not by users."""

    buckets: Buckets = _opt(None, lambda n, v: Buckets(v), "batch sizes to capture (default 1 to 256, powers of "
                            "two)")
    state: Any = _opt(None, _same, "a BoundState, an object to bind, or on a decorated method the name of the "
                      "instance attribute holding the metadata (each instance gets its own runner)")
    inputs: tuple[StaticInput, ...] | None = _opt(None, _inputs, "argument names or StaticInput; None: every tensor "
                                                  "argument, batch on dim 0")
    backend: str = _opt("auto", _backend, "auto, cuda or emulated")
    fallback: Fallback = _opt(Fallback.ERROR, _mode(Fallback, "fallback", "fallback='eager' runs unservable batches "
                                                    "eagerly (logged); 'error' raises"),
                              "error: a batch no graph can serve raises ReplayError; eager: it runs eagerly, "
                              "logged and counted")
    pad_axes: Mapping[str, int] | None = _opt(None, _pad_axes, "state axis -> rows per batch item for state.pad "
                                              "(default {'seq': 1, 'token': <first input's per_item>})")
    warmup_iters: int = _opt(2, _int_at_least(0, "e.g. 2 (eager runs per bucket)", "pass warmup_iters=2"),
                             "eager runs at the largest bucket before capture (one at each smaller bucket; a "
                             "compiled forward at least two a bucket)")
    progress: bool | None = _opt(None, _bool_or_none, "a progress bar (None: when stderr is a terminal)")
    params: Any = _opt(None, _same, "the model tensors the forward reads, for the audit (an nn.Module, a name -> "
                       "tensor mapping or an iterable)")
    group: Any = _opt(None, _same, "a torch.distributed process group: the ranks agree on the bucket and on falling "
                      "back together (graphs/replay/distributed.py)")
    side_effects: SideEffects = _opt(SideEffects.RESTORE, _mode(
                                         SideEffects, "side_effects policy", "restore (default): undo what warmups "
                                         "and captures write to state graphctl does not own; error: refuse such a "
                                         "forward; ignore: leave it"),
                                     "writes to state graphctl does not own: restore, error or ignore "
                                     "(graphs/findings/stream.py)")
    max_side_effect_bytes: int | None = _opt(None, _int_at_least(0, "bytes, e.g. 2**30", "pass a byte count, or None "
                                                                 "for no cap", optional=True),
                                             "a cap on side-effect snapshots (None: no cap)")
    host_state: HostState = _opt(HostState.WARN, _mode(HostState, "host_state policy", "warn (default): log and report "
                                                       "host values the warmups changed; restore: write them back "
                                                       "after capture; error: refuse such a forward"),
                                 "host values the warmups change: warn, restore or error (findings/hoststate.py)")
    copy_outputs: bool = _opt(False, lambda n, v: bool(v), "fresh tensors per call instead of views "
                              "(graphs/replay/stale.py)")
    check_paths: bool | None = _opt(None, _bool_or_none, "re-resolve before each replay what the forward reached "
                                    "(graphs/replay/rebinding.py; None: as GRAPHCTL_CHECK_PATHS says)")
    variants: VariantValues | None = _opt(None, lambda n, v: None if v is None else _variants(v),
                                          "argument name -> the host values to capture a graph set for (a sequence, "
                                          "or value -> its own buckets); several names form the product")
    prepare: Callable[..., None] | None = _opt(None, _callable_or_none,
                                               "how the bound state describes a batch of n items (the engine's own "
                                               "prepare), called prepare(n, **variant values) by verify before each "
                                               "run; None: the state's padding policies past n")
    pool: SharedPool | None = dataclasses.field(default=None, metadata={"internal": True})

    @staticmethod
    def named(where: str, given: Mapping[str, Any]) -> Mapping[str, Any]:
        """``given``, after a ``TypeError`` (as Python's, naming ``where``) for a name that is no option."""
        for key in given:
            if key not in _names():
                raise TypeError(f"{where}() got an unexpected keyword argument '{key}'{did_you_mean(key, _names())}")
        return given

    @classmethod
    def of(cls, **given: Any) -> Options:
        """The record, every option checked by its field's ``take`` (a ``DeclarationError`` naming
        the first bad one); options not given keep their defaults."""
        values = {f.name: f.metadata["take"](f.name, given[f.name]) for f in dataclasses.fields(cls)
                  if f.name in given}
        if "buckets" not in values:
            values["buckets"] = Buckets(DEFAULT_BUCKETS)
        for si in values.get("inputs") or () if values.get("variants") is None else ():
            if si.per_item_of is not None:
                raise DeclarationError("per_item is a function but the runner has no variants", buffer=si.name,
                                       expected="an int, or variants= naming its arguments",
                                       found=repr(si.per_item_of), fix="pass per_item=k + 1, or variants={'k': (...)}")
        return cls(**values)


def _names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Options) if not f.metadata.get("internal"))


def table() -> list[tuple[str, str, str]]:
    """``(option, default, what it means)`` of every option, for the docs."""
    return [(f.name, "Buckets(1..256)" if f.name == "buckets" else repr(f.default), f.metadata["doc"])
            for f in dataclasses.fields(Options) if not f.metadata.get("internal")]


def _host_value(v: Any) -> bool:
    if isinstance(v, tuple):
        return len(v) <= _MAX_TUPLE and all(isinstance(x, _HOST) for x in v)
    return isinstance(v, _HOST)


def _variants(given: Any) -> VariantValues:
    """``variants=`` checked and normalised (see :class:`Options`)."""
    fix = "pass variants={'k': (1, 3, 7)} or {'k': {1: [1, 2, 4], 3: [1, 2]}}"
    if not isinstance(given, Mapping) or not given:
        raise DeclarationError("variants maps argument names to the values to capture",
                               expected="a non-empty mapping", found=repr(given), fix=fix)
    out = []
    for name, values in given.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise DeclarationError("a variant is named by a forward argument", expected="an argument name (str)",
                                   found=repr(name), fix=fix)
        per = values.items() if isinstance(values, Mapping) else \
            ((v, None) for v in values) if isinstance(values, (list, tuple, set, frozenset, range)) else None
        if per is None:
            raise DeclarationError("a variant lists its values", buffer=name, expected="a sequence or value -> buckets",
                                   found=repr(values), fix=fix)
        seen: list[tuple[Any, tuple[int, ...] | None]] = []
        keys: set[Any] = set()
        for v, bk in per:
            if not _host_value(v):
                raise DeclarationError("a variant value must be a hashable host value", buffer=name,
                                       expected=f"int, bool, str, None, or a tuple of up to {_MAX_TUPLE} of these",
                                       found=f"{type(v).__name__} {v!r}"[:120],
                                       fix="key graphs on host values; pass tensors as static inputs")
            if variant_key(v) in keys:
                raise DeclarationError("a variant value is listed twice", buffer=name, expected="distinct values",
                                       found=repr(v), fix="list each value once")
            keys.add(variant_key(v))
            seen.append((v, None if bk is None else Buckets(bk).sizes))
        if not seen:
            raise DeclarationError("a variant lists no value", buffer=name, expected="at least one value",
                                   found=repr(values), fix=fix)
        out.append((name, tuple(seen)))
    return tuple(out)


def variant_key(v: Any) -> Any:
    """A value's lookup key: its type too, so ``True`` and ``1`` (equal in Python) are two variants."""
    if isinstance(v, tuple):
        return tuple(variant_key(x) for x in v)
    return (type(v), v)


def per_instance(fn: Callable[..., Any], opts: Options, obj: Any, make: Callable[[Any, Options], Any]) -> Any:
    """The runner a ``@graphed`` method has on ``obj``: made once by ``make(bound method, options)``
    and kept in the instance (its own graphs, inputs and state); ``state="attr"`` is read off it."""
    key = f"_graphctl_runner_{fn.__name__}"
    runner = obj.__dict__.get(key)
    if runner is None:
        if isinstance(opts.state, str):
            opts = dataclasses.replace(opts, state=getattr(obj, opts.state))
        runner = obj.__dict__[key] = make(types.MethodType(fn, obj), opts)
    return runner

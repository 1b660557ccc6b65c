"""A graphed forward's options, as one frozen record checked in one place.

Every option of :func:`graphctl.graphed` / :class:`GraphRunner` is a field of :class:`Options`;
:meth:`Options.of` checks each one and raises a ``DeclarationError`` naming the option, what it
takes and what was given. A decorated method's per-instance runner gets the same record with its
instance's state (``dataclasses.replace``), never a copy kept in step by hand.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graphctl.errors import DeclarationError, did_you_mean
from graphctl.graphs.backends import BACKENDS
from graphctl.graphs.effects import POLICIES
from graphctl.graphs.hoststate import HOST_POLICIES
from graphctl.graphs.inputs import DEFAULT_BUCKETS, Buckets, StaticInput

__all__ = ["Options", "FALLBACKS", "VariantValues", "SharedPool", "per_instance"]

FALLBACKS = ("error", "eager")
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


@dataclasses.dataclass(frozen=True)
class Options:
    """What a runner was asked for.

    ``buckets``: batch sizes to capture. ``state``: a ``BoundState``, an object to bind, or on a
    decorated method the name of the instance attribute holding the metadata (each instance
    gets its own runner). ``inputs``: argument names or ``StaticInput``; ``None``: every tensor
    argument, batch on dim 0. ``backend``: ``auto``, ``cuda``, ``emulated``. ``fallback``:
    ``"error"`` (a batch no graph can serve raises ``ReplayError``) or ``"eager"`` (it runs the
    forward eagerly, logged and counted). ``pad_axes``: state axis -> rows per batch item for
    ``state.pad`` (default ``{"seq": 1, "token": <first input's per_item>}``). ``warmup_iters``:
    eager runs at the largest bucket before capture (one at each smaller bucket: the largest
    bucket's runs did the process-wide first-call work; a compiled forward runs at least two a
    bucket, ``graphs/passes.py``). ``progress``: a progress bar (``None``: when stderr is
    a terminal). ``params``: the model tensors the forward reads, for the audit and the path
    check (an ``nn.Module``, a name -> tensor mapping or an iterable). ``group``: a
    ``torch.distributed`` process group; before each call the ranks agree on the bucket (the
    largest batch over ranks) and on falling back together, and the replay's refresh switch is
    entered on every rank or on none (``graphs/distributed.py``). ``side_effects`` and
    ``max_side_effect_bytes``: what to do with writes to state graphctl does not own
    (``graphs/effects.py``). ``host_state``: host values warmups change (``graphs/hoststate.py``).
    ``copy_outputs``: fresh tensors per call instead of views (``graphs/stale.py``).
    ``check_paths``: re-resolve before each replay the paths to tensors the forward reached
    (``graphs/rebinding.py``; ``None``: as ``GRAPHCTL_CHECK_PATHS`` says at each call).
    ``variants``: argument name -> the host values to capture a graph set for (a sequence, or a
    mapping value -> its own buckets); several names form the product (``graphs/variants.py``).
    ``pool``: set by a variant runner for its per-variant runners (one pool), not by users."""

    buckets: Buckets
    state: Any = None  # a BoundState, an object to bind, or (decorated method) an attribute name
    inputs: tuple[StaticInput, ...] | None = None  # None: every tensor argument, batch on dim 0
    backend: str = "auto"
    fallback: str = "error"
    pad_axes: Mapping[str, int] | None = None
    warmup_iters: int = 2
    progress: bool | None = None
    params: Any = None
    group: Any = None
    side_effects: str = "restore"
    max_side_effect_bytes: int | None = None
    host_state: str = "warn"
    copy_outputs: bool = False
    check_paths: bool | None = None  # None: GRAPHCTL_CHECK_PATHS decides at each call
    variants: VariantValues | None = None
    pool: SharedPool | None = None

    @staticmethod
    def named(where: str, given: Mapping[str, Any]) -> Mapping[str, Any]:
        """``given``, after a ``TypeError`` (as Python's, naming ``where``) for a name that is no option."""
        for key in given:
            if key not in _names():
                raise TypeError(f"{where}() got an unexpected keyword argument '{key}'{did_you_mean(key, _names())}")
        return given

    @classmethod
    def of(cls, *, buckets: Sequence[int] = DEFAULT_BUCKETS, state: Any = None,
           inputs: Sequence[str | StaticInput] | None = None, backend: str = "auto", fallback: str = "error",
           pad_axes: Mapping[str, int] | None = None, warmup_iters: int = 2, progress: bool | None = None,
           params: Any = None, group: Any = None, side_effects: str = "restore",
           max_side_effect_bytes: int | None = None, host_state: str = "warn", copy_outputs: bool = False,
           check_paths: bool | None = None, variants: Mapping[str, Any] | None = None) -> Options:
        """The record, every option checked (a ``DeclarationError`` naming the first bad one)."""
        _one_of("fallback", fallback, FALLBACKS, "fallback='eager' runs unservable batches eagerly (logged); "
                                                 "'error' raises")
        _one_of("backend", backend, ("auto", *BACKENDS), "backend='auto' picks cuda on a GPU, emulated elsewhere")
        _one_of("side_effects policy", side_effects, POLICIES,
                "restore (default): undo what warmups and captures write to state graphctl does not own; "
                "error: refuse such a forward; ignore: leave it")
        _one_of("host_state policy", host_state, HOST_POLICIES,
                "warn (default): log and report host values the warmups changed; restore: write them back after "
                "capture; error: refuse such a forward")
        if check_paths is not None and not isinstance(check_paths, bool):
            raise DeclarationError("check_paths takes a bool or None", expected="True, False or None (the knob)",
                                   found=repr(check_paths), fix="pass check_paths=False to skip the path check")
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
            raise DeclarationError("warmup_iters takes an int >= 0", expected="e.g. 2 (eager runs per bucket)",
                                   found=repr(warmup_iters), fix="pass warmup_iters=2")
        if max_side_effect_bytes is not None and (isinstance(max_side_effect_bytes, bool) or
                                                  not isinstance(max_side_effect_bytes, int)):
            raise DeclarationError("max_side_effect_bytes takes an int or None", expected="bytes, e.g. 2**30",
                                   found=repr(max_side_effect_bytes), fix="pass a byte count, or None for no cap")
        if pad_axes is not None and (not isinstance(pad_axes, Mapping) or
                                     any(not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int)
                                         or v < 1 for k, v in pad_axes.items())):
            raise DeclarationError("pad_axes maps a state axis to rows per batch item",
                                   expected="e.g. {'seq': 1, 'token': 4}", found=repr(pad_axes),
                                   fix="name each axis (str) with a positive int")
        ins = None if inputs is None else tuple(StaticInput.of(i) for i in inputs)
        vs = None if variants is None else _variants(variants)
        for si in ins or () if vs is None else ():
            if si.per_item_of is not None:
                raise DeclarationError("per_item is a function but the runner has no variants", buffer=si.name,
                                       expected="an int, or variants= naming its arguments",
                                       found=repr(si.per_item_of), fix="pass per_item=k + 1, or variants={'k': (...)}")
        return cls(Buckets(buckets), state, ins, backend, fallback, None if pad_axes is None else dict(pad_axes),
                   warmup_iters, progress, params, group, side_effects, max_side_effect_bytes, host_state,
                   bool(copy_outputs), check_paths, vs)


def _names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Options) if f.name != "pool")


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


def _one_of(what: str, value: Any, allowed: Sequence[str], fix: str) -> None:
    if value not in allowed:
        raise DeclarationError(f"unknown {what}", expected=" / ".join(map(repr, allowed)), found=repr(value), fix=fix)


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

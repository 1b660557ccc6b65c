"""Graph variants: one graph set per value of host arguments, all in one memory pool.

``graphed(fn, variants={"k": (1, 3, 7)})`` returns a :class:`VariantRunner`: one
:class:`~graphctl.graphs.runner.GraphRunner` per combination of the listed values (several
names form the product), each capturing every bucket of its own (a value may map to its own
buckets: ``{"k": {1: [1, 2, 4], 3: [1, 2]}}``; with several names, a combination gets the
buckets all its values allow). A call reads the variant arguments (host values: int, bool, str,
None, small tuples of these), picks that combination's runner and is served by it; a value
not listed raises ``ReplayError`` naming the argument, the value and the captured ones, or
runs the forward eagerly under ``fallback="eager"`` (logged and counted in ``fallbacks``).

Constraints (each checked):

- Every variant name is a parameter of the forward and not a static input; values are host
  values, each listed once (``True`` and ``1`` are distinct variants).
- All variants share the runner's options but ``buckets`` and ``inputs``: a static input's
  ``per_item_of`` may be a function of the variant arguments (``per_item_of=lambda k: k + 1``); the
  example call's items are resized for each variant (rows repeated cyclically), so one example
  captures every variant.
- Capture goes variant by variant, the one with the largest graph first (its largest bucket
  times its rows per item), every bucket of one variant largest first, all into one pool:
  later graphs reuse the blocks earlier ones freed. Reports list variants in declared order.
  A capture that fails anywhere drops every variant (no holes).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from graphctl.errors import CaptureError, DeclarationError, ReplayError
from graphctl.graphs.capture.bucket import gc_held
from graphctl.graphs.capture.calls import Signature, name_of, wraps
from graphctl.graphs.capture.inputs import Buckets, StaticInput
from graphctl.graphs.face import RunnerFace, Unit, timed
from graphctl.graphs.options import Options, SharedPool, per_instance, variant_key
from graphctl.graphs.runner import GraphRunner

__all__ = ["Variant", "VariantRunner"]

log = logging.getLogger("graphctl")


Variant = Unit  # one combination of variant values and the runner holding its graphs (graphs/face.py)


class VariantRunner(RunnerFace):
    """Graphs of ``fn`` per bucket and per variant value. Build it with :func:`graphctl.graphed`
    and ``variants=``; see the module docstring for the constraints. Its ``report``, ``verify``,
    ``audit``, ``coverage``, ``measure`` and ``repoint`` are every runner's (``graphs/face.py``),
    over one unit per combination."""

    def __init__(self, fn: Callable[..., Any], options: Options, /) -> None:
        wraps(self, fn)
        assert options.variants is not None
        self.fn, self.options = fn, options
        self._sig = Signature(fn)
        self.phase_s: dict[str, float] = {}
        self._names = tuple(name for name, _ in options.variants)
        inputs = {si.name for si in options.inputs or ()}
        for name in self._names:
            if name not in self._sig.position or name in inputs:
                raise DeclarationError("a variant names no host argument of the forward", buffer=name,
                                       expected=f"a parameter among {[n for n in self._sig.names if n not in inputs]}",
                                       found=name if name not in inputs else f"{name} (a static input)",
                                       fix="name a host argument (int, bool, str) the forward takes")
        self._pool = SharedPool()
        self._fallbacks: dict[str, int] = {}
        self._captured = False
        self._by_key: dict[tuple, Variant] = {}
        order: list[Unit] = []
        for combo in itertools.product(*(values for _, values in options.variants)):
            values = tuple((name, v) for name, (v, _) in zip(self._names, combo))
            own = [set(bk) for _, bk in combo if bk is not None]  # a value's own buckets replace the runner's
            allowed = set.intersection(*own) if own else set(options.buckets.sizes)
            if not allowed:
                raise DeclarationError("a variant combination has no bucket every value allows",
                                       buffer=", ".join(f"{n}={v!r}" for n, v in values),
                                       expected="a bucket common to every value's list",
                                       found=[list(bk) for _, bk in combo if bk is not None],
                                       fix="give the values overlapping buckets")
            named = dict(values)
            sub = dataclasses.replace(options, variants=None, pool=self._pool, buckets=Buckets(allowed),
                                      inputs=None if options.inputs is None else
                                      tuple(si.resolved(named) for si in options.inputs),
                                      prepare=None if options.prepare is None else
                                      functools.partial(options.prepare, **named))
            v = Unit(values, GraphRunner(fn, sub))
            self._by_key[tuple(variant_key(x) for _, x in values)] = v
            order.append(v)
        self.variants: tuple[Unit, ...] = tuple(order)  # declared order: reports, verify, coverage
        # captured largest first (the most rows a graph takes: bucket x rows per item), so that later
        # graphs reuse the blocks earlier ones freed, as the buckets within a runner do
        self._order = tuple(sorted(order, key=lambda v: -v.runner.buckets.largest * max(
            [si.per_item for si in v.runner.options.inputs or ()] or [1])))

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        """A decorated method gets one variant runner per instance, as :class:`GraphRunner` does."""
        if obj is None:
            return self
        return per_instance(self.fn, self.options, obj, VariantRunner)

    # ------------------------------------------------------------------ capture and calls

    def capture_all(self, *args: Any, **kwargs: Any) -> VariantRunner:
        """Capture every variant from one example call (see the module docstring)."""
        if self._captured:
            raise CaptureError("graphs are already captured", expected="one capture_all per runner",
                               found=f"variants {[v.label for v in self.variants]}",
                               fix="call reset() first to capture again")
        arguments = self._sig.bind(args, kwargs)
        given = {n: arguments[n] for n in self._names}
        try:
            with gc_held(), timed(self, "capture"):  # one collection for every variant's capture
                self._capture_each(arguments, given)
        except BaseException:
            self.reset()
            raise
        self._captured = True
        return self

    def _capture_each(self, arguments: dict[str, Any], given: dict[str, Any]) -> None:
        for v in self._order:
            values = dict(v.values)
            example = {**arguments, **values, **self._resized(arguments, given, values)}
            a, kw = self._sig.assemble(example)
            try:
                v.runner.capture_all(*a, **kw)
            except BaseException as exc:
                exc.add_note(f"graphctl: raised while capturing variant {v.label}; no variant was kept")
                raise

    def _resized(self, arguments: dict[str, Any], given: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
        """The example's static inputs with as many items for ``values`` as they hold for the
        example's own variant values (rows repeated cyclically where the variant needs more)."""
        out = {}
        for si in self.options.inputs or ():
            if si.per_item_of is None:
                continue
            t = arguments[si.name]
            have: StaticInput = si.resolved(given)
            want = si.resolved(values).per_item
            if not isinstance(t, torch.Tensor) or t.dim() <= si.dim or t.shape[si.dim] % have.per_item:
                continue  # the sub-runner's own check names what is wrong with it
            n = t.shape[si.dim] // have.per_item
            idx = torch.arange(n * want, device=t.device) % max(t.shape[si.dim], 1)
            out[si.name] = t.index_select(si.dim, idx)
        return out

    def units(self) -> tuple[Unit, ...]:
        return self.variants

    def _own_fallbacks(self) -> dict[str, int]:
        return dict(self._fallbacks)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._captured:
            self.capture_all(*args, **kwargs)
        get = self._sig.get
        values = [get(args, kwargs, n) for n in self._names]
        if any(v is inspect.Parameter.empty for v in values):
            self._sig.bind(args, kwargs)  # a variant argument left out: the TypeError Python would raise
        try:
            v = self._by_key.get(tuple(variant_key(x) for x in values))
        except TypeError:  # an unhashable value (a list): no variant, named below
            v = None
        if v is None:
            return self._unlisted(args, kwargs)
        try:
            return v.runner(*args, **kwargs)
        except ReplayError as exc:  # free when nothing is raised: say which variant refused
            exc.add_note(f"graphctl: in variant {v.label}")
            raise

    def _unlisted(self, args: tuple, kwargs: dict) -> Any:
        assert self.options.variants is not None
        for name, values in self.options.variants:
            live = self._sig.get(args, kwargs, name)
            listed = [v for v, _ in values]
            try:
                known = variant_key(live) in {variant_key(x) for x in listed}
            except TypeError:
                known = False
            if not known:
                break
        err = ReplayError("a variant value with no graphs", buffer=name, expected=f"one of {listed!r}",
                          found=f"{type(live).__name__} {live!r}"[:120],
                          fix="add the value to variants= (and capture again)" +
                          (", or pass fallback='eager'" if self.options.fallback == "error" else ""))
        if self.options.fallback == "error":
            raise err
        reason = f"[{name}] {err.what}"
        self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
        log.warning("graphctl: %s runs eagerly: %s", name_of(self.fn), err)
        return self.fn(*args, **kwargs)

    def runner(self, **values: Any) -> GraphRunner:
        """The runner of one combination, by argument name (``runner(k=3)``)."""
        key = tuple(variant_key(values.get(n)) for n in self._names)
        if set(values) != set(self._names) or key not in self._by_key:
            raise KeyError(f"no variant {values!r}; variants: {[v.label for v in self.variants]}")
        return self._by_key[key].runner

    def reset(self) -> None:
        """Drop every variant's graphs; the next call captures again."""
        for v in self.variants:
            v.runner.reset()
        self._pool = SharedPool()
        for v in self.variants:  # a fresh pool: the dropped graphs' blocks go back to the allocator
            v.runner.options = dataclasses.replace(v.runner.options, pool=self._pool)
        self._captured = False

    # -------------------------------------------------------------- what the capture says

    state = property(lambda self: self.variants[0].runner.state)
    buckets = property(lambda self: self.options.buckets)
    fallback = property(lambda self: self.options.fallback)

    captured = RunnerFace.keys  # (variant label, bucket) of every graph: declared order, buckets smallest first

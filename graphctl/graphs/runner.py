"""The graph runner: buckets, static inputs, two-pass capture, transactional replay.

A :class:`GraphRunner` wraps a forward function. ``capture_all(*example)`` (or the first call)
warms every bucket up eagerly, then captures from the largest bucket down into one shared
pool; a call with a batch of ``n`` then picks the smallest bucket ``>= n``, copies the live
inputs into the static ones, pads every declared tail, checks the address manifest, replays
(inside ``state.switch("draft", phase="refresh")``, the draft twins' refreshes, when the capture
holds a draft segment) and returns the outputs sliced to ``n``. ``refresh`` rather than
``replay``: a ``replay`` switch also snapshots the ``mutable`` buffers and would undo, on exit,
what the graph itself wrote to them.

Constraints (each is checked, and a violation raises a typed error):

- The forward must be capturable: static shapes per bucket, no host reads of device values,
  no allocation that later calls expect to see; the emulated backend names the offending
  file:line. Non-input arguments are frozen at capture: a later call must pass the same
  objects (tensors at the same address, equal scalars) or get ``ReplayError``.
- Inside the forward, enter the draft role with ``state.switch("draft")`` (phase ``auto``):
  warmups run it eagerly, the capture records it, eager fallbacks run it eagerly.
- Buffers declared ``mutable`` are snapshotted before every warmup, capture and measuring
  run and restored after it, so those runs never accumulate into live state.
- Returned tensors are views of the graph's static outputs: the next call overwrites them;
  clone what you keep. The forward must not write its static inputs.
- One runner per device; graphs share one memory pool and are captured largest first, so
  only replay them in any order when the forward frees nothing it allocated (the usual case
  for a forward whose outputs are kept by the graph).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import time
import types
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphctl.debug import knobs
from graphctl.errors import CaptureError, DeclarationError, ReplayError
from graphctl.graphs.backends import select_backend
from graphctl.graphs.cuda import refuse_nested_capture
from graphctl.graphs.distributed import Agreement, agreed_switch
from graphctl.graphs.effects import Ledger, SideEffect, reachable, roots_of, storage_key
from graphctl.graphs.nodes import Region
from graphctl.graphs.frozen import first_change, freeze
from graphctl.graphs.inputs import DEFAULT_BUCKETS, Buckets, InputSlot, StaticInput
from graphctl.graphs.report import Segment
from graphctl.graphs.inspection import Inspection
from graphctl.state import BoundState, bind

__all__ = ["GraphRunner"]

log = logging.getLogger("graphctl")


class _Captured:
    """One bucket's graph and everything its replay relies on."""

    __slots__ = ("graph", "out_flat", "out_spec", "out_rows", "single", "manifest", "segments", "draft",
                 "checked", "capture_ms", "replays", "replay_us", "eager_us", "_sliced")

    def __init__(self, graph, out, bucket: int, manifest: dict[str, int], segments: tuple[Segment, ...],
                 capture_ms: float, per_items: frozenset[int]) -> None:
        self.graph = graph
        self.out_flat, self.out_spec = tree_flatten(out)
        self.single = isinstance(out, torch.Tensor)
        # Rows per batch item of each output's first dim, or None: that output is not sliced. An
        # output is batched when its first dim is bucket * r, r = 1 or the per_item of a static input (and,
        # across buckets, with the same per_item: see GraphRunner._settle_slicing); never because
        # the first dim merely divides by the bucket (a [256] per-vocab output at bucket 4).
        self.out_rows = tuple(t.shape[0] // bucket if isinstance(t, torch.Tensor) and t.dim() and
                              t.shape[0] % bucket == 0 and t.shape[0] // bucket in per_items else None
                              for t in self.out_flat)
        self.manifest = manifest
        self.segments = segments
        self.draft = any(s.name.startswith("draft") for s in segments)
        self.checked = False
        self.capture_ms = capture_ms
        self.replays = 0
        self.replay_us: float | None = None
        self.eager_us: float | None = None
        self._sliced: dict[int, Any] = {}

    def outputs(self, n: int) -> Any:
        """The static outputs sliced to ``n`` items (views, built once per ``n``)."""
        out = self._sliced.get(n)
        if out is None:
            if self.single:
                r = self.out_rows[0]
                out = self.out_flat[0] if r is None else self.out_flat[0][: n * r]
            else:
                leaves = [t if r is None else t[: n * r] for t, r in zip(self.out_flat, self.out_rows)]
                out = tree_unflatten(leaves, self.out_spec)
            self._sliced[n] = out
        return out


class _Guard:
    """Snapshot some of a state's buffers on entry and put them back on exit (the snapshot
    storage is allocated once, at construction)."""

    def __init__(self, state: BoundState | None, names: Callable[[BoundState], Sequence[str]],
                 extra: Sequence[torch.Tensor] = ()) -> None:
        self._live = ([state.tensor(n) for n in names(state)] if state is not None else []) + list(extra)
        self._saved = [t.clone() for t in self._live]
        self._declared = len(self._live) - len(extra)  # the state's buffers come first

    def add(self, tensors: Sequence[torch.Tensor]) -> None:
        """Guard ``tensors`` too, from their contents now."""
        self._live += list(tensors)
        self._saved += [t.clone() for t in tensors]

    def adopt(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Guard each ``(live, copy)`` with the copy given (already the contents to restore)."""
        self._live += [live for live, _ in pairs]
        self._saved += [copy for _, copy in pairs]

    def __enter__(self) -> "_Guard":
        for s, t in zip(self._saved, self._live):
            s.copy_(t)
        return self

    def restore(self, added_only: bool = False) -> None:
        """Put everything back, or (``added_only``) only what is not a buffer of the state:
        side effects, without undoing a bucket's padding of the state."""
        start = self._declared if added_only else 0
        for s, t in zip(self._saved[start:], self._live[start:]):
            t.copy_(s)

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            self.restore()


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    # A collection during capture can run __del__ of tensors (frees inside the capture's pool)
    # and costs seconds across many buckets; collect once, then hold it off.
    gc.collect()
    was = gc.isenabled()
    try:  # disable inside the try: a Ctrl-C right after it must still re-enable collection
        gc.disable()
        yield
    finally:
        if was:
            gc.enable()


class GraphRunner(Inspection):
    """Captured graphs of ``fn``, one per bucket. Build it with :func:`graphctl.graphed`.

    Arguments: ``buckets`` (batch sizes to capture), ``state`` (a :class:`BoundState`, an
    object to bind, or on a decorated method the name of the instance attribute holding the
    metadata: each instance gets its own runner), ``inputs`` (argument names or :class:`StaticInput`; ``None``: every
    tensor argument, batch on dim 0), ``backend`` (``auto``, ``cuda``, ``emulated``),
    ``fallback`` (``"error"``: a batch that no graph can serve raises ``ReplayError``;
    ``"eager"``: it runs ``fn`` eagerly and logs why), ``pad_axes`` (state axis -> rows per
    batch item for ``state.pad``; default ``{"seq": 1, "token": <first input's per_item>}``),
    ``warmup_iters`` (eager runs per bucket before capture), ``progress`` (a progress bar;
    ``None``: when stderr is a terminal), ``params`` (the model tensors the forward reads, for
    the audit: an ``nn.Module``, a name -> tensor mapping or an iterable), ``group`` (a
    ``torch.distributed`` process group, e.g. ``dist.group.WORLD``: before each call the ranks
    agree on the bucket (the largest batch over ranks) and on falling back together, and the
    replay's refresh switch is entered on every rank or on none; see ``graphs/distributed.py``).
    See the module docstring for the constraints."""

    def __init__(self, fn: Callable[..., Any], *, buckets: Sequence[int] = DEFAULT_BUCKETS, state: Any = None,
                 inputs: Sequence[str | StaticInput] | None = None, backend: str = "auto", fallback: str = "error",
                 pad_axes: Mapping[str, int] | None = None, warmup_iters: int = 2, progress: bool | None = None,
                 params: Any = None, group: Any = None, side_effects: str = "restore",
                 max_side_effect_bytes: int | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._options = dict(buckets=buckets, state=state, inputs=inputs, backend=backend, fallback=fallback,
                             pad_axes=pad_axes, warmup_iters=warmup_iters, progress=progress,
                             params=params, group=group, side_effects=side_effects,
                             max_side_effect_bytes=max_side_effect_bytes)
        self.buckets = Buckets(buckets)
        self._ledger = Ledger(side_effects, max_side_effect_bytes)  # found by each bucket's first warmup
        # state="attr" names the instance's metadata when a method is decorated (see __get__)
        self._state_attr = state if isinstance(state, str) else None
        if state is None or self._state_attr is not None:
            self.state = None  # a method's state is bound per instance, in __get__
        else:
            self.state = state if isinstance(state, BoundState) else bind(state)
        if fallback not in ("error", "eager"):
            raise DeclarationError("unknown fallback", expected="'error' or 'eager'", found=fallback,
                                   fix="fallback='eager' runs unservable batches eagerly (logged); 'error' raises")
        self.fallback = fallback
        self.backend_name = backend
        self.warmup_iters = int(warmup_iters)
        self.progress = progress
        self.params = params  # model tensors for the audit's classification (see audit())
        self.group = group  # a torch.distributed group: ranks agree on bucket, fallback and refresh
        self._agreement: Agreement | None = None
        self._sig = inspect.signature(fn)
        self._params = list(self._sig.parameters)
        self._pos = {p: i for i, p in enumerate(self._params)}
        # With *args/**kwargs in the signature an argument's position is not fixed: bind fully.
        self._simple = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in self._sig.parameters.values())
        self._n_required = sum(1 for p in self._sig.parameters.values() if p.default is p.empty)
        self._declared = None if inputs is None else tuple(StaticInput.of(i) for i in inputs)
        self._inputs: tuple[StaticInput, ...] | None = self._declared
        for si in self._declared or ():
            if si.name not in self._pos:
                raise DeclarationError("static input is not a parameter of the forward", buffer=si.name,
                                       expected=f"one of {self._params}", found=si.name, fix="fix the name in inputs=")
        self._pad_axes = dict(pad_axes) if pad_axes is not None else None
        self._graphs: dict[int, _Captured] = {}
        self._slots: tuple[InputSlot, ...] = ()
        self._in_pos: tuple[int, ...] = ()
        self._frozen: dict[str, Any] = {}
        self._fallbacks: dict[str, int] = {}
        self._backend: Any = None
        self._refreshes = False
        self._guard: _Guard | None = None
        self._example: tuple[tuple, dict] | None = None
        self.workspaces: tuple[Region, ...] = ()

    @property
    def side_effects(self) -> tuple[SideEffect, ...]:
        """What the forward writes that graphctl does not own (see ``graphs/effects.py``)."""
        return self._ledger.effects

    @property
    def side_effect_policy(self) -> str:
        return self._ledger.policy

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        """A decorated method gets one runner per instance (its own graphs, inputs and state)."""
        if obj is None:
            return self
        key = f"_graphctl_runner_{self.fn.__name__}"
        runner = obj.__dict__.get(key)
        if runner is None:
            opts = dict(self._options)
            if self._state_attr is not None:
                opts["state"] = getattr(obj, self._state_attr)
            runner = obj.__dict__[key] = GraphRunner(types.MethodType(self.fn, obj), **opts)
        return runner

    # ------------------------------------------------------------------------ arguments

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        try:
            ba = self._sig.bind(*args, **kwargs)
        except TypeError as exc:  # a missing, extra or unknown argument: say it as Python would
            raise TypeError(f"{getattr(self.fn, '__qualname__', self.fn)}(): {exc}") from None
        ba.apply_defaults()
        return ba.arguments

    def _arg(self, args: tuple, kwargs: dict, name: str) -> Any:
        if not self._simple:
            return self._arguments(args, kwargs).get(name)
        i = self._pos[name]
        if i < len(args):
            return args[i]
        if name in kwargs:
            return kwargs[name]
        return self._sig.parameters[name].default

    def _batch(self, args: tuple, kwargs: dict) -> tuple[int, list[Any]]:
        # The usual call is positional with every required argument given; anything else binds
        # fully, so a missing or unknown argument raises TypeError naming it.
        if not kwargs and self._simple and self._n_required <= len(args) <= len(self._params):
            lives = [args[i] if i < len(args) else self._sig.parameters[self._params[i]].default
                     for i in self._in_pos]
        else:
            arguments = self._arguments(args, kwargs)
            lives = [arguments[si.name] for si in self._inputs]
        first, live = self._inputs[0], lives[0]
        if not isinstance(live, torch.Tensor) or live.dim() <= first.dim or live.shape[first.dim] % first.per_item:
            raise ReplayError("cannot read the batch size from the first static input", buffer=first.name,
                              expected=f"a tensor with a multiple of {first.per_item} rows along dim {first.dim}",
                              found=tuple(live.shape) if isinstance(live, torch.Tensor) else type(live).__name__,
                              fix="pass whole batch items (per_item rows each)")
        return live.shape[first.dim] // first.per_item, lives

    def _call_args(self, arguments: dict[str, Any], bucket: int) -> tuple[tuple, dict]:
        views = {slot.spec.name: slot.spec.view(slot.static, bucket) for slot in self._slots}
        return self._assemble({**arguments, **views})

    def _assemble(self, values: dict[str, Any]) -> tuple[tuple, dict]:
        args, kwargs = [], {}
        for name, p in self._sig.parameters.items():
            if name not in values:
                continue
            v = values[name]
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                args.append(v)
            elif p.kind is p.VAR_POSITIONAL:
                args.extend(v)
            elif p.kind is p.VAR_KEYWORD:
                kwargs.update(v)
            else:
                kwargs[name] = v
        return tuple(args), kwargs

    # -------------------------------------------------------------------------- capture

    def _setup(self, arguments: dict[str, Any]) -> int:
        if self._state_attr is not None:
            raise DeclarationError(f"state='{self._state_attr}' names an attribute of an instance",
                                   expected="a decorated method called on an instance", found="a plain call",
                                   fix="decorate a method (each instance gets its runner), or pass the state itself")
        if self._inputs is None:
            self._inputs = tuple(StaticInput(n) for n, v in arguments.items() if isinstance(v, torch.Tensor))
        if not self._inputs:
            raise DeclarationError("the forward has no static input", expected="at least one tensor argument",
                                   found=list(arguments), fix="declare inputs=('input_ids', ...)")
        self._slots = tuple(InputSlot(si, si.allocate(arguments[si.name], self.buckets.largest))
                            for si in self._inputs)
        self._in_pos = tuple(self._pos[si.name] for si in self._inputs)
        first = self._inputs[0]
        if self._pad_axes is None:
            self._pad_axes = {"seq": 1, "token": first.per_item}
        device = self._slots[0].device
        self._backend = select_backend(self.backend_name, device)
        self._guard = _Guard(self.state, BoundState.mutable_names)
        # the replay-time refreshes of draft twins; a spec without any needs no switch around replay
        self._refreshes = self.state is not None and bool(self.state.snapshot_names("refresh"))
        static_names = {si.name for si in self._inputs}
        # Non-input arguments are baked into the graph: keep each object and a structural copy of
        # what it held (containers are compared by contents at every call: an in-place change
        # to a dict or list passed here would otherwise replay capture-time values silently).
        self._frozen = {n: (v, freeze(v)) for n, v in arguments.items() if n not in static_names}
        n, lives = self._batch((), arguments)
        for slot, live in zip(self._slots, lives):
            err = slot.spec.check(live, slot.static, n)
            if err is not None:
                raise err
        return n

    def _load(self, lives: list[torch.Tensor], n: int, bucket: int) -> None:
        for slot, live in zip(self._slots, lives):
            slot.load(live, n, bucket)
        if self.state is not None and n != bucket:  # the graph reads [:bucket]: pad [n:bucket]
            self.state.pad({a: n * m for a, m in self._pad_axes.items()},
                           {a: bucket * m for a, m in self._pad_axes.items()})

    def _head(self, arguments: dict[str, Any], m: int) -> dict[str, torch.Tensor]:
        """The example's static inputs cut to their first ``m`` items, in input order."""
        return {si.name: arguments[si.name].narrow(si.dim, 0, m * si.per_item) for si in self._inputs}

    def _load_example(self, arguments: dict[str, Any], n: int, bucket: int) -> None:
        m = min(n, bucket)
        self._load(list(self._head(arguments, m).values()), m, bucket)

    def capture_all(self, *args: Any, **kwargs: Any) -> "GraphRunner":
        """Warm every bucket up eagerly, then capture them largest first into one pool. With
        ``group``, every rank must call it (the same buckets, in the same order: the forward's
        collectives are warmed up and captured in step).

        The example call fixes dtypes, devices, non-batch dims and every non-input argument;
        its first ``min(n, bucket)`` items fill each bucket's inputs, the rest is padding."""
        refuse_nested_capture()  # before anything is allocated or warmed up: a capture would record it
        if self.group is not None and self._agreement is None:
            self._agreement = Agreement(self.group)
        if self._graphs:
            raise CaptureError("graphs are already captured", expected="one capture_all per runner",
                               found=f"buckets {sorted(self._graphs)}", fix="call reset() first to capture again")
        try:
            self._capture_all(args, kwargs)
        except BaseException:
            self.reset()  # never keep some buckets of a failed capture_all: a call would find holes
            raise
        return self

    def _capture_all(self, args: tuple, kwargs: dict) -> None:
        arguments = self._arguments(args, kwargs)
        n = self._setup(arguments)
        self._example = (args, kwargs)
        be = self._backend
        order = sorted(self.buckets.sizes, reverse=True)
        # Loading a bucket's example pads the state for it: each bucket starts from the caller's
        # state (a smaller bucket's padding would otherwise turn live rows of a larger one into
        # padding), and the caller gets it back as it was.
        with _Guard(self.state, BoundState.restorable_names) as given, _gc_frozen(), self._progress() as bar:
            task = bar.add_task("warmup", total=2 * len(order)) if bar else None
            be.synchronize()
            before = be.live_blocks()
            for i, b in enumerate(order):  # pass 1: every workspace reaches its high-water mark before any capture
                given.restore()
                self._load_example(arguments, n, b)
                call = self._call_args(arguments, b)
                for it in range(self.warmup_iters):
                    try:
                        with self._guard:
                            if it == 0:  # a bucket's first run finds its side effects (and undoes them)
                                given.adopt(self._tracked_warmup(arguments, call))
                            else:
                                be.warmup(lambda: self.fn(*call[0], **call[1]))
                    except BaseException as exc:
                        exc.add_note(f"graphctl: raised while warming up bucket {b}; the caller's state was restored")
                        raise
                    if self._ledger.tensors:  # the next run starts from the caller's state too
                        given.restore(added_only=True)
                if bar:
                    bar.update(task, advance=1, description=f"warmup bucket {b}")
            be.synchronize()
            # what warmup allocated and kept is library state (cuBLAS workspaces): the audit's "workspace"
            self.workspaces = tuple(Region(f"warmup allocation of {n} B", "workspace", a, a + n)
                                    for a, n in sorted(be.live_blocks() - before))
            pool = be.new_pool()
            t_start = time.perf_counter()
            for b in order:  # pass 2: largest first, so smaller graphs reuse its pool blocks
                given.restore()
                self._load_example(arguments, n, b)
                self._capture_one(b, arguments, pool)
                if bar:
                    pool_mib = sum(c.graph.pool_bytes for c in self._graphs.values()) / 2**20
                    bar.update(task, advance=1, description=f"captured bucket {b} "
                               f"({time.perf_counter() - t_start:.1f}s, pool {pool_mib:.1f} MiB)")
            self._settle_slicing()

    def _tracked_warmup(self, arguments: dict[str, Any], call: tuple[tuple, dict]) -> list:
        """An eager run under the write tracker: what it writes to tensors the forward reaches
        but graphctl does not own is a side effect. Returns the new ``(live, copy)`` pairs."""
        owned = {storage_key(slot.static) for slot in self._slots}
        if self.state is not None:
            owned |= {storage_key(self.state.tensor(n)) for n in self.state.plan.buffers}
            owned |= {storage_key(t) for t in self.state.arenas().values()}
        be = self._backend
        pairs = self._ledger.track(lambda: be.warmup(lambda: self.fn(*call[0], **call[1])),
                                   reachable(roots_of(self.fn, arguments, self.params)), owned, be.synchronize)
        if pairs:
            log.info("graphctl: %s writes state it does not own (restored around every warmup, capture, measure "
                     "and verify run, %d B of snapshots): %s", getattr(self.fn, "__qualname__", self.fn),
                     self._ledger.nbytes, "; ".join(map(str, self.side_effects)))
        return pairs

    def guard_all(self) -> _Guard:
        """A snapshot of everything a run of the forward may change that the caller owns: every
        declared buffer but Stable scratch, and the side effects being restored."""
        return _Guard(self.state, BoundState.restorable_names, self._ledger.tensors)

    def _capture_one(self, bucket: int, arguments: dict[str, Any], pool: Any) -> None:
        call = self._call_args(arguments, bucket)
        marks: list[tuple[str, int]] = []

        def body(mark: Callable[[], int]) -> Any:
            def observe(role: str, phase: str, event: str) -> None:
                if phase == "capture":
                    marks.append((event, mark()))
            if self.state is None:
                return self.fn(*call[0], **call[1])
            with self.state.observe(observe):
                return self.fn(*call[0], **call[1])

        t0 = time.perf_counter()
        with self._guard:
            graph, out = self._backend.capture(body, pool, bucket)
        ms = (time.perf_counter() - t0) * 1e3
        self._graphs[bucket] = _Captured(graph, out, bucket, self._manifest(),
                                         _segments(marks, graph.node_count), ms,
                                         frozenset({1} | {si.per_item for si in self._inputs}))

    def _settle_slicing(self) -> None:
        """An output is sliced only where every bucket agrees it is batched, at one per_item: a
        first dim that equals bucket * per_item in one bucket only is a coincidence."""
        caps = list(self._graphs.values())
        for i in range(len(caps[0].out_rows)):
            rows = {c.out_rows[i] if i < len(c.out_rows) else None for c in caps}
            if len(rows) > 1 or (len(caps) > 1 and None in rows):
                for c in caps:
                    if i < len(c.out_rows):
                        c.out_rows = c.out_rows[:i] + (None,) + c.out_rows[i + 1:]

    def _manifest(self) -> dict[str, int]:
        man = self._input_addresses()
        if self.state is not None:
            man.update(self.state.addresses())
        return man

    def _input_addresses(self) -> dict[str, int]:
        # every bucket's view starts at its static buffer's first byte
        return {f"input:{slot.spec.name}": slot.static.data_ptr() for slot in self._slots}

    def _progress(self):
        show = self.progress
        if show is None:
            import sys
            show = sys.stderr.isatty()
        if not show:
            return contextlib.nullcontext(None)
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        return Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(), transient=True)

    def reset(self) -> None:
        """Drop every graph (and the static inputs); the next call captures again."""
        self._graphs.clear()
        self._ledger.clear()
        self._slots, self._in_pos = (), ()
        self._inputs = self._declared
        self._example = None
        self.workspaces = ()

    # --------------------------------------------------------------------------- replay

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._graphs:
            self.capture_all(*args, **kwargs)
        n, lives = self._batch(args, kwargs)
        err, agreed = self._check_call(n, lives, args, kwargs), n
        if self.group is not None:  # every rank replays one bucket, or every rank runs eagerly
            agreed, all_ok = self._agreement.agree(n, err is None)
            if err is None and not all_ok:
                err = ReplayError("a peer rank cannot replay this call", expected="every rank servable",
                                  found=f"this rank n = {n}, largest n over ranks = {agreed}",
                                  fix="see the peer rank's log for its reason; all ranks run eagerly together")
            elif err is None and self.buckets.pick(agreed) is None:
                err = ReplayError("batch size outside the captured buckets (on a peer rank)",
                                  expected=f"1 <= n <= {self.buckets.largest} on every rank",
                                  found=f"largest n over ranks = {agreed}", fix="add a larger bucket")
        if err is not None:
            return self._unservable(args, kwargs, err)
        bucket = self.buckets.pick(agreed)
        cap = self._graphs[bucket]
        if self.state is not None:
            self.state.check_usable()  # a poisoned state never replays, with or without a refresh
        if not cap.checked or knobs.check_manifest:  # before loading: never pad into a moved buffer
            self._check_manifest(cap)
        self._load(lives, n, bucket)
        self._replay(cap)
        return cap.outputs(n)

    def _check_call(self, n: int, lives: list[Any], args: tuple, kwargs: dict) -> ReplayError | None:
        """Why this rank cannot replay this call, or None."""
        if self.buckets.pick(n) is None:
            return ReplayError("batch size outside the captured buckets", expected=f"1 <= n <= {self.buckets.largest}",
                               found=f"n = {n}", fix="add a larger bucket, split the batch, or pass fallback='eager'")
        for slot, live in zip(self._slots, lives):
            if not slot.fits(live, n):
                return slot.spec.check(live, slot.static, n)
        if self._frozen:
            return self._check_frozen(args, kwargs)
        return None

    def _replay(self, cap: _Captured) -> None:
        if cap.draft and self._refreshes:
            if self.group is not None:  # a refresh that fails on one rank restores on all, before any replay
                with agreed_switch(self.state, "draft", self._agreement, phase="refresh"):
                    cap.graph.replay()
            else:
                with self.state.switch("draft", phase="refresh"):
                    cap.graph.replay()
        else:
            cap.graph.replay()
        cap.replays += 1

    def _unservable(self, args: tuple, kwargs: dict, err: ReplayError) -> Any:
        if self.fallback == "error":
            raise err
        # counted by kind (err.what: "batch size outside the captured buckets"), logged in full
        reason = f"[{err.buffer}] {err.what}" if err.buffer else err.what
        self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
        log.warning("graphctl: %s runs eagerly: %s", getattr(self.fn, "__qualname__", self.fn), err)
        return self.fn(*args, **kwargs)

    def _check_frozen(self, args: tuple, kwargs: dict) -> ReplayError | None:
        for name, (want, frozen) in self._frozen.items():
            live = self._arg(args, kwargs, name)
            if live is want and frozen[0] in ("scalar", "object"):  # nothing inside it can have changed
                continue
            where = first_change(freeze(live), frozen, name)
            if where is None:
                continue
            what = ("a frozen argument was changed in place since the capture" if live is want
                    else "a frozen argument differs from the capture")
            return ReplayError(what, buffer=where[0],
                               expected=f"{where[1]} (baked into the graph)", found=where[2],
                               fix="pass the captured object unchanged, declare the argument in inputs=, or reset() "
                                   "and capture again")
        return None

    def _check_manifest(self, cap: _Captured) -> None:
        live = self._input_addresses()
        if self.state is not None:
            live.update(self.state.live_addresses())
        for name, want in cap.manifest.items():
            got = live.get(name)
            if got != want:
                raise ReplayError("static buffer moved since capture", buffer=name, expected=f"{want:#x}",
                                  found="not a tensor" if got is None else f"{got:#x}",
                                  fix="write into the buffer in place (state.write / copy_) instead of rebinding "
                                      "it, or reset() and capture again")
        cap.checked = True

def _segments(marks: list[tuple[str, int]], total: int) -> tuple[Segment, ...]:
    """Turn switch enter/exit marks into named segments: target, draft (or draft[i]), post."""
    segs, cursor, drafts = [], 0, sum(1 for e, _ in marks if e == "enter")
    i = 0
    for event, at in marks:
        if event == "enter":
            if at > cursor or not segs:
                segs.append(Segment("target" if i == 0 else "post", cursor, at))
            cursor = at
        else:
            segs.append(Segment("draft" if drafts == 1 else f"draft[{i}]", cursor, at))
            cursor, i = at, i + 1
    if total > cursor or not segs:
        segs.append(Segment("target" if not marks else "post", cursor, max(total, cursor)))
    return tuple(segs)

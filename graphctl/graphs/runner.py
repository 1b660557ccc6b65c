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

import dataclasses
import functools
import inspect
import logging
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from graphctl.errors import CaptureError, DeclarationError, ReplayError
from graphctl.graphs import measure as _measure
from graphctl.graphs.analysis.audit import Audit, audit_graph, param_tensors
from graphctl.graphs.analysis.confirm import confirm as _confirm
from graphctl.graphs.analysis.nodes import Node, Region, census
from graphctl.graphs.analysis.report import BucketReport, Report, Segment
from graphctl.graphs.analysis.verify import VerifyResult
from graphctl.graphs.analysis.verify import verify as _verify
from graphctl.graphs.backends.cuda import refuse_nested_capture
from graphctl.graphs.calls import Signature, frozen_change
from graphctl.graphs.capture import Fixed, Passes, capture_buckets, written
from graphctl.graphs.captured import Captured
from graphctl.graphs.distributed import Agreement, agreed_switch
from graphctl.graphs.effects import Ledger, SideEffect
from graphctl.graphs.hoststate import HostChange
from graphctl.graphs.hoststate import check_policy as check_host_policy
from graphctl.graphs.inputs import DEFAULT_BUCKETS, Buckets, StaticInput
from graphctl.graphs.rebinding import PathCheck, check_option, first_moved
from graphctl.graphs.repoint import repoint
from graphctl.knobs import knobs
from graphctl.state import BoundState, bind
from graphctl.state.snapshot import Snapshot

__all__ = ["GraphRunner"]

log = logging.getLogger("graphctl")
_KNOBS = knobs.live()  # a plain dict lookup on the call path (a knob attribute goes through __getattr__)


class GraphRunner:
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
    replay's refresh switch is entered on every rank or on none; see ``graphs/distributed.py``),
    ``check_paths`` (re-resolve before each replay the paths to tensors the forward reached;
    ``None``: as ``GRAPHCTL_CHECK_PATHS`` says at each call). See the module docstring for the constraints."""

    def __init__(self, fn: Callable[..., Any], *, buckets: Sequence[int] = DEFAULT_BUCKETS, state: Any = None,
                 inputs: Sequence[str | StaticInput] | None = None, backend: str = "auto", fallback: str = "error",
                 pad_axes: Mapping[str, int] | None = None, warmup_iters: int = 2, progress: bool | None = None,
                 params: Any = None, group: Any = None, side_effects: str = "restore",
                 max_side_effect_bytes: int | None = None, host_state: str = "warn",
                 copy_outputs: bool = False, check_paths: bool | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._options = dict(buckets=buckets, state=state, inputs=inputs, backend=backend, fallback=fallback,
                             pad_axes=pad_axes, warmup_iters=warmup_iters, progress=progress,
                             params=params, group=group, side_effects=side_effects,
                             max_side_effect_bytes=max_side_effect_bytes, host_state=host_state,
                             copy_outputs=copy_outputs, check_paths=check_paths)
        self.buckets = Buckets(buckets)
        self._ledger = Ledger(side_effects, max_side_effect_bytes)  # found by each bucket's first warmup
        check_host_policy(host_state)
        self.host_state = host_state
        self.copy_outputs = bool(copy_outputs)  # fresh tensors per call instead of views (graphs/stale.py)
        self.check_paths = check_option(check_paths)  # None: GRAPHCTL_CHECK_PATHS decides at each call
        self.host_changes: tuple[HostChange, ...] = ()  # what capture_all's passes changed (graphs/hoststate.py)
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
        self._sig = Signature(fn)
        self._declared = None if inputs is None else tuple(StaticInput.of(i) for i in inputs)
        for si in self._declared or ():
            if si.name not in self._sig.position:
                raise DeclarationError("static input is not a parameter of the forward", buffer=si.name,
                                       expected=f"one of {self._sig.names}", found=si.name,
                                       fix="fix the name in inputs=")
        self._pad_axes = dict(pad_axes) if pad_axes is not None else None
        self._fixed: Fixed | None = None  # None: nothing captured (see graphs/capture.py)
        self._paths: list[PathCheck] = []  # tensors reached through the arguments, checked per replay
        self._graphs: dict[int, Captured] = {}
        self._fallbacks: dict[str, int] = {}
        self._streak = 0  # calls since the last replay, all eager (a bypassed runner: see _unservable)
        self.workspaces: tuple[Region, ...] = ()
        self._compiled: tuple[tuple[str, ...], dict[int, dict[str, int]]] = ((), {})

    @property
    def side_effects(self) -> tuple[SideEffect, ...]:
        """What the forward writes that graphctl does not own (see ``graphs/effects.py``)."""
        return self._ledger.effects

    side_effect_policy = property(lambda self: self._ledger.policy)

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

    # ------------------------------------------------------------------------ the call

    def _batch(self, inputs: tuple[StaticInput, ...], positions: tuple[int, ...] | None, args: tuple,
               kwargs: dict) -> tuple[int, list[Any]]:
        # the usual call is positional; anything else binds fully (TypeError naming a bad argument)
        lives = self._sig.positional(args, kwargs, positions) if positions is not None else None
        if lives is None:
            arguments = self._sig.bind(args, kwargs)
            lives = [arguments[si.name] for si in inputs]
        first, live = inputs[0], lives[0]
        if not isinstance(live, torch.Tensor) or live.dim() <= first.dim or live.shape[first.dim] % first.per_item:
            raise ReplayError("cannot read the batch size from the first static input", buffer=first.name,
                              expected=f"a tensor with a multiple of {first.per_item} rows along dim {first.dim}",
                              found=tuple(live.shape) if isinstance(live, torch.Tensor) else type(live).__name__,
                              fix="pass whole batch items (per_item rows each)")
        return live.shape[first.dim] // first.per_item, lives

    def _call_args(self, arguments: dict[str, Any], bucket: int) -> tuple[tuple, dict]:
        views = {slot.spec.name: slot.spec.view(slot.static, bucket) for slot in self._fixed.slots}
        return self._sig.assemble({**arguments, **views})

    def _load(self, lives: Sequence[torch.Tensor], n: int, bucket: int) -> None:
        fx = self._fixed
        for slot, live in zip(fx.slots, lives):
            slot.load(live, n, bucket)
        if self.state is not None and n != bucket:  # the graph reads [:bucket]: pad [n:bucket]
            self.state.pad({a: n * m for a, m in fx.pad_axes.items()},
                           {a: bucket * m for a, m in fx.pad_axes.items()})

    def _load_example(self, arguments: dict[str, Any], n: int, bucket: int) -> None:
        m = min(n, bucket)
        self._load(list(self._fixed.head(arguments, m).values()), m, bucket)

    # -------------------------------------------------------------------------- capture

    def capture_all(self, *args: Any, **kwargs: Any) -> GraphRunner:
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
        if self._state_attr is not None:
            raise DeclarationError(f"state='{self._state_attr}' names an attribute of an instance",
                                   expected="a decorated method called on an instance", found="a plain call",
                                   fix="decorate a method (each instance gets its runner), or pass the state itself")
        try:
            arguments = self._sig.bind(args, kwargs)
            self._fixed = Fixed.make(self._sig, arguments, args, kwargs, declared=self._declared,
                                     pad_axes=self._pad_axes, largest=self.buckets.largest, backend=self.backend_name,
                                     state=self.state, batch=lambda inputs, a: self._batch(inputs, None, (), a))
            passes = Passes(self.fn, self._fixed, self.state, self._ledger, self.buckets, self.warmup_iters,
                            self.params, self._load_example, self._call_args, self._manifest, self.progress,
                            self.host_state)
            r = capture_buckets(passes, arguments, self._sig.get)
            self._graphs, self.workspaces, self.host_changes, self._paths = r.graphs, r.workspaces, r.host_changes, \
                r.paths
            self._compiled = (r.sites, r.compile)  # torch.compile: reached callables, dynamo's work per bucket
        except BaseException:
            self.reset()  # never keep some buckets of a failed capture_all: a call would find holes
            raise
        return self

    def repoint(self, state: BoundState) -> dict[int, int]:
        """Re-point every graph at ``state``, bound again after buffers moved (``graphs/repoint.py``)."""
        return repoint(self, state)

    def pad_state(self, n: int) -> None:  # rows past n by policy, as a caller's prepare does
        if self.state is not None:
            self.state.pad({a: n * m for a, m in self._captured_or_raise("pad_state").pad_axes.items()})

    def guard_all(self) -> Snapshot:
        """A snapshot of everything a run of the forward may change that the caller owns: every
        declared buffer but Stable scratch, and the side effects being restored."""
        return Snapshot.of(self.state, BoundState.restorable_names, self._ledger.tensors)

    def _manifest(self) -> dict[str, int]:
        man = self._fixed.input_addresses()
        if self.state is not None:
            man.update(self.state.addresses())
        return man

    def reset(self) -> None:
        """Drop every graph (and the static inputs); the next call captures again."""
        self._graphs, self._paths = {}, []
        self._streak = 0
        self._ledger.clear()
        self._fixed = None
        self.workspaces = ()
        self._compiled = ((), {})

    # --------------------------------------------------------------------------- replay

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._graphs:
            self.capture_all(*args, **kwargs)
        fx = self._fixed
        n, lives = self._batch(fx.inputs, fx.positions, args, kwargs)
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
            return self._unservable(args, kwargs, err, n)
        bucket = self.buckets.pick(agreed)
        cap = self._graphs[bucket]
        if self.state is not None:
            self.state.check_usable()  # a poisoned state never replays, with or without a refresh
        if not cap.checked or _KNOBS["check_manifest"]:  # before loading: never pad into a moved buffer
            self._fixed.check_manifest(cap, self.state)
        self._load(lives, n, bucket)
        self._replay(cap)
        self._streak = 0
        return cap.result(n, self.copy_outputs, _KNOBS["check_outputs"])

    def _check_call(self, n: int, lives: list[Any], args: tuple, kwargs: dict) -> ReplayError | None:
        """Why this rank cannot replay this call, or None."""
        if self.buckets.pick(n) is None:
            return ReplayError("batch size outside the captured buckets", expected=f"1 <= n <= {self.buckets.largest}",
                               found=f"n = {n}", fix="add a larger bucket or split the batch" +
                               (", or pass fallback='eager'" if self.fallback == "error" else ""))
        for slot, live in zip(self._fixed.slots, lives):
            if not slot.fits(live, n):
                return slot.spec.check(live, slot.static, n)
        if self._fixed.frozen and (err := frozen_change(self._fixed.frozen, self._sig, args, kwargs)) is not None:
            return err
        if self._paths and (_KNOBS["check_paths"] if self.check_paths is None else self.check_paths):  # rebinding.py
            return first_moved(self._paths, args, kwargs)
        return None

    def _replay(self, cap: Captured) -> None:
        if cap.draft and self._fixed.refreshes:
            if self.group is not None:  # a refresh that fails on one rank restores on all, before any replay
                with agreed_switch(self.state, "draft", self._agreement, phase="refresh"):
                    cap.replay(self.state)
            else:
                with self.state.switch("draft", phase="refresh"):
                    cap.replay(self.state)
        else:
            cap.replay(self.state)
        cap.replays += 1

    def _unservable(self, args: tuple, kwargs: dict, err: ReplayError, n: int) -> Any:
        if self.fallback == "error":
            raise err
        # counted by kind (err.what: "batch size outside the captured buckets"), logged in full
        reason = f"[{err.buffer}] {err.what}" if err.buffer else err.what
        self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
        cap = self._graphs.get(self.buckets.pick(n) or 0)
        if cap is not None:
            cap.eager_runs += 1
        self._streak += 1
        name = getattr(self.fn, "__qualname__", self.fn)
        log.warning("graphctl: %s runs eagerly: %s", name, err)
        if self._streak == knobs.bypass_window:  # once per streak: graphs that serve nothing are a silent slowdown
            log.warning("graphctl: %s: the last %d calls all ran eagerly, its %d graphs serve nothing (most frequent "
                        "reason: %s); see report()", name, self._streak, len(self._graphs),
                        max(self._fallbacks, key=self._fallbacks.__getitem__))
        return self.fn(*args, **kwargs)

    # ------------------------------------------------------- what a capture says about itself

    def _captured_or_raise(self, what: str) -> Fixed:
        if self._fixed is None:
            raise CaptureError("nothing captured yet", expected="capture_all() or a call first", found="no graphs",
                               fix=f"call capture_all(*example) before {what}")
        return self._fixed

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    @property
    def inputs(self) -> tuple[StaticInput, ...]:
        """The static inputs (declared, or every tensor argument of the example call)."""
        return self._captured_or_raise("inputs").inputs

    device = property(lambda self: self._captured_or_raise("device").backend.device)
    example_items = property(lambda self: self._captured_or_raise("example_items").n)

    fallbacks = property(lambda self: dict(self._fallbacks), doc="Eager fallbacks so far, by reason (a copy).")

    def example_arguments(self) -> dict[str, Any]:  # the example call of capture_all, by parameter name
        args, kwargs = self._captured_or_raise("using the example").example
        return self._sig.bind(args, kwargs)

    def assemble(self, values: dict[str, Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` calling the forward with ``values`` (parameter name -> value)."""
        return self._sig.assemble(values)

    def written(self, n: int) -> list[tuple[str, str, torch.Tensor]]:
        """``(name, who writes it, tensor)`` of what a run may write that the caller owns (``capture.written``)."""
        return written(self.state, self._captured_or_raise("written"), self._ledger, n)

    def record(self, bucket: int) -> Captured:  # graph, outputs, manifest, segments, counters
        return self._graphs[bucket]

    def graph(self, bucket: int) -> Any:  # .replay(), .node_count, .pool_bytes, .nodes()
        return self._graphs[bucket].graph

    def outputs(self, bucket: int) -> list[torch.Tensor]:  # the static output tensors of bucket's graph
        return [t for t in self._graphs[bucket].out_flat if isinstance(t, torch.Tensor)]

    def segments(self, bucket: int) -> tuple[Segment, ...]:
        return self._graphs[bucket].segments

    def static_input(self, name: str) -> torch.Tensor:  # the static buffer behind input name
        return next(slot.static for slot in self._captured_or_raise("static_input").slots if slot.spec.name == name)

    def measure(self, iters: int = 20) -> GraphRunner:  # median µs, graphed call and eager forward (graphs/measure.py)
        self._captured_or_raise("measure()")
        _measure.measure(self, iters)
        return self

    def coverage(self, sizes: Any = None) -> dict[int, str]:
        """Per batch size ``n`` (default 1 .. largest bucket, capped at the example's items), what served a call
        on the example's first ``n`` items: ``"bucket B"``, ``"eager: <reason>"`` or ``"error: <message>"``."""
        self._captured_or_raise("coverage()")
        return _measure.coverage(self, sizes)

    def verify(self, **options: Any) -> tuple[VerifyResult, ...]:
        """Eager against replay per bucket, outputs and padding poisoned (``analysis/verify.py``: gen, rtol, atol)."""
        self._captured_or_raise("verify()")
        return _verify(self, **options)

    def audit(self, params: Any = None, confirm: bool = False) -> dict[int, Audit]:
        """Per bucket, the pointer and segment audits (``graphs/analysis/audit.py``). ``params``: the model
        tensors the forward reads (module, mapping or iterable; default ``params=`` or a decorated method's
        module). ``confirm``: replay with each possible finding's freed block poisoned (``analysis/confirm.py``):
        confirmed ones become errors, harmless ones move to ``Audit.dropped``; the caller's state is put back."""
        owner = self.fn.__self__ if inspect.ismethod(self.fn) else None  # a decorated module's method
        model = param_tensors(params if params is not None else self.params if self.params is not None
                              else owner if isinstance(owner, torch.nn.Module) else None)
        guard = self.guard_all() if confirm else None  # allocated before the freed blocks are listed
        out = {b: audit_graph(self.graph(b), b, known=self.known_tensors(b), segments=self.segments(b),
                              workspaces=self.workspaces, plan=self.state.plan if self.state is not None else None,
                              params=model) for b in self.captured}
        if guard is None:
            return out
        with guard:
            return {b: _confirm(a, self.graph(b), replay=lambda: self._replay(self._graphs[b]),
                                sync=self._fixed.backend.synchronize,
                                observed=lambda: self.outputs(b) + [t for *_, t in self.written(b)],
                                restore=guard.restore) for b, a in out.items()}

    def known_tensors(self, bucket: int) -> list[tuple[str, str, torch.Tensor]]:
        """``(kind, name, tensor)`` the runner knows for ``bucket``: the audit's named regions."""
        return self._captured_or_raise("known_tensors").known_tensors(self.state, self.outputs(bucket))

    def nodes(self, bucket: int) -> list[Node]:
        """``bucket``'s nodes in capture order (CUDA: kernels, launch shapes, argument addresses; emulated: ops)."""
        return self.graph(bucket).nodes()

    def census(self, bucket: int) -> dict[str, dict[str, int]]:  # node counts by type and kernel (or op) name
        return census(self.nodes(bucket))

    def dot(self, bucket: int, path: str) -> None:
        """Write ``bucket``'s graph as Graphviz DOT (CUDA only: ``cudaGraphDebugDotPrint``)."""
        if (name := self._fixed.backend.name if self._fixed is not None else None) != "cuda":
            raise ReplayError("DOT export needs a CUDA graph", expected="backend 'cuda'", found=name or "nothing "
                              "captured", fix="capture on a GPU (backend='cuda'); emulated graphs have nodes() instead")
        self.graph(bucket).dot(path)

    def report(self) -> Report:
        """Per bucket: capture ms, pool bytes, nodes, segments, replay/eager µs (see ``report`` module)."""
        be = self._fixed.backend if self._fixed is not None else None
        rows = tuple(BucketReport(b, c.capture_ms, c.graph.pool_bytes, c.graph.node_count, c.replay_us, c.eager_us,
                                  c.replays, c.segments, c.eager_runs) for b, c in sorted(self._graphs.items()))
        device = "-" if be is None else str(be.device) + (
            f" ({torch.cuda.get_device_name(be.device)})" if be.device.type == "cuda" else "")
        asdict = dataclasses.asdict
        return Report(getattr(self.fn, "__qualname__", repr(self.fn)), be.name if be is not None else "-", device,
                      torch.__version__, rows, dict(self._fallbacks),
                      tuple({**asdict(e), "policy": self.side_effect_policy} for e in self.side_effects), self._streak,
                      bool(self._graphs) and 0 < knobs.bypass_window <= self._streak,
                      tuple({**asdict(h), "policy": self.host_state} for h in self.host_changes),
                      tuple(asdict(h) for h in self._ledger.hazards.values()),
                      tuple(asdict(u) for u in self._ledger.unreached), *self._compiled)

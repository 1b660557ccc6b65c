"""One capture: everything ``capture_all`` produced, as one record the runner holds.

:class:`Capture` is what tinygrad calls a ``CapturedJit``: made from the example call
(:meth:`Capture.make`: static inputs, the backend, the frozen arguments, the mutable-buffer guard),
filled by the two passes (``graphs/capture/passes.py``: the graphs per bucket, the workspaces the warmups
kept, the paths to check, host values changed, side effects and unreached tensors in its
:class:`Ledger`, dynamo's work), and dropped whole by ``reset()``. Before it exists nothing is
captured. Loading a call's inputs, binding the forward's call on a bucket's static views, the
address manifest and its check are its methods: the passes and the call path use the same ones.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphctl.errors import DeclarationError, ReplayError
from graphctl.graphs.analysis.nodes import Region
from graphctl.graphs.analysis.report import BucketReport, Report
from graphctl.graphs.backends import GraphBackend, select_backend
from graphctl.graphs.capture.bucket import BucketGraph
from graphctl.graphs.capture.calls import Signature, frozen_change
from graphctl.graphs.capture.frozen import freeze
from graphctl.graphs.capture.inputs import InputSlot, StaticInput
from graphctl.graphs.findings.hoststate import HostChange
from graphctl.graphs.findings.ledger import Ledger
from graphctl.graphs.findings.randomness import declared_generators
from graphctl.graphs.options import Options
from graphctl.graphs.replay.rebinding import Paths, first_moved
from graphctl.knobs import knobs
from graphctl.state import BoundState
from graphctl.state.snapshot import Snapshot

__all__ = ["Capture"]


def _guarded(st: BoundState) -> list[str]:
    """The mutable buffers and what derives from them, Persistent ones aside."""
    return [n for n in BoundState.mutable_names(st) if not st.plan.buffers[n].persistent]


@dataclasses.dataclass(slots=True, eq=False)
class Capture:
    """What the example call fixed and the passes produced, from ``capture_all`` to ``reset()``."""

    sig: Signature
    state: BoundState | None
    inputs: tuple[StaticInput, ...]
    slots: tuple[InputSlot, ...]
    positions: tuple[int, ...]  # each static input's position in the forward's signature
    pad_axes: dict[str, int]
    backend: GraphBackend
    guard: Snapshot  # the mutable buffers (and what derives from them), around every run
    refreshes: bool  # the state has draft twins to refresh around replay
    frozen: dict[str, tuple[Any, Any]]  # non-input argument -> (object, structural copy)
    example: tuple[tuple, dict]
    n: int  # the example's batch items
    ledger: Ledger  # side effects, padding hazards, unreached tensors (graphs/findings/stream.py)
    # filled by the passes (graphs/capture/passes.py)
    graphs: dict[int, BucketGraph] = dataclasses.field(default_factory=dict)
    workspaces: tuple[Region, ...] = ()  # what the warmups allocated and kept (library workspaces)
    host_changes: tuple[HostChange, ...] = ()  # host values the passes changed (policy applied)
    paths: Paths | list = dataclasses.field(default_factory=list)  # re-checked before every replay
    sites: tuple[str, ...] = ()  # the compiled callables the forward reaches, by path
    # bucket -> dynamo's work: warmup_frames, warmup_graphs, breaks, uncompiled (graphs/capture/compiled.py)
    compile: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    reach: dict[str, int] = dataclasses.field(default_factory=dict)  # what the walk saw and left out
    warmup_ms: dict[int, float] = dataclasses.field(default_factory=dict)  # bucket -> its warmups' wall time

    @classmethod
    def make(cls, sig: Signature, arguments: dict[str, Any], args: tuple, kwargs: dict, opts: Options,
             state: BoundState | None) -> Capture:
        inputs = opts.inputs
        if inputs is None:
            inputs = tuple(StaticInput(n) for n, v in arguments.items() if isinstance(v, torch.Tensor))
            firsts = {n: arguments[n].shape[0] if arguments[n].dim() else None for n in (si.name for si in inputs)}
            if len(set(firsts.values())) > 1:  # weights beside the batch: inputs= was meant
                raise DeclarationError("every tensor argument is a static input by default, batched on dim 0, "
                                       "and theirs differ", expected="one batch size across the tensor arguments",
                                       found=", ".join(f"{n}: {r if r is not None else 'a 0-dim tensor'}"
                                                       for n, r in firsts.items()),
                                       fix=f"name the batched ones: inputs=[{next(iter(firsts))!r}]")
        if not inputs:
            raise DeclarationError("the forward has no static input", expected="at least one tensor argument",
                                   found={n: type(v).__name__ for n, v in arguments.items()},
                                   fix="pass the batched argument as a tensor (torch.tensor(...)), or declare "
                                       "inputs=('input_ids', ...)")
        largest = opts.buckets.largest
        slots = tuple(InputSlot(si, si.allocate(arguments[si.name], largest)) for si in inputs)
        names = {si.name for si in inputs}
        pads = dict(opts.pad_axes) if opts.pad_axes is not None else {"seq": 1, "token": inputs[0].per_item}
        for name, d in state.plan.buffers.items() if state is not None else ():
            assert state is not None
            # a bucket's padded rows must exist in every padded state buffer (else the forward sees
            # buffers shorter than its inputs, and fails somewhere inside with a shape error)
            if d.axis in pads and state.tensor(name).shape[d.axis_dim] < largest * pads[d.axis]:
                rows = state.tensor(name).shape[d.axis_dim]
                raise DeclarationError("the largest bucket does not fit the bound state", buffer=name,
                                       expected=f"at least {largest * pads[d.axis]} rows along '{d.axis}' "
                                                f"(bucket {largest} x {pads[d.axis]})", found=f"{rows} rows",
                                       fix=f"capture buckets up to {rows // pads[d.axis]}, or size the state "
                                           f"(e.g. max_seqs) for {largest} items")
        cap = cls(sig, state, inputs, slots, tuple(sig.position[si.name] for si in inputs), pads,
                  # Persistent buffers are the passes' to guard: by rows where they can (graphs/findings/journal.py)
                  select_backend(opts.backend, slots[0].device), Snapshot.of(state, _guarded),
                  # the replay-time refreshes of draft twins; a spec without any needs no switch around replay
                  state is not None and bool(state.snapshot_names("refresh")),
                  # Non-input arguments are baked into the graph: keep each object and a structural copy of
                  # what it held (containers are compared by contents at every call: an in-place change to a
                  # dict or list passed here would otherwise replay capture-time values).
                  {k: (v, freeze(v)) for k, v in arguments.items() if k not in names},
                  (args, kwargs), 0, Ledger(opts.side_effects, opts.max_side_effect_bytes))
        cap.ledger.declared = list(declared_generators(state).values())
        cap.n, lives = cap.batch((), arguments, bound=True)
        for slot, live in zip(slots, lives):
            err = slot.spec.check(live, slot.static, cap.n)
            if err is not None:
                raise err
        return cap

    # ------------------------------------------------------------------ calls and inputs

    def batch(self, args: tuple, kwargs: dict, bound: bool = False) -> tuple[int, list[Any]]:
        """``(n, live static inputs)`` of a call; ``bound``: ``kwargs`` is the bound call by name."""
        # the usual call is positional; anything else binds fully (TypeError naming a bad argument)
        lives = None if bound else self.sig.positional(args, kwargs, self.positions)
        if lives is None:
            arguments = kwargs if bound else self.sig.bind(args, kwargs)
            lives = [arguments[si.name] for si in self.inputs]
        first, live = self.inputs[0], lives[0]
        if not isinstance(live, torch.Tensor) or live.dim() <= first.dim or live.shape[first.dim] % first.per_item:
            raise ReplayError("cannot read the batch size from the first static input", buffer=first.name,
                              expected=f"a tensor with a multiple of {first.per_item} rows along dim {first.dim}",
                              found=tuple(live.shape) if isinstance(live, torch.Tensor) else type(live).__name__,
                              fix="pass whole batch items (per_item rows each)")
        return live.shape[first.dim] // first.per_item, lives

    def call_args(self, arguments: dict[str, Any], bucket: int) -> tuple[tuple, dict]:
        """The forward's call on ``bucket``'s static input views, other arguments as given."""
        views = {slot.spec.name: slot.spec.view(slot.static, bucket) for slot in self.slots}
        return self.sig.assemble({**arguments, **views})

    def load(self, lives: list[Any], n: int, bucket: int) -> None:
        """Copy a call's ``n`` items into the static inputs and pad them, and the state, to ``bucket``."""
        for slot, live in zip(self.slots, lives):
            slot.load(live, n, bucket)
        if self.state is not None and n != bucket:  # the graph reads [:bucket]: pad [n:bucket]
            self.state.pad({a: n * m for a, m in self.pad_axes.items()},
                           {a: bucket * m for a, m in self.pad_axes.items()})

    def load_example(self, arguments: dict[str, Any], bucket: int) -> None:
        """The example's first ``min(n, bucket)`` items into ``bucket``'s inputs, the rest padding."""
        m = min(self.n, bucket)
        self.load(list(self.head(arguments, m).values()), m, bucket)

    def head(self, arguments: dict[str, Any], m: int) -> dict[str, torch.Tensor]:
        """The example's static inputs cut to their first ``m`` items, in input order."""
        return {si.name: arguments[si.name].narrow(si.dim, 0, m * si.per_item) for si in self.inputs}

    def refusal(self, n: int, lives: list[Any], args: tuple, kwargs: dict, paths: bool) -> ReplayError | None:
        """Why a call of ``n`` items (bucket picked) cannot replay: an input that does not fit, a
        frozen argument changed, a checked path rebound (``paths``); None when it can."""
        for slot, live in zip(self.slots, lives):
            if not slot.fits(live, n):
                return slot.spec.check(live, slot.static, n)
        if self.frozen and (err := frozen_change(self.frozen, self.sig, args, kwargs)) is not None:
            return err
        if paths and self.paths:  # graphs/replay/rebinding.py
            err = first_moved(self.paths, args, kwargs)
            sw = self.state.active_switch if self.state is not None else None
            if err is not None and sw is not None and err.buffer is not None and err.buffer.startswith("state."):
                return self._inside(sw, err.buffer[len("state."):])  # the switch rebound it, nobody else
            return err
        return None

    @staticmethod
    def _inside(sw: Any, name: str) -> ReplayError:
        return ReplayError(f"a graphed call inside an active '{sw.role}' switch ({sw.phase})", buffer=name,
                           expected="a call outside any switch of its state", found=f"'{name}' bound to its "
                           f"{sw.role} twin", fix="call the graphed function outside the with-statement: its graph "
                           "holds its own switches")

    # ------------------------------------------------------------------------ addresses

    def manifest(self) -> dict[str, int]:
        """Name -> address of every static buffer a graph bakes (inputs, declared buffers)."""
        # every bucket's view starts at its static buffer's first byte
        man = {f"input:{slot.spec.name}": slot.static.data_ptr() for slot in self.slots}
        if self.state is not None:
            man.update(self.state.addresses())
        return man

    def check_manifest(self, bucket: BucketGraph) -> None:
        """Raise ``ReplayError`` naming the first static buffer (input or declared) whose address
        moved since ``bucket`` was captured; mark it checked otherwise."""
        live: dict[str, int | None] = {f"input:{slot.spec.name}": slot.static.data_ptr() for slot in self.slots}
        if self.state is not None:
            live.update(self.state.live_addresses())
        for name, want in bucket.manifest.items():
            got = live.get(name)
            if got != want:
                sw = self.state.active_switch if self.state is not None else None
                if sw is not None:  # the swap moved it, nobody else: say where the call is
                    raise self._inside(sw, name)
                if name.startswith("input:"):
                    raise ReplayError("static buffer moved since capture", buffer=name, expected=f"{want:#x}",
                                      found="not a tensor" if got is None else f"{got:#x}",
                                      fix="write into the buffer in place (copy_) instead of rebinding it, or "
                                          "reset() and capture again")
                raise ReplayError("a declared buffer was rebound since the capture", buffer=f"state.{name}",
                                  expected=f"{want:#x}", found="not a tensor" if got is None else f"{got:#x}",
                                  fix="write into the buffer in place (state.write, copy_); after reallocating, bind "
                                      "the object again and runner.repoint(state)")
        bucket.checked = True

    # ---------------------------------------------------------------------- what it knows

    def known_tensors(self, outputs: list[torch.Tensor], regions: Any = ()) -> list[tuple[str, str, torch.Tensor]]:
        """``(kind, name, tensor)`` of the memory the runner knows: the state's buffers and
        twins, its snapshot arenas, the static inputs, ``outputs``, frozen tensor arguments, and
        the static outputs of the graph's eager ``regions`` (``graphs/capture/pieces.py``)."""
        out: list[tuple[str, str, torch.Tensor]] = []
        if self.state is not None:
            out += [("buffer", n, self.state.tensor(n)) for n in self.state.addresses()]
            out += [("arena", f"arena {n}", t) for n, t in self.state.arenas().items()]
        out += [("input", f"input:{slot.spec.name}", slot.static) for slot in self.slots]
        out += [("output", f"output[{i}]", t) for i, t in enumerate(outputs)]
        out += [("boundary", f"eager:{r.name} output[{j}]", t) for r in regions for j, t in enumerate(r.outputs)]
        for name, (v, _) in self.frozen.items():
            out += [("argument", f"argument:{name}", t) for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        return out

    def written(self, n: int) -> list[tuple[str, str, torch.Tensor]]:
        """``(name, who writes it, tensor)`` of what a run may write that the caller owns: the
        mutable declared buffers (their live rows for ``n`` items: padding is graphctl's, not the
        forward's; buffers derived from them are functions of them, and of the padding) and the
        restored side effects (whole: a padded lane writing live memory shows there)."""
        out: list[tuple[str, str, torch.Tensor]] = []
        st = self.state
        if st is not None:
            for name in (n for n in st.plan.buffers if n in st.plan.mutable):
                d, t = st.plan.buffers[name], st.tensor(name)
                if d.axis is not None and d.axis in self.pad_axes:
                    t = t.narrow(d.axis_dim, 0, min(t.shape[d.axis_dim], n * self.pad_axes[d.axis]))
                out.append((f"state.{name}", "a declared mutable buffer", t))
        if self.ledger.policy == "restore":
            out += [(e.path, f"{e.op} at {e.where}", t) for e, t in self.ledger.written()]
        return out

    def rows(self) -> tuple[BucketReport, ...]:
        """One report row per bucket (``report()``)."""
        return tuple(BucketReport(b, c.capture_ms, c.graph.pool_bytes, c.graph.node_count, c.replay_us, c.eager_us,
                                  c.replays, c.segments, c.eager_runs, self.warmup_ms.get(b, 0.0),
                                  eager_regions=tuple({"name": r.name, "calls": r.calls, "mean_us": r.mean_us,
                                                       "capture_us": r.capture_us} for r in c.graph.regions))
                     for b, c in sorted(self.graphs.items()))

    def report(self, name: str, opts: Options, fallbacks: dict[str, int], streak: int) -> Report:
        """``runner.report()`` of this capture (``analysis/report.py``)."""
        be = self.backend
        device = str(be.device) + (f" ({torch.cuda.get_device_name(be.device)})" if be.device.type == "cuda" else "")
        records = [*self.ledger.hazards.values(), *self.ledger.unreached, *self.ledger.random.values(),
                   *(dataclasses.replace(h, policy=opts.host_state) for h in self.host_changes),
                   *(dataclasses.replace(e, policy=opts.side_effects) for e in self.ledger.effects)]
        return Report(name, be.name, device, torch.__version__, self.rows(), fallbacks, tuple(records), streak,
                      bool(self.graphs) and 0 < knobs.bypass_window <= streak, self.sites, dict(self.compile),
                      dict(self.reach))

"""The emulated graph backend: CUDA-graph capture semantics on any device, CPU included.

Capture runs the body once under a ``TorchDispatchMode`` recorder that executes every op and
keeps it with the very tensors it touched. Replay re-executes the recorded ops onto the same
storages and ignores the Python code, as a CUDA graph would:

- ops that return fresh tensors write their new results into the capture-time output
  tensors, which stay alive with the graph (its "pool"); in-place, ``out=`` and view ops
  alias their inputs and are simply re-run, so views keep pointing where they pointed;
- a host scalar read at capture stays frozen (it is an argument of the recorded op);
- rebinding an attribute after capture changes nothing, and a tensor allocated after capture
  is never read by the replay: only recorded tensors are.

Operations that a CUDA capture cannot hold raise :class:`~graphctl.errors.CaptureError` with
the user's ``file:line``: host reads of device values (``.item()``, ``.tolist()``, ``bool(t)``,
``torch.equal``), data-dependent output shapes (``nonzero``, ``masked_select``, ``unique``) and
device-to-host copies. ``.cpu()`` and ``.tolist()`` of a tensor that already lives on the CPU
do not reach the dispatcher, so on a CPU-only machine they are invisible here; on CUDA tensors
they are device-to-host copies and are refused (so is every host read under a CUDA capture).
graphctl's own ops are recorded as single ops.

Compiled code (``torch.compile``) is captured as the code it compiles: the capture runs under the
``force_eager`` stance (``graphs/capture/compiled.py``), so every op of a compiled callable is recorded and
checked like any other, a host sync inside it is refused at its line, and the host values it reads
are baked into the recorded ops as a CUDA graph bakes them into its kernels. (The warmups ran the
compiled artifact; a CUDA capture records its kernels.) An ``@graphctl.eager`` region inside a
compiled callable splits it as it splits any forward.

A replay stopped by a raising op (or a region) tells the runner's hooks where it stopped, while
interrupts are still held: a switch recorded open there is restored or the state poisoned
(``graphs/capture/bucket.py``). Regions run as user code: a second Ctrl-C reaches one that hangs.
"""
from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten

from graphctl.errors import CaptureError, ReplayError
from graphctl.graphs.analysis.nodes import Node, Ref, Region
from graphctl.graphs.backends.hooks import ReplayHooks
from graphctl.graphs.backends.looks import LooksLikeCapture as _LooksLikeCapture
from graphctl.graphs.capture import compiled as _compiled
from graphctl.graphs.capture import pieces
from graphctl.graphs.findings.frames import GRAPHCTL_DIR, user_frame
from graphctl.graphs.findings.journal import fresh_results, op_tensors
from graphctl.state.interrupts import deferred, drop_mode
from graphctl.state.phase import paused, recording

__all__ = ["EmulatedBackend", "EmulatedGraph"]

_HOST_READS = {"aten::_local_scalar_dense": "reads a device value on the host (.item(), .tolist(), bool(t), int(t))",
               "aten::equal": "returns a Python bool computed from device values (torch.equal)",
               "aten::is_nonzero": "reads a device value on the host (bool(t))"}
# Ops returning host values computed from metadata alone (shapes, layouts), which a graph keeps.
_METADATA_ONLY = {"aten::is_same_size", "aten::is_set_to", "aten::is_coalesced", "aten::dense_dim",
                  "aten::sparse_dim", "aten::_nnz", "aten::_debug_has_internal_overlap"}


def _illegal(func: torch._ops.OpOverload, args: tuple, out: Any) -> str | None:
    name = func._schema.name
    if name in _HOST_READS:
        return _HOST_READS[name]
    if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
        # aten::index is tagged for its boolean-mask form; integer indices keep a static shape
        if name != "aten::index" or any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                        for i in args[1]):
            return "has a data-dependent output shape, which a graph cannot replay"
    if name not in _METADATA_ONLY and any(str(r.type) in ("bool", "int", "float", "Scalar", "SymInt")
                                          for r in func._schema.returns):
        return "returns a host value computed from device data"
    if any(t.device.type != "cpu" for t in op_tensors(args)) and any(t.device.type == "cpu" for t in op_tensors(out)):
        return "copies device memory to the host, a synchronization a graph cannot record"
    return None


class _Op:
    __slots__ = ("func", "args", "kwargs", "fresh", "waits", "name")

    region = None  # a recorded op; _Region holds an eager region

    def __init__(self, func: Any, args: tuple, kwargs: dict, fresh: tuple) -> None:
        self.func, self.args, self.kwargs, self.fresh, self.name = func, args, kwargs, fresh, func._schema.name
        # collectives (c10d ops) return a Work handle that the Python wrapper waits on; a replay
        # runs the op itself, so it must wait too
        self.waits = tuple(i for i, r in enumerate(func._schema.returns) if str(r.type).endswith("Work"))


class _Region:
    """An eager region (``graphs/capture/pieces.py``) between two recorded pieces: replayed by calling it."""

    __slots__ = ("func", "args", "kwargs", "fresh", "waits", "name", "region")

    def __init__(self, region: pieces.EagerRegion) -> None:
        self.region, self.func, self.args, self.kwargs = region, region.run, region.args, region.kwargs
        self.fresh, self.waits, self.name = (), (), f"eager:{region.name}"  # run() copies its results itself


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op | _Region] = []

    def region(self, looks: _LooksLikeCapture) -> Callable[[Callable[..., Any], tuple, dict, bool], Any]:
        """The handler of ``@graphctl.eager`` calls under this recorder: off the mode stack, not
        recording, not looking like a capture, the function runs; one ``_Region`` op is kept."""
        def handler(fn: Callable[..., Any], args: tuple, kwargs: dict, in_switch: bool) -> Any:
            inside = pieces.admit(fn, in_switch)
            with _pop_mode_temporarily() as mode:
                if mode is not self:  # another mode entered inside the forward encloses the region
                    raise CaptureError("a dispatch mode inside the forward encloses an eager region",
                                       buffer=getattr(fn, "__qualname__", repr(fn)),
                                       expected="no TorchDispatchMode entered inside the captured forward",
                                       found=type(mode).__name__, fix="enter the mode outside the graphed call")
                with paused(), looks.paused():
                    out, region = pieces.run_region(fn, args, kwargs, in_switch, inside)
            self.ops.append(_Region(region))
            return out
        return handler

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        why = _illegal(func, args, out)
        if why is not None:
            where = user_frame()
            raise CaptureError(f"operation illegal under graph capture: {func._schema.name} {why}",
                               buffer=None, expected="device-only work with static shapes",
                               found=f"{func._schema.name} at {where}", where=where,
                               fix="keep host logic out of the captured forward (compute it before the call), "
                                   "or run this bucket eagerly")
        # Outputs that alias an input (in-place, out=, views) need no copy on replay; the rest
        # receive the replayed result in the capture-time tensor.
        self.ops.append(_Op(func, args, kwargs, tuple(fresh_results(func, out))))
        return out


_GRAPHS: weakref.WeakSet[EmulatedGraph] = weakref.WeakSet()  # every live recorded graph (memory_regions)


class EmulatedGraph:
    """A recorded op list replayed onto its capture-time storages."""

    def __init__(self, ops: list[_Op | _Region]) -> None:
        _GRAPHS.add(self)
        self._ops = ops
        self.regions = tuple(op.region for op in ops if isinstance(op, _Region))  # eager regions, in order
        seen: dict[int, int] = {}
        for op in ops:
            for _, t in op.fresh:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        self.pool_bytes = sum(seen.values())

    @property
    def node_count(self) -> int:
        return len(self._ops)

    # Its dangling findings are exact (a recorded tensor, by identity): nothing to confirm by poisoning.
    can_poison = False

    def replay(self, hooks: ReplayHooks | None = None) -> None:
        # A CUDA graph replay cannot be stopped halfway; neither can this one: a Ctrl-C that
        # arrives mid-replay is held until the last recorded op ran (a recorded switch would
        # otherwise be left half applied), then raised. Regions are user code (a second Ctrl-C
        # reaches them); a replay stopped by a raising op or region tells ``hooks`` where, still held.
        at = 0
        with deferred(), torch.no_grad():
            try:
                for at, op in enumerate(self._ops):  # noqa: B007 (read by the handler below)
                    if op.region is not None:
                        if hooks is None:
                            op.func(*op.args, **op.kwargs)
                        else:
                            with hooks.region(op.region):
                                op.func(*op.args, **op.kwargs)
                        continue
                    res: Any = op.func(*op.args, **op.kwargs)
                    for w in op.waits:
                        res[w].wait()
                    if op.fresh:
                        flat, _ = tree_flatten(res)
                        for j, t in op.fresh:
                            t.copy_(flat[j])
            except BaseException as exc:
                if hooks is not None:
                    hooks.failed(at, None, exc, self._ops[at].name)
                raise

    def repoint(self, moves: list) -> Callable[[], int]:
        """The call that swaps every recorded tensor inside a moved span (``graphs/replay/repoint.py``)
        for the same view of the new storage and says how many; nothing here can refuse."""
        return lambda: self._repoint(moves)

    def _repoint(self, moves: list) -> int:
        count = 0

        def fix(v: Any) -> Any:
            nonlocal count
            if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.numel():
                for m in moves:
                    if (to := m.map(v.data_ptr())) is not None:
                        count += 1
                        at = to - m.new.untyped_storage().data_ptr()
                        return torch.empty(0, dtype=v.dtype, device=v.device).set_(
                            m.new.untyped_storage(), at // v.element_size(), v.shape, v.stride())
                return v
            if isinstance(v, (list, tuple)):
                return type(v)(fix(e) for e in v)
            return v

        for op in self._ops:
            op.args = tuple(fix(a) for a in op.args)
            op.kwargs = {k: fix(a) for k, a in op.kwargs.items()}
            if op.region is not None:
                op.region.repointed(op.args, op.kwargs)
        return count

    def _containers(self, into: set[int]) -> None:
        """The ids of every container this graph's records hold (ops' arguments, its regions'
        arguments, results and bookkeeping): graphctl's own references, never the caller's."""
        for op in self._ops:
            _leaves((op.args, op.kwargs), into)
        for r in self.regions:
            _leaves((r.args, r.kwargs, r.outputs, r.kinds, r.host), into)

    def dot(self, path: str) -> None:
        raise ReplayError("DOT export needs a CUDA graph", expected="backend 'cuda'", found="an emulated graph",
                          fix="capture on a GPU (backend='cuda'); emulated graphs have nodes() instead")

    def op_names(self) -> list[str]:
        return [op.name for op in self._ops]

    def nodes(self) -> list[Node]:
        """One :class:`~graphctl.graphs.analysis.nodes.Node` per recorded op: its tensor arguments as
        references, ``write`` where the schema marks the argument written (in-place, ``out=``),
        ``read`` otherwise. View ops reference nothing (their consumers do)."""
        nodes = []
        for i, op in enumerate(self._ops):
            if isinstance(op, _Region):  # an eager region: reads and may write its arguments, writes its outputs
                refs = [r for v in (*op.args, *op.kwargs.values()) for r in _tensor_refs(v, "touch", "arg")]
                refs += [r for j, t in enumerate(op.region.outputs) for r in _tensor_refs(t, "write", f"result {j}")]
                nodes.append(Node(i, "op", op.name, refs=tuple(refs)))
                continue
            schema, name = op.func._schema, op.func.name()
            rets = schema.returns
            if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
                nodes.append(Node(i, "op", name))
                continue
            written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
            refs = []
            for a, v in zip(schema.arguments, op.args):
                refs += _tensor_refs(v, "write" if a.name in written else "read", f"arg {a.name}")
            for k, v in op.kwargs.items():
                refs += _tensor_refs(v, "write" if k in written else "read", f"arg {k}")
            for j, t in op.fresh:
                refs += _tensor_refs(t, "write", f"result {j}")
            nodes.append(Node(i, "op", name, refs=tuple(refs)))
        return nodes

    def memory_regions(self) -> list[Region]:
        """The emulated counterpart of the allocator's map: storages the ops created are the
        graph's pool; an outside storage that only the recorded ops still hold (no tensor of it,
        nor the base of one, is referenced anywhere else) is ``freed``: a CUDA graph would use
        its memory after the caller dropped it, the dangling temporary. Other outside storages
        are ``live``."""
        pool: dict[int, int] = {}
        for op in self._ops:
            for _, t in op.fresh:
                st = t.untyped_storage()
                pool[st.data_ptr()] = st.nbytes()
        containers: set[int] = set()
        for g in _GRAPHS:  # every recorded graph's containers (another bucket's ops hold the same temporary)
            if g is not self:
                g._containers(containers)
        by_storage: dict[int, dict[int, torch.Tensor]] = {}
        for op in self._ops:
            for v in _leaves((op.args, op.kwargs), containers):
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in pool:
                    group = by_storage.setdefault(v.untyped_storage().data_ptr(), {})
                    group[id(v)] = v
                    if v._base is not None:
                        group[id(v._base)] = v._base
        self._containers(containers)
        held = _held_outside(by_storage, containers)
        regions = [Region("graph pool", "pool", p, p + n) for p, n in pool.items()]
        for ptr, group in by_storage.items():
            kind = "live" if held & group.keys() else "freed"
            t = next(iter(group.values()))
            regions.append(Region(f"{kind} tensor {tuple(t.shape)} {t.dtype}", kind, ptr,
                                  ptr + t.untyped_storage().nbytes()))
        return regions


def _held_outside(by_storage: dict[int, dict[int, torch.Tensor]], containers: set[int]) -> set[int]:
    """ids of the tensors some Python object outside the recorded ops refers to (one scan of
    the garbage collector's objects; references from C++, such as a view's base, do not count,
    nor do graphctl's own frames)."""
    objs = [t for group in by_storage.values() for t in group.values()]
    ids = {id(t) for t in objs}
    mine = containers | {id(objs), id(by_storage)} | {id(g) for g in by_storage.values()}
    held: set[int] = set()
    for r in gc.get_referrers(*objs):
        if id(r) in mine or (isinstance(r, types.FrameType) and r.f_code.co_filename.startswith(GRAPHCTL_DIR)):
            continue
        held.update(id(x) for x in gc.get_referents(r) if id(x) in ids)
    return held


def _tensor_refs(v: Any, access: str, where: str) -> list[Ref]:
    if isinstance(v, torch.Tensor):
        return [Ref(v.data_ptr(), access, where, v.numel() * v.element_size())] if v.numel() else []
    if isinstance(v, (list, tuple)):
        return [r for x in v for r in _tensor_refs(x, access, where)]
    return []


def _leaves(v: Any, containers: set[int]) -> list[Any]:
    """The leaves of nested lists, tuples and dicts; every container's id goes into ``containers``."""
    if isinstance(v, (list, tuple, dict)):
        containers.add(id(v))
        return [x for e in (v.values() if isinstance(v, dict) else v) for x in _leaves(e, containers)]
    return [v]


class EmulatedBackend:
    """Runs anywhere; what CI tests capture semantics with. See :class:`CudaBackend` for the
    interface both backends share."""

    name = "emulated"
    capture_executes = True  # the recorder runs every op it records: a capture changes state

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with deferred(), _Recorder():  # the first dispatch mode entered in a process pays torch's lazy set-up
            torch.zeros(1).add_(1)

    def new_pool(self) -> None:
        return None

    def live_blocks(self) -> set[tuple[int, int]]:
        return set()  # no caching allocator to ask; outside tensors are classified by who holds them

    def warmup(self, body: Callable[[], Any]) -> Any:
        return body()

    def capture(self, body: Callable[[Callable[[], int]], Any], pool: Any, bucket: int,
                generators: Sequence[torch.Generator] = ()) -> tuple[EmulatedGraph, Any]:
        """Record ``body(mark)``, where ``mark()`` is the number of ops recorded so far; compiled
        code runs as the code it compiles (``force_eager``), recorded op by op. ``generators`` need
        no registration here: a replay re-runs each random op with its generator, which draws on."""
        rec, looks = _Recorder(), _LooksLikeCapture()
        stance, outside = None, pieces.saved()
        try:
            try:
                stance = _compiled.eager()  # applied when made; leaving it again is harmless
                with stance, recording(), looks, rec, pieces.regions(rec.region(looks)):
                    out = body(lambda: len(rec.ops))
            finally:  # an interrupt at the with-statement's exit skips the innermost __exit__ calls
                drop_mode(rec)
                pieces.restore(outside)
                looks.leave()
                if stance is not None:
                    stance.__exit__(None, None, None)
        except CaptureError as exc:
            exc.add_note(f"graphctl: capture of bucket {bucket} dropped; nothing replayable was kept")
            raise
        except Exception as exc:
            raise CaptureError.from_body(bucket, exc) from exc
        except BaseException as exc:  # Ctrl-C, SystemExit, GeneratorExit: cleaned up, then themselves
            exc.add_note(f"graphctl: capture of bucket {bucket} dropped; nothing replayable was kept")
            raise
        return EmulatedGraph(rec.ops), out

    def synchronize(self) -> None:
        pass


"""What the graph reads through its arguments, rebound outside it, caught before the replay.

A graph bakes addresses and objects. Static inputs and frozen arguments are checked against the
capture's manifest; what is reached *through* them is checked here: an engine that computes a
metadata tensor outside the graph and rebinds ``self.meta.sched = fresh`` each step leaves the
graph reading the capture-time tensor (vLLM #36611, #37639); a weight rebound after capture
(``lin.weight = nn.Parameter(...)``, ``lin.weight.data = ...``: a fine-tuning loop, a LoRA swap, a
reload) leaves it reading the old weight; a declared generator replaced (``m.generator =
torch.Generator()``) leaves it drawing from the old stream. At capture, :func:`collect` names
every tensor the tracked warmups read or wrote that the forward reaches by a path
(``graphs/findings/reach.py``: an argument's attribute or item, ``self.…``, a closure cell, a global the
function names; a module's parameters, buffers and children through its dicts, one C lookup each)
and that graphctl does not own (static inputs, arenas), weights included, and every entry the
bound state declares, tensor or object, through the state's object; :func:`first_moved`
re-resolves those paths before each replay and names the first one that no longer leads to the
same tensor (identity and address) or object (identity). ``GRAPHCTL_CHECK_PATHS=0`` turns it off.
"""
from __future__ import annotations

import dataclasses
import keyword
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import ReplayError
from graphctl.graphs.findings.reach import Reach, Root, TensorLeaf
from graphctl.state.paths import steps

__all__ = ["MAX_PATHS", "Entry", "PathCheck", "Paths", "assemble", "collect", "entries_of", "first_moved",
           "with_entries"]

# past this many paths the per-replay check costs more than it saves (H200 host: ~0.14 us a path in C)
MAX_PATHS = 1024
# kept first: declared entries, metadata an engine rebinds, a module's registered buffers, then the weights
_RANK = {"entry": 0, "state": 1, "buffer": 2, "weight": 3}


@dataclasses.dataclass(frozen=True)
class PathCheck:
    path: str
    root: Callable[[tuple, dict], Any]  # the root object for this call's (args, kwargs)
    steps: tuple[tuple[bool, Any], ...]  # (is_attribute, name or key), in order
    ptr: int | None  # the tensor's address; None: an object, compared by identity
    shape: tuple[int, ...]
    tensor: Any = None  # a weak reference to the capture's tensor (a strong one would hide a freed temporary
    # from the audit, which names it dangling); an object entry: the object itself
    source: Any = None  # the root for the native check: a cell, (constant,), (dict, key), or ``root`` itself
    role: str = "state"  # "entry" (declared), "state", "buffer", "weight", "module": what the error says
    inner: bool = False  # a path through modules' dicts only, past the module it enters (see Paths)


# A module's weights, buffers and children change only through its __setattr__ (a new Parameter, a
# buffer or a child assigned), which calls torch's global registration hooks: they count here. While
# the count stands, a path through modules' dicts still leads where it led, and a weight is checked by
# its address alone (``p.data = ...`` moves it without any hook).
_REGISTRATIONS = [0]
_HOOKED: list[Any] = []


def _registered(*_: Any) -> None:
    # Not while dynamo traces: a compiled forward that registers modules as it runs (transformers slices its
    # ModuleList of layers, a new ModuleList each call) would read the count into a guard, and every later
    # call, finding it moved, compiled again (issue 54: 5 graphs a bucket instead of 3, and no bucket shared
    # a dynamic graph). Compiled code registers on temporaries of its own; a model changed between calls, by
    # eager code, is counted as before.
    if not torch.compiler.is_compiling():
        _REGISTRATIONS[0] += 1


def _hook_registrations() -> None:
    if not _HOOKED:
        mod = torch.nn.modules.module
        _HOOKED.extend([mod.register_module_parameter_registration_hook(_registered),
                        mod.register_module_buffer_registration_hook(_registered),
                        mod.register_module_module_registration_hook(_registered)])


_DICTS = frozenset({"_parameters", "_buffers", "_modules"})


def _inside_modules(path_steps: tuple[tuple[bool, Any], ...]) -> int | None:
    """Where a path enters the first module's dicts, when it then goes through modules' dicts only
    (``self.model._modules['layers']._modules['3']._parameters['weight']``); None otherwise."""
    for i in range(0, len(path_steps) - 1):
        if path_steps[i][0] and path_steps[i][1] in _DICTS:
            rest = path_steps[i:]
            pairs = all(rest[j][0] and rest[j][1] in _DICTS and not rest[j + 1][0] for j in range(0, len(rest) - 1, 2))
            return i if len(rest) % 2 == 0 and pairs else None
    return None


class Paths(list):
    """The checks in walk order, with :meth:`fast`: whether every path still leads to its tensor
    (each shared prefix resolved once, each leaf compared by identity through a weak reference,
    and by address), in one C call (``graphctl._C.paths_hold`` over ``program``) or, without the
    extension, one straight-line Python function (``walk``, its reference). A model's cache has
    dozens of paths (``cache.layers[i].keys``): on the H200 host between synchronized steps 66 of
    them cost ~70 µs as compiled Python against 9 µs in a tight loop (cold caches), which a bare
    ``@graphed`` decode step pays before every replay. Paths into a model's modules (its weights:
    hundreds) are walked only when a module registered something since the last walk
    (``_REGISTRATIONS``); between, each is one address check (``refs``, ``ptrs``), and the module
    each enters is checked by identity in ``program``. :func:`first_moved` walks plainly only when
    the fast check fails, to name the path."""

    program: tuple
    walk: Callable[[tuple, dict], bool]
    inner: tuple  # the paths into modules, whole, walked when registrations happened
    inner_walk: Callable[[tuple, dict], bool]
    refs: tuple  # weak references to their tensors, and their addresses
    ptrs: tuple
    walked: int  # the registration count of the last whole walk of ``inner``

    def fast(self, args: tuple, kwargs: dict) -> bool:
        if not ops.paths_hold(self.program, args, kwargs, self.walk):
            return False
        if not self.refs:
            return True
        now = _REGISTRATIONS[0]
        if now != self.walked:
            if not ops.paths_hold(self.inner, args, kwargs, self.inner_walk):
                return False
            self.walked = now
        return ops.tensors_hold(self.refs, self.ptrs)


def _shared(prev: PathCheck | None, c: PathCheck) -> int:
    """Leading steps ``c`` shares with the check before it, when both start at one root."""
    n = 0
    if prev is None or prev.root is not c.root:
        return 0
    while n < min(len(prev.steps), len(c.steps)) - 1 and prev.steps[n] == c.steps[n]:
        n += 1
    return n


def _program(checks: list[PathCheck]) -> tuple:
    """The checks as ``graphctl._C.paths_hold`` reads them (csrc/path_check.cpp)."""
    out, prev = [], None
    for c in checks:
        first = prev is None or c.root is not prev.root
        keep = 0 if first else _shared(prev, c)
        out.append((c.source if first else None, keep, tuple(c.steps[keep:]), c.tensor, c.ptr))
        prev = c
    return tuple(out)


def _compile(checks: list[PathCheck]) -> Callable[[tuple, dict], bool]:
    consts: dict[str, Any] = {}
    lines = ["def fast(a, k):", "  try:", "    pass"]
    along: list[str] = []
    root, prev = None, None
    for i, c in enumerate(checks):
        if c.root is not root:
            root, keep = c.root, 0
            consts[f"R{i}"] = root
            along = [f"r{i}"]
            lines.append(f"    r{i} = R{i}(a, k)")
        else:
            keep = _shared(prev, c)
            del along[keep + 1:]
        prev = c
        for d, (is_attr, key) in enumerate(c.steps[keep:], start=keep):
            name = f"v{i}_{d}"
            if is_attr and isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key):
                lines.append(f"    {name} = {along[-1]}.{key}")
            else:
                consts[f"K{i}_{d}"] = key
                lines.append(f"    {name} = {'getattr(' + along[-1] + ', ' if is_attr else along[-1] + '['}"
                             f"K{i}_{d}{')' if is_attr else ']'}")
            along.append(name)
        consts[f"T{i}"] = c.tensor
        lines.append(f"    if {along[-1]} is not T{i}: return False" if c.ptr is None else
                     f"    if {along[-1]} is not T{i}() or {along[-1]}.data_ptr() != {c.ptr}: return False")
    lines += ["  except (AttributeError, IndexError, KeyError, TypeError):", "    return False", "  return True"]
    scope: dict[str, Any] = dict(consts)
    exec(compile("\n".join(lines), "<graphctl path check>", "exec"), scope)  # noqa: S102 - our own code
    return scope["fast"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A declared entry of a bound state, as the path check walks it: from the state's object."""

    path: str
    root: Root
    steps: tuple[tuple[bool, Any], ...]
    value: Any  # the tensor or object bound at bind time
    role: str = "entry"
    order: int = -1


def entries_of(state: Any) -> list[Entry]:
    """Every entry ``state`` declares (tensors and objects, twins included), as bound at bind time."""
    if state is None:
        return []
    obj = state.obj
    root = Root("state", obj, lambda a, k: obj, (obj,))
    return [Entry(f"state.{name}", root, steps(name), value) for name, value in state.bindings]


def collect(reach: Reach, used: set, owned: set, declared: Sequence[Entry] = ()) -> tuple[Paths, dict[str, int]]:
    """The paths to re-check at every replay: ``declared`` (every entry of the bound state), and
    the walked tensors (``graphs/findings/reach.py``) the warmups used (storage keys in ``used``) that
    graphctl does not own (``owned``), weights included. At most :data:`MAX_PATHS`, dropped by role
    (weights first, then a module's registered buffers, before other state and the declared
    entries), never silently: the second value counts what was left unchecked, by role."""
    found: list[Any] = list(declared)
    found += [leaf for k, leaf in reach.tensors.items() if k in used and k not in owned]
    ranked = sorted(found, key=lambda leaf: (_RANK[leaf.role], leaf.order))
    kept, dropped = ranked[:MAX_PATHS], ranked[MAX_PATHS:]
    unchecked: dict[str, int] = {}
    for leaf in dropped:
        unchecked[leaf.role] = unchecked.get(leaf.role, 0) + 1
    checks, modules = [], {}
    for leaf in sorted(kept, key=lambda leaf: leaf.order):  # walk order: neighbours share a prefix
        at = _inside_modules(leaf.steps) if isinstance(leaf, TensorLeaf) else None
        # the module it enters, by identity (a plain object's attribute can be rebound unseen); not a constant root
        fixed = at == 0 and isinstance(leaf.root.source, tuple) and len(leaf.root.source) == 1
        if at is not None and not fixed:
            key = (id(leaf.root.get), leaf.steps[:at])
            if key not in modules:
                top = leaf.root.value
                for is_attr, k in leaf.steps[:at]:
                    top = getattr(top, k) if is_attr else top[k]
                modules[key] = PathCheck(_render(leaf.root.name, leaf.steps[:at]), leaf.root.get, leaf.steps[:at],
                                         None, (), tensor=top, source=leaf.root.source, role="module")
                checks.append(modules[key])
        checks.append(_check(leaf, at is not None))
    return assemble(checks), unchecked


def _check(leaf: Any, inner: bool) -> PathCheck:
    v = leaf.value if isinstance(leaf, Entry) else leaf.tensor
    tensor = isinstance(v, torch.Tensor)
    return PathCheck(leaf.path, leaf.root.get, leaf.steps, v.data_ptr() if tensor else None,
                     tuple(v.shape) if tensor else (), tensor=weakref.ref(v) if tensor else v,
                     source=leaf.root.source, role=leaf.role, inner=inner)


def assemble(checks: Sequence[PathCheck]) -> Paths:
    """The checks as :class:`Paths`: the programs of the plain ones and of the paths into modules."""
    plain, inner = [c for c in checks if not c.inner], [c for c in checks if c.inner]
    out = Paths(plain + inner)
    out.walk, out.program = _compile(plain), _program(plain)
    out.inner_walk, out.inner = _compile(inner), _program(inner)
    out.refs, out.ptrs = tuple(c.tensor for c in inner), tuple(c.ptr for c in inner)
    out.walked = _REGISTRATIONS[0]
    if inner:
        _hook_registrations()
    return out


def with_entries(checks: Sequence[PathCheck], state: Any) -> Paths:
    """``checks`` with the declared entries of ``state`` in place of the ones they had (a runner
    re-pointed at a state bound again: ``graphs/replay/repoint.py``)."""
    return assemble([_check(e, False) for e in entries_of(state)] + [c for c in checks if c.role != "entry"])


def _render(root: str, path_steps: tuple[tuple[bool, Any], ...]) -> str:
    """``self.model`` from a root's name and steps (dict steps of a module shown as attributes)."""
    out, dict_step = root, False
    for is_attr, k in path_steps:
        if is_attr and k in _DICTS:
            dict_step = True
            continue
        out += f".{k}" if is_attr or dict_step else f"[{k!r}]"
        dict_step = False
    return out


def first_moved(checks: list[PathCheck], args: tuple, kwargs: dict) -> ReplayError | None:
    """The first path that no longer leads to the captured tensor, as a ``ReplayError``."""
    if isinstance(checks, Paths) and checks.fast(args, kwargs):
        return None  # every path leads to the very tensor object of the capture, at its address
    # the fast check failed (or was not compiled): walk each path plainly to name the first one that moved
    for c in checks:
        v = c.root(args, kwargs)
        try:
            for is_attr, k in c.steps:
                v = getattr(v, k) if is_attr else v[k]
        except (AttributeError, IndexError, KeyError, TypeError):
            v = None
        if c.ptr is None:
            if v is c.tensor:
                continue
            if c.role == "module":
                return ReplayError("a module the graph's weights live in was replaced since the capture",
                                   buffer=c.path, expected=f"the {type(c.tensor).__name__} of the capture",
                                   found="nothing" if v is None else f"another {type(v).__name__}",
                                   fix="load new weights into the captured module in place (load_state_dict), or "
                                       "reset() and capture again")
            return ReplayError("a declared object entry was replaced since the capture", buffer=c.path,
                               expected=f"the {type(c.tensor).__name__} bound at bind time (the graph holds it)",
                               found="nothing" if v is None else f"another {type(v).__name__}", fix=_FIX["object"])
        if isinstance(v, torch.Tensor) and v.data_ptr() == c.ptr and v.shape == c.shape:
            continue
        found = (f"{tuple(v.shape)} at {v.data_ptr():#x}" if isinstance(v, torch.Tensor)
                 else "nothing" if v is None else type(v).__name__)
        return ReplayError(_WHAT.get(c.role, _WHAT["state"]), buffer=c.path,
                           expected=f"{c.shape} at {c.ptr:#x} (the capture's)", found=found,
                           fix=_FIX.get(c.role, _FIX["state"]))
    return None


_WHAT = {"state": "a tensor the graph reads was rebound since the capture",
         "weight": "a weight the graph reads was rebound since the capture",
         "entry": "a declared buffer was rebound since the capture"}
_FIX = {"state": "write into the captured tensor in place (copy_) instead of rebinding the attribute, declare it in a "
                 "StateSpec, or reset() and capture again",
        "weight": "update the weight in place (with torch.no_grad(): p.copy_(new)) instead of assigning a new "
                  "Parameter or .data, or reset() and capture again",
        "entry": "write into the buffer in place (state.write, copy_); after reallocating, bind the object again and "
                 "runner.repoint(state)",
        "object": "keep the captured object (reseed a generator in place: g.manual_seed(s) or g.set_state(...)); "
                  "after rebuilding the metadata, bind it again and reset() the runner"}

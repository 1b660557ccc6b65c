"""Host state a forward's warmups and capture changed, found and (by policy) put back.

A graph bakes the branches its capture run took on host values: a Python flag such as a
sampler's ``probs_valid`` that the warmup with dummy requests flips to True makes the captured
graph read per-slot data the first real request never wrote (TensorRT-LLM #15775). Tensors are
the side-effect tracker's (``graphs/effects.py``); this module takes the plain host values
(``bool``, ``int``, ``float``, ``str``, ``None``, and small tuples of these) of the objects the
forward reaches, before the first warmup and after the last capture, and compares them.

Policies (``host_state=`` on the runner): ``"warn"`` (default: one log line per change, and
``report()``/``graphctl capture`` list them), ``"restore"`` (each changed value is written back
where it was found, so the first real call sees what the caller left), ``"error"``
(``CaptureError`` naming each change, after restoring them).
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable
from typing import Any

import torch

from graphctl.errors import CaptureError, DeclarationError

__all__ = ["HOST_POLICIES", "HostChange", "HostValues", "take", "changes"]

HOST_POLICIES = ("warn", "restore", "error")
_MAX_DEPTH = 6
_MAX_VALUES = 20_000  # a bound on the walk: a model's attributes, not a dataset's
_PLAIN = (bool, int, float, str, type(None))
_SKIP_ATTRS = frozenset({"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                         "_backward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks"})


@dataclasses.dataclass(frozen=True)
class HostChange:
    """One plain host value that differs after the warmups and capture."""

    path: str  # where the forward reaches it, e.g. "sampler.probs_valid"
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.path} {self.before!r} -> {self.after!r}"


# path -> (holder, how, key, value): how is "attr" or "item"; a value read from a tuple has no holder
HostValues = dict[str, tuple[Any, str, Any, Any]]


# modules whose objects are machinery, not user state: graphctl's own, and dynamo's (a compiled
# module's dynamo_ctx holds compiler flags that change on first compile)
_OWN = ("graphctl.graphs.", "graphctl.state.", "torch._dynamo.")


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and len(v) <= 8 and all(isinstance(e, _PLAIN) for e in v))


def take(roots: Iterable[tuple[str, Any]]) -> HostValues:
    """The plain host values reachable from ``roots`` (first path wins), through instance
    attributes, dicts and lists, ``_MAX_DEPTH`` levels deep. Modules, classes, functions and
    tensors are not entered; an ``nn.Module``'s children are, its parameters are not."""
    out: HostValues = {}
    seen: set[int] = set()

    def visit(path: str, v: Any, depth: int) -> None:
        if len(out) >= _MAX_VALUES or depth > _MAX_DEPTH or id(v) in seen or isinstance(v, torch.Tensor):
            return
        if isinstance(v, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            return
        if type(v).__module__.startswith(_OWN):  # graphctl's own runners, ledgers, bound states: it keeps them
            return
        seen.add(id(v))
        items: list[tuple[str, str, Any, Any]] = []
        if isinstance(v, dict):
            items = [(f"{path}[{k!r}]", "item", k, e) for k, e in list(v.items())[:1024]]
        elif isinstance(v, list):
            items = [(f"{path}[{i}]", "item", i, e) for i, e in enumerate(v[:1024])]
        else:
            try:
                attrs = vars(v)
            except TypeError:
                attrs = {}
            items = [(f"{path}.{k}", "attr", k, e) for k, e in list(attrs.items())
                     if not k.startswith("__") and k not in _SKIP_ATTRS]
            if isinstance(v, torch.nn.Module):
                items += [(f"{path}.{n}", "child", n, m) for n, m in v.named_children()]
        for p, how, key, e in items:
            if _plain(e):
                if how != "child":
                    out.setdefault(p, (v, how, key, e))
            else:
                visit(p, e, depth + 1)

    for name, root in roots:
        if _plain(root):
            continue  # an argument passed by value: the forward cannot change the caller's
        visit(name, root, 0)
    visit = None  # noqa: F841 - break the function <-> cell cycle: GC is off during capture_all
    return out


def changes(before: HostValues, after: HostValues) -> list[HostChange]:
    """Every path whose value differs (or appeared, or disappeared) between two takes."""
    missing = object()
    out = []
    for path in list(before) + [p for p in after if p not in before]:
        b = before[path][3] if path in before else missing
        a = after[path][3] if path in after else missing
        if b is missing or a is missing or type(a) is not type(b) or a != b:
            out.append(HostChange(path, None if b is missing else b, None if a is missing else a))
    return out


def put_back(before: HostValues, found: list[HostChange]) -> list[str]:
    """Write each changed value back where it was found. Returns what could not be, each as
    ``"path (why)"``: a value that appeared during the capture (it had no value before to go
    back to: left as is), a holder that refuses the write (a read-only attribute, a frozen
    dataclass, a tuple)."""
    failed = []
    for ch in found:
        entry = before.get(ch.path)
        if entry is None:
            failed.append(f"{ch.path} (appeared during the capture: nothing to put back)")
            continue
        holder, how, key, value = entry
        try:
            if how == "attr":
                setattr(holder, key, value)
            else:
                holder[key] = value
        except Exception as exc:  # noqa: BLE001 - named in the result, the capture goes on
            failed.append(f"{ch.path} ({type(exc).__name__}: {exc})")
    return failed


def check_policy(policy: str) -> None:
    if policy not in HOST_POLICIES:
        raise DeclarationError("unknown host_state policy", expected=" / ".join(HOST_POLICIES), found=policy,
                               fix="warn (default): log and report host values the warmups changed; restore: write "
                                   "them back after capture; error: refuse such a forward")


def refuse(found: list[HostChange]) -> CaptureError:
    return CaptureError("warmup and capture changed host state the graph may have baked", buffer=found[0].path,
                        expected="no host value the forward reaches changed by warmup or capture",
                        found="; ".join(map(str, found)),
                        fix="make the forward's host state independent of warmup calls (compute flags before the "
                            "call), pass host_state='restore' to have graphctl write the values back, or 'warn'")

"""Host state a forward's warmups and capture changed, found and (by policy) put back.

A graph bakes the branches its capture run took on host values: a Python flag such as a
sampler's ``probs_valid`` that the warmup with dummy requests flips to True makes the captured
graph read per-slot data the first real request never wrote (TensorRT-LLM #15775). Tensors are
the side-effect watcher's (``findings/side_effects.py``); this module compares the plain host values
(``bool``, ``int``, ``float``, ``str``, ``None``, and small tuples of these) of the objects the
forward reaches (``graphs/findings/reach.py``), walked before the first warmup and after the last capture.

Policies (``host_state=`` on the runner): ``"warn"`` (default: one log line per change, and
``report()``/``graphctl capture`` list them), ``"restore"`` (each changed value is written back
where it was found, so the first real call sees what the caller left), ``"error"``
(``CaptureError`` naming each change, after restoring them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from graphctl.errors import CaptureError
from graphctl.graphs.findings.reach import HostLeaf
from graphctl.graphs.findings.record import Finding

__all__ = ["HostChange", "HostValues", "changes", "put_back", "refuse"]



@dataclasses.dataclass(frozen=True)
class HostChange(Finding):
    """One plain host value that differs after the warmups and capture."""

    kind: ClassVar[str] = "host_changes"
    path: str  # where the forward reaches it, e.g. "sampler.probs_valid"
    before: Any
    after: Any
    policy: str = ""  # the runner's host_state= (set in reports)

    def __str__(self) -> str:
        return f"{self.path} {self.before!r} -> {self.after!r}"

    def line(self) -> str:
        return f"host state changed by warmup/capture ({self.policy}): {self}"


HostValues = dict[str, HostLeaf]  # path -> where the value sits and what it was (graphs/findings/reach.py)


def changes(before: HostValues, after: HostValues) -> list[HostChange]:
    """Every path whose value differs (or appeared, or disappeared) between two takes."""
    missing = object()
    out = []
    for path in list(before) + [p for p in after if p not in before]:
        b = before[path].value if path in before else missing
        a = after[path].value if path in after else missing
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
        try:
            if entry.how == "attr":
                setattr(entry.holder, entry.key, entry.value)
            else:
                entry.holder[entry.key] = entry.value
        except Exception as exc:  # noqa: BLE001 - named in the result, the capture goes on
            failed.append(f"{ch.path} ({type(exc).__name__}: {exc})")
    return failed


def refuse(found: list[HostChange]) -> CaptureError:
    return CaptureError("warmup and capture changed host state the graph may have baked", buffer=found[0].path,
                        expected="no host value the forward reaches changed by warmup or capture",
                        found="; ".join(map(str, found)),
                        fix="make the forward's host state independent of warmup calls (compute flags before the "
                            "call), pass host_state='restore' to have graphctl write the values back, or 'warn'")

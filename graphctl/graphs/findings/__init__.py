"""What a capture learns of a forward that it does not refuse, as records: one type per kind.

Each kind is one record class (``findings/record.py``'s :class:`Finding`) defined in one module
with the watcher that finds it over the tracked warmups' op stream (``findings/stream.py``), or
found otherwise (host values, by two walks). :data:`KINDS` lists every kind: the ledger
(``findings/ledger.py``) builds their watchers, the report (``analysis/report.py``) lists their
records in this order, a JSON list per ``kind``. Adding a kind is its module and a line here.
"""
from __future__ import annotations

from typing import Any

from graphctl.graphs.findings.hoststate import HostChange
from graphctl.graphs.findings.padding import PaddingHazard
from graphctl.graphs.findings.randomness import RandomUse
from graphctl.graphs.findings.reads import Unreached
from graphctl.graphs.findings.record import Finding
from graphctl.graphs.findings.regions import Published
from graphctl.graphs.findings.side_effects import SideEffect

__all__ = ["Finding", "KINDS", "REPORTED", "grouped"]

# every kind, its watcher run in tracked warmups (Published: refused at capture, never reported)
KINDS: tuple[type[Finding], ...] = (PaddingHazard, Unreached, RandomUse, HostChange, SideEffect, Published)
REPORTED: tuple[type[Finding], ...] = tuple(k for k in KINDS if k is not Published)  # a report's, in its order


def grouped(records: tuple[Any, ...]) -> dict[str, tuple[dict[str, Any], ...]]:
    """Every reported kind's JSON key -> its records as dicts, in order (an empty list for a kind
    without any: the report's schema has every key)."""
    return {k.kind: tuple(r.to_dict() for r in records if type(r) is k) for k in REPORTED}

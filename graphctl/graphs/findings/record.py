"""The one shape every finding has: a frozen dataclass whose class names its kind.

A capture learns things about a forward that it does not refuse: side effects it undoes, padding
hazards, tensors no checked path reaches, draws from undeclared generators, host values its
warmups changed. Each is a record of one class deriving from :class:`Finding`, defined in one
module with the watcher that finds it (``findings/__init__.py`` lists the kinds, in report order).
The report, the CLI and the JSON read records through this interface alone: a kind's ``kind`` is
its JSON key, ``line()`` its line in the report, ``to_dict()`` its JSON object.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from graphctl.graphs.findings.stream import Watcher

__all__ = ["Finding"]


class Finding:
    """Base of every finding record (a frozen dataclass subclassing it)."""

    __slots__ = ()
    kind: ClassVar[str] = ""  # the report's JSON key for this kind's list
    watcher: ClassVar[type[Watcher] | None] = None  # the op stream's watcher that finds it (None: found otherwise)

    def line(self) -> str:
        """The record as one line of ``str(report)`` and ``graphctl capture``."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass

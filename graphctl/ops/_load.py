"""Guarded load of ``graphctl._C``: graphctl must import even when the extension is missing,
was built for another torch, or is disabled; the reason is kept for ``graphctl info``."""
from __future__ import annotations

import dataclasses
import importlib
import json
import traceback
from importlib import resources
from typing import Any

from graphctl.debug import knobs


@dataclasses.dataclass(frozen=True, slots=True)
class ExtensionStatus:
    loaded: bool
    with_cuda: bool
    error: str | None  # one line, shown by `graphctl info`
    detail: str | None  # the full traceback of the failed import
    build: dict[str, Any] | None  # graphctl/_build.json as written by setup.py


def _read_build() -> dict[str, Any] | None:
    try:
        return json.loads(resources.files("graphctl").joinpath("_build.json").read_text())
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return None


def load() -> ExtensionStatus:
    build = _read_build()
    if knobs.no_extension:
        return ExtensionStatus(False, False, "disabled by GRAPHCTL_NO_EXTENSION=1", None, build)
    try:
        mod = importlib.import_module("graphctl._C")
    except Exception as exc:  # any failure (missing .so, ABI mismatch, undefined symbol) -> fallback
        return ExtensionStatus(False, False, f"{type(exc).__name__}: {exc}", traceback.format_exc(), build)
    return ExtensionStatus(True, bool(mod.with_cuda), None, None, build)


STATUS = load()

"""Guarded load of ``graphctl._C``: graphctl must import even when the extension is missing,
was built for another torch, or is disabled; the reason is kept for ``graphctl info``."""
from __future__ import annotations

import dataclasses
import importlib
import json
import traceback
import warnings
from importlib import resources
from typing import Any

from graphctl.knobs import knobs


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
    import torch

    if build is not None and build.get("torch") not in (None, torch.__version__):
        # A C++ extension is tied to the torch release it was compiled against: loading it into
        # another can fail on a symbol or, worse, load and misread tensors. Never try.
        status = ExtensionStatus(False, False, f"built for torch {build['torch']}, running torch {torch.__version__}",
                                 None, build)
    else:
        try:
            mod = importlib.import_module("graphctl._C")
        except Exception as exc:  # any failure (missing .so, ABI mismatch, undefined symbol) -> fallback
            status = ExtensionStatus(False, False, f"{type(exc).__name__}: {exc}", traceback.format_exc(), build)
        else:
            return ExtensionStatus(True, bool(mod.with_cuda), None, None, build)
    warnings.warn(f"graphctl: graphctl._C not loaded ({status.error}); every op runs its pure-PyTorch reference. "
                  f"Rebuild against the torch you run: pip install --no-build-isolation --force-reinstall "
                  f"--no-deps graphctl (see `graphctl info`; GRAPHCTL_NO_EXTENSION=1 silences this)",
                  RuntimeWarning, stacklevel=2)
    return status


STATUS = load()

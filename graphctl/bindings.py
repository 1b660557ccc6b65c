"""The one importer of cuda-bindings (``cuda.bindings``), a leaf every layer may use.

graphctl needs the CUDA runtime and driver APIs that torch does not expose: a graph's node
handles and their parameters (the audit and the census), conditional nodes (the device-side
draft loop), a stream's capture status, DOT export. cuda-bindings is a dependency on the
platforms that have wheels; anywhere else (or in an environment where it was removed) these
return None and the callers degrade as each documents.
"""
from __future__ import annotations

import functools
from typing import Any

__all__ = ["runtime", "driver", "version"]


@functools.cache
def _load() -> tuple[Any, Any, str] | None:
    try:
        import cuda.bindings
        from cuda.bindings import driver as drv
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    return rt, drv, str(cuda.bindings.__version__)


def runtime() -> Any:
    """``cuda.bindings.runtime``, or None when cuda-bindings is not installed."""
    got = _load()
    return got[0] if got is not None else None


def driver() -> Any:
    """``cuda.bindings.driver``, or None when cuda-bindings is not installed."""
    got = _load()
    return got[1] if got is not None else None


def version() -> str | None:
    """The installed cuda-bindings version, or None."""
    got = _load()
    return got[2] if got is not None else None

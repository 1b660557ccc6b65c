"""Where in the user's code something happened: the innermost stack frame outside torch and
graphctl's machinery (the emulated recorder names the line of a capture-illegal op with it, the
side-effect tracker the line of a write)."""
from __future__ import annotations

import functools
import os
import sys
import types

import torch

__all__ = ["GRAPHCTL_DIR", "user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__)
GRAPHCTL_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../graphctl
# graphctl's machinery; its reference engine (graphctl/models) is model code like a user's
_INTERNAL_DIRS = tuple(os.path.join(GRAPHCTL_DIR, d) + os.sep for d in ("graphs", "state", "ops", "cli", "testing"))


@functools.lru_cache(maxsize=4096)
def _shown(filename: str, cwd: str) -> str | None:
    """How a frame's file is named from ``cwd``, or None for torch's and graphctl's machinery
    (once a file and directory)."""
    f = os.path.join(cwd, filename) if not os.path.isabs(filename) else filename
    f = os.path.normpath(f)
    if f.startswith(_TORCH_DIR) or f.startswith(_INTERNAL_DIRS) or "<frozen" in f:
        return None
    rel = os.path.relpath(f, cwd)
    return f if rel.startswith("..") else rel


def user_frame() -> str:
    """The innermost stack frame outside torch and graphctl: the line that issued the op. The
    frames are walked, not extracted (``traceback.extract_stack`` reads every frame's source
    line: a ``stat`` a frame, for each of the tracker's writes)."""
    frame: types.FrameType | None = sys._getframe(1)
    cwd = os.getcwd()
    while frame is not None:
        shown = _shown(frame.f_code.co_filename, cwd)
        if shown is not None:
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"

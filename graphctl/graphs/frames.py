"""Where in the user's code something happened: the innermost stack frame outside torch and
graphctl's machinery (the emulated recorder names the line of a capture-illegal op with it, the
side-effect tracker the line of a write)."""
from __future__ import annotations

import os
import traceback

import torch

__all__ = ["GRAPHCTL_DIR", "user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__)
GRAPHCTL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../graphctl
# graphctl's machinery; its reference engine (graphctl/models) is model code like a user's
_INTERNAL_DIRS = tuple(os.path.join(GRAPHCTL_DIR, d) + os.sep for d in ("graphs", "state", "ops", "cli", "testing"))


def user_frame() -> str:
    """The innermost stack frame outside torch and graphctl: the line that issued the op."""
    for frame in reversed(traceback.extract_stack()):
        f = os.path.abspath(frame.filename)
        if not f.startswith(_TORCH_DIR) and not f.startswith(_INTERNAL_DIRS) and "<frozen" not in f:
            rel = os.path.relpath(f)
            return f"{f if rel.startswith('..') else rel}:{frame.lineno}"
    return "<unknown>"

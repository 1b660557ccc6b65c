"""Where in the user's code something happened: the innermost stack frame outside torch and
graphctl's machinery (the emulated recorder names the line of a capture-illegal op with it, the
side-effect tracker the line of a write)."""
from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable

import torch

from graphctl import ops

__all__ = ["GRAPHCTL_DIR", "caller_fn", "shown", "user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__)
GRAPHCTL_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # .../graphctl
# graphctl's machinery; its reference engine (graphctl/models) is model code like a user's
_INTERNAL_DIRS = tuple(os.path.join(GRAPHCTL_DIR, d) + os.sep for d in ("graphs", "state", "ops", "cli", "testing"))


_INTERNAL_DIRS_AND_TORCH = (_TORCH_DIR, *_INTERNAL_DIRS)
_INTERNAL_PARTS = ("<frozen",)


def _machinery(filename: str) -> bool:
    """A file of torch's or graphctl's machinery (both walks ask this; csrc/handouts.cpp takes the
    same two tuples)."""
    return filename.startswith(_INTERNAL_DIRS_AND_TORCH) or any(p in filename for p in _INTERNAL_PARTS)


@functools.lru_cache(maxsize=4096)
def _shown(filename: str, cwd: str) -> str | None:
    """How a frame's file is named from ``cwd``, or None for torch's and graphctl's machinery
    (once a file and directory)."""
    f = os.path.join(cwd, filename) if not os.path.isabs(filename) else filename
    f = os.path.normpath(f)
    if _machinery(f):
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


# id(code object) -> torch's or graphctl's machinery; the code objects kept alive beside it, so an id
# is never reused while it is a key (a code object's own hash walks its fields: ids are cheaper)
_INTERNAL_CODE: dict[int, bool] = {}
_KEPT: list[types.CodeType] = []


def _internal(code: types.CodeType) -> bool:
    if len(_KEPT) > 4096:
        _INTERNAL_CODE.clear()
        _KEPT.clear()
    v = _INTERNAL_CODE[id(code)] = _machinery(code.co_filename)
    _KEPT.append(code)
    return v


def caller_fn() -> Callable[[], tuple[types.CodeType | None, int]]:
    """:func:`user_frame` as a raw key (code object, line), for the call path, which records where
    each call came from and formats it (:func:`shown`) only when it must say so. A callable taken
    once (no Python frame of its own on the hot path): ``graphctl._C.caller`` bound to its
    arguments (code objects' verdicts cached by address), or :func:`_walk`."""
    return ops.caller_fn(_INTERNAL_DIRS_AND_TORCH, _INTERNAL_PARTS, _walk)


def _walk() -> tuple[types.CodeType | None, int]:
    """:func:`caller_fn`'s walk in Python, its reference: a dict lookup a frame."""
    frame: types.FrameType | None = sys._getframe(1)
    get = _INTERNAL_CODE.get
    while frame is not None:
        code = frame.f_code
        inside = get(id(code))
        if inside is None:
            inside = _internal(code)
        if not inside:
            return code, frame.f_lineno
        frame = frame.f_back
    return None, 0


def shown(at: tuple[types.CodeType | None, int]) -> str:
    """A :func:`caller_fn` key as :func:`user_frame` writes it (``file.py:12``)."""
    code, line = at
    if code is None:
        return "<unknown>"
    return f"{_shown(code.co_filename, os.getcwd()) or code.co_filename}:{line}"

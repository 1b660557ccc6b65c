"""Frozen (non-input) arguments of a graphed forward: what the graph baked in at capture.

A later call must pass the same objects holding the same values. :func:`freeze` takes a
structural copy at capture (tensors by address and layout, scalars and frozen dataclasses by
value, containers element by element, anything else by identity); :func:`first_change` names the first difference, as a
path into the argument (``cfg['scale']``), so an in-place change to a dict or list is refused
with the entry that changed instead of replaying the capture-time value."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["SCALARS", "freeze", "first_change"]

SCALARS = (int, float, bool, str, type(None))


def freeze(v: Any, depth: int = 0) -> Any:
    """A structural copy of a frozen argument: tensors by address and layout, scalars by value,
    containers element by element, anything else by identity."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, str(v.device))
    if isinstance(v, SCALARS):
        return ("scalar", type(v), "nan" if isinstance(v, float) and v != v else v)
    if _settings(v):
        return ("value", type(v), v)  # a frozen record of host values (such as Sampling): equal values, one graph
    if depth < 8 and isinstance(v, (tuple, list)):
        return (type(v), tuple(freeze(e, depth + 1) for e in v))
    if depth < 8 and isinstance(v, dict):
        return (type(v), tuple((k, freeze(e, depth + 1)) for k, e in v.items()))
    return ("object", id(v))


def _settings(v: Any) -> bool:
    """A frozen dataclass instance whose fields are all host scalars: compared by value."""
    if not dataclasses.is_dataclass(v) or isinstance(v, type):
        return False
    frozen = type(v).__dataclass_params__.frozen  # type: ignore[attr-defined]
    return bool(frozen) and all(isinstance(getattr(v, f.name), SCALARS) for f in dataclasses.fields(v))


def first_change(live: Any, want: Any, path: str) -> tuple[str, str, str] | None:
    """``(path, expected, found)`` of the first difference between two frozen copies, or None."""
    if live == want:
        return None
    if live[0] == want[0] and want[0] in (tuple, list, dict) and len(live[1]) == len(want[1]):
        for (a, b), i in zip(zip(live[1], want[1]), range(len(want[1]))):
            if want[0] is dict:
                if a[0] != b[0]:
                    return path, f"key {b[0]!r}", f"key {a[0]!r}"
                sub, a, b = f"{path}[{b[0]!r}]", a[1], b[1]
            else:
                sub = f"{path}[{i}]"
            hit = first_change(a, b, sub)
            if hit is not None:
                return hit
    return path, _show(want), _show(live)


def _show(frozen: Any) -> str:
    kind = frozen[0]
    if kind == "tensor":
        return f"{frozen[2]} {frozen[4]} at {frozen[1]:#x}"
    if kind == "scalar":
        return repr(frozen[2])
    if kind == "object":
        return f"object at {frozen[1]:#x}"
    if kind == "value":
        return repr(frozen[2])
    return f"{kind.__name__} of {len(frozen[1])}"

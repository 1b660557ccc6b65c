"""Entry names as paths into nested objects and containers.

A spec may name a buffer by a path (``"cache.layers[0].keys"``, ``"pools['draft'].offsets"``)
instead of a plain attribute; ``"layers[*].cumulative_length"`` stands for one entry per element
of ``layers``, expanded at ``bind`` (:func:`expand_spec`). Every read and rebind of an entry goes
through :func:`get` and :func:`put`, so paths get the same validation, padding, rebinding
checks, swaps and snapshots as flat attributes, and errors name the full path. A plain name
costs one ``getattr``: parsing happens once per distinct path.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from graphctl.errors import BindError
from graphctl.state.spec import CopyInPlace, Recompute, StateSpec, Swap

__all__ = ["get", "put", "is_path", "steps", "expand_spec"]

_MISSING = object()
_TOKEN = re.compile(r"\.?([A-Za-z_]\w*)|\[(\d+|\*|'[^']*'|\"[^\"]*\")\]")


@functools.lru_cache(maxsize=4096)
def _parse(path: str) -> tuple[tuple[bool, Any], ...]:
    """``((is_item, key), ...)``; ValueError for a malformed path."""
    out, pos = [], 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if m is None or (pos == 0 and path.startswith(".")):
            raise ValueError(f"malformed path {path!r} at character {pos}")
        if m.group(1) is not None:
            out.append((False, m.group(1)))
        else:
            k = m.group(2)
            out.append((True, int(k) if k.isdigit() else k if k == "*" else k[1:-1]))
        pos = m.end()
    return tuple(out)


def steps(name: str) -> tuple[tuple[bool, Any], ...]:
    """``((is_attribute, name or key), ...)``: the lookups from the object to entry ``name``."""
    return tuple((not is_item, key) for is_item, key in _parse(name)) if is_path(name) else ((True, name),)


def is_path(name: str) -> bool:
    return "." in name or "[" in name


def get(obj: Any, name: str, default: Any = _MISSING) -> Any:
    """``obj.<name>`` for a plain name, else follow the path; ``default`` when any step is
    missing (without a default the step's own AttributeError/IndexError/KeyError)."""
    if not is_path(name):
        return getattr(obj, name) if default is _MISSING else getattr(obj, name, default)
    cur = obj
    try:
        for is_item, key in _parse(name):
            cur = cur[key] if is_item else getattr(cur, key)
    except (AttributeError, IndexError, KeyError, TypeError):
        if default is _MISSING:
            raise
        return default
    return cur


def put(obj: Any, name: str, value: Any) -> None:
    """Rebind ``obj.<name>`` (the last step of a path: an attribute or a container item)."""
    if not is_path(name):
        setattr(obj, name, value)
        return
    steps = _parse(name)
    cur = obj
    for is_item, key in steps[:-1]:
        cur = cur[key] if is_item else getattr(cur, key)
    is_item, key = steps[-1]
    if is_item:
        cur[key] = value
    else:
        setattr(cur, key, value)


def _sub(v: Any, i: int) -> Any:
    """``v`` with ``[*]`` made ``[i]``, through the fields of actions that name entries."""
    if isinstance(v, str):
        return v.replace("[*]", f"[{i}]")
    if isinstance(v, Swap):
        return Swap(twin=_sub(v.twin, i))
    if isinstance(v, CopyInPlace) and isinstance(v.source, str):
        return CopyInPlace(source=_sub(v.source, i))
    if isinstance(v, Recompute):
        return Recompute(inputs=tuple(_sub(x, i) for x in v.inputs), fn=v.fn)
    if isinstance(v, tuple):
        return tuple(_sub(x, i) for x in v)
    return v


def expand_spec(spec: StateSpec, obj: Any) -> StateSpec:
    """``spec`` with every ``[*]`` entry expanded to one entry per element of the container
    it names in ``obj`` (a new, unregistered spec); ``spec`` itself when it has none. One
    ``[*]`` per name; the fields naming other entries (twins, sources, inputs, aliases) use the
    same index."""
    entries = spec.entries
    if not any("[*]" in n for n in entries):
        return spec
    out = StateSpec(f"{spec.name}@{type(obj).__qualname__}")
    for name, d in entries.items():
        if "[*]" not in name:
            out._entries[name] = d
            continue
        prefix = name.split("[*]", 1)[0]
        container = get(obj, prefix, None)
        try:
            n = len(container)
        except TypeError:
            raise BindError(f"{type(obj).__qualname__}.{name}: '[*]' over something without a length",
                            buffer=name, expected=f"a list or tuple at {prefix}", found=type(container).__name__,
                            fix="point [*] at a sequence, or name each element") from None
        for i in range(n):
            fields = {f.name: _sub(getattr(d, f.name), i) for f in dataclasses.fields(d) if f.name != "name"}
            concrete = dataclasses.replace(d, name=_sub(name, i), **fields)
            out._entries[concrete.name] = concrete
    return out

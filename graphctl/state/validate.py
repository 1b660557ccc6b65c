"""Bind-time checks of a live metadata object against its compiled plan, and the views of
swapped buffers that a switch must re-point (``BoundState.__init__`` runs them once)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import BindError, SwitchError, did_you_mean
from graphctl.state import paths
from graphctl.state.core import StateCore
from graphctl.state.spec import BufferDecl, CopyInPlace

__all__ = ["validate", "bind_aliases", "byte_range", "check_source", "source_label", "source_meta", "span"]


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last byte ``t`` can touch (its strides included)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _instance_attrs(obj: Any) -> dict[str, Any]:
    try:
        return vars(obj)
    except TypeError:  # __slots__ classes: their views are declared or invisible to a scan
        return {}


def err(st: StateCore, name: str | None, what: str, expected: Any, found: Any, fix: str) -> BindError:
    return BindError(f"{type(st.obj).__qualname__}.{name}: {what}" if name else what, buffer=name,
                     expected=expected, found=found, fix=fix)


def get(st: StateCore, name: str) -> Any:
    try:
        return paths.get(st.obj, name)
    except (AttributeError, IndexError, KeyError, TypeError):
        head = name.split(".")[0].split("[")[0]
        near = did_you_mean(head, getattr(st.obj, "__dict__", {}))
        raise err(st, name, "declared attribute is missing", "an attribute", "none" + near,
                  f"set {type(st.obj).__qualname__}.{name} before bind, or fix the declared name") from None


def validate(st: StateCore) -> None:
    plan = st.plan
    devices: dict[str, torch.device] = {}
    for name, d in plan.buffers.items():
        t = get(st, name)
        if not isinstance(t, torch.Tensor):
            raise err(st, name, "declared buffer is not a tensor", "torch.Tensor", type(t).__name__,
                      "declare plain attributes with spec.object(...)")
        if d.dtype is not None and t.dtype != d.dtype:
            raise err(st, name, "dtype differs from the declaration", d.dtype, t.dtype,
                      f"allocate it as {d.dtype} or fix the declaration")
        if d.shape is not None:
            check_shape(st, name, d, t)
        if not t.is_contiguous():
            raise err(st, name, "buffer is not contiguous", "a dense tensor", f"strides {t.stride()}",
                      "allocate static buffers dense; declare views as aliases=")
        if d.pad is not None:
            why = d.pad.unfit(t.dtype)
            if why is not None:
                raise err(st, name, "padding policy does not fit the dtype", f"values representable in {t.dtype}",
                          why, "pick a padding value inside the dtype's range (and integral for integers)")
        if d.host and t.device.type != "cpu":
            raise err(st, name, "host buffer is not on the CPU", "cpu", t.device, "drop host=True or move it")
        if not d.host:
            devices[name] = t.device
        st.binding.tensors[name] = t
    if devices:
        first, dev = next(iter(devices.items()))
        for name, other in devices.items():
            if other != dev:
                raise err(st, name, "device buffers are on different devices", f"{dev} (as '{first}')", other,
                          "bind one state per device")
        st.binding.device = dev
    if st.device.type == "cuda":
        for name, d in plan.buffers.items():
            t = st.binding.tensors[name]
            if d.host and t.numel() and not t.is_pinned():  # an empty tensor never reports pinned
                raise err(st, name, "host buffer is not pinned", "pinned memory", "pageable memory",
                          "allocate with pin_memory=True so copies are asynchronous")
    for name in plan.objects:
        st.binding.objects[name] = get(st, name)
    check_twins(st)
    check_overlaps(st)
    check_sources(st)


def check_shape(st: StateCore, name: str, d: BufferDecl, t: torch.Tensor) -> None:
    assert d.shape is not None  # called for declared shapes only
    if t.dim() != len(d.shape):
        raise err(st, name, "rank differs from the declared shape", d.shape, tuple(t.shape),
                  "allocate it with the declared number of dimensions")
    for sym, size in zip(d.shape, t.shape):
        if isinstance(sym, int):
            if sym != size:
                raise err(st, name, "dimension differs from the declared shape", d.shape, tuple(t.shape),
                          "allocate it at the declared size")
            continue
        want = st.binding.dims.setdefault(sym, size)
        st.binding.dim_source.setdefault(sym, name)
        if want != size:
            src = st.binding.dim_source[sym]
            origin = f"dims={{'{sym}': {want}}}" if src == name else f"'{src}'"
            raise err(st, name, f"dimension '{sym}' disagrees with {origin}", f"{sym}={want}", f"{sym}={size}",
                      "allocate every buffer sharing a dimension name at one size")


def check_twins(st: StateCore) -> None:
    for name, twin in st.plan.phases["eager"].swaps:
        if name in st.binding.objects:
            if st.binding.objects[name] is st.binding.objects[twin]:
                raise err(st, name, "Swap twin is the same object as the original", "a distinct draft object",
                          f"'{twin}' is the same object", "construct a separate draft object")
            continue
        a, b = st.binding.tensors[name], st.binding.tensors[twin]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise err(st, name, "Swap twin differs in shape or dtype", f"{tuple(a.shape)} {a.dtype}",
                      f"'{twin}' is {tuple(b.shape)} {b.dtype}",
                      "allocate the twin like the original: kernels baked for one must fit the other")


def check_overlaps(st: StateCore) -> None:
    spans = []
    for name, t in st.binding.tensors.items():
        lo, hi = span(t)
        if hi > lo:
            spans.append((t.device, lo, hi, name))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    prev = None
    for s in spans:
        if prev is not None and prev[0] == s[0] and s[1] < prev[2]:
            raise err(st, s[3], f"storage overlaps buffer '{prev[3]}'", "disjoint buffers",
                      f"bytes [{s[1]:#x}, {min(s[2], prev[2]):#x}) shared",
                          "allocate each static buffer separately, or declare the view in aliases=")
        if prev is None or prev[0] != s[0] or s[2] > prev[2]:
            prev = s


def check_sources(st: StateCore) -> None:
    for name, d in st.plan.buffers.items():
        for act in (d.draft, d.refresh):
            if isinstance(act, CopyInPlace) and isinstance(act.source, str):
                src = get(st, act.source)
                check_source(st, name, src, f"source '{act.source}'", lambda *a: err(st, *a))


def source_meta(src: Any) -> tuple:
    """What :func:`check_source` looked at, compared on every switch: the C++ table compares the same."""
    if not isinstance(src, torch.Tensor):
        return (type(src),)
    return (src.dtype, src.device, tuple(src.shape), src.stride(), src.data_ptr())


def source_label(act: Any) -> str:
    """How an error names a copy source: ``source 'dpos'``, or the callable's name."""
    src = act.source
    return f"source '{src}'" if isinstance(src, str) else f"source {getattr(src, '__qualname__', repr(src))}()"


def check_source(st: StateCore, name: str, src: Any, label: str, err: Callable[..., Exception]) -> None:
    dst = st.binding.tensors[name]
    if not isinstance(src, torch.Tensor):
        raise err(name, f"CopyInPlace {label} is not a tensor", "torch.Tensor", type(src).__name__,
                  "return or name an existing tensor")
    if src.shape != dst.shape or src.dtype != dst.dtype or src.device != dst.device or not src.is_contiguous():
        raise err(name, f"CopyInPlace {label} does not match the buffer",
                  f"{tuple(dst.shape)} {dst.dtype} on {dst.device}, contiguous",
                  f"{tuple(src.shape)} {src.dtype} on {src.device}{'' if src.is_contiguous() else ', strided'}",
                  "produce the source at the buffer's shape, dtype and device")


def bind_aliases(st: StateCore) -> dict[str, tuple[tuple[str, torch.Tensor, torch.Tensor | None], ...]]:
    """Per base buffer: (alias, view of the original, same view of the twin or None)."""
    twins = dict(st.plan.phases["eager"].swaps)
    out = {}
    for name, d in st.plan.buffers.items():
        base = st.binding.tensors[name]
        lo, hi = span(base)
        rows = []
        for alias in d.aliases:
            v = get(st, alias)
            ok = isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            vlo, vhi = span(v) if isinstance(v, torch.Tensor) else (0, 0)
            if not ok or vlo < lo or vhi > hi:
                raise err(st, alias, f"declared alias is not a view of '{name}'", f"a view inside '{name}'",
                          type(v).__name__ if not isinstance(v, torch.Tensor) else f"bytes [{vlo:#x}, {vhi:#x})",
                              f"bind it as a view, e.g. {alias} = {name}[:n]")
            twin_view = None
            if name in twins:
                twin = st.binding.tensors[twins[name]]
                off = v.storage_offset() - base.storage_offset()
                twin_view = twin.as_strided(v.shape, v.stride(), twin.storage_offset() + off)
            rows.append((alias, v, twin_view))
        out[name] = tuple(rows)
    for name in twins:
        if name not in st.binding.tensors:
            continue
        declared = {a for a, _, _ in out[name]}
        base = st.binding.tensors[name]
        lo, hi = span(base)
        for attr, v in _instance_attrs(st.obj).items():
            if (attr == name or attr in declared or not isinstance(v, torch.Tensor) or v is base
                    or v.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()):
                continue
            vlo, vhi = span(v)
            if vlo < hi and lo < vhi:
                raise err(st, name, f"attribute '{attr}' is an undeclared view of a swapped buffer",
                          f"'{attr}' declared in aliases=", "an undeclared view",
                          f"add aliases=('{attr}',) so the swap re-points it with the base")
    return out


def expected_bindings(st: StateCore, phase: str | None) -> tuple[tuple[str, Any], ...]:
    """What every declared attribute of ``st.obj`` must be in ``phase`` (None: outside a switch):
    the bind-time object, or its twin where the phase swaps it. Built once per phase."""
    b = st.binding
    exp = b.expect.get(phase)
    if exp is None:
        resolve = st.plan.phases[phase].resolve if phase is not None else {}
        exp = b.expect[phase] = tuple(
            (n, b.tensors[resolve.get(n, n)] if n in b.tensors else b.objects[resolve.get(n, n)])
            for n, _ in st.binding.manifest)
    return exp


def _split(st: StateCore, phase: str | None) -> tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]:
    """The expected bindings of ``phase`` as (plain names, paths): plain ones are checked in one C call."""
    out = st.binding.expect_split.get(phase)
    if out is None:
        hidden = _hidden(st, phase)
        exp = [p for p in expected_bindings(st, phase) if p[0] not in hidden]
        out = st.binding.expect_split[phase] = (tuple(p for p in exp if not paths.is_path(p[0])),
                                         tuple(p for p in exp if paths.is_path(p[0])))
    return out


def _hidden(st: StateCore, phase: str | None) -> frozenset[str]:
    """Entries under an object the phase swaps: nothing reaches them by name inside it."""
    return frozenset(st.plan.phases[phase].hidden) if phase is not None else frozenset()


def check_bindings(st: StateCore, entering: str | None = None) -> None:
    """Raise ``SwitchError`` naming the first declared attribute rebound, deleted or re-viewed
    behind graphctl's back (run on every switch entry and write)."""
    # Fast path, run on every switch and write: every attribute is exactly what it should
    # be now (the bind-time object, or its twin inside a switch).
    # On entry (``entering`` set) the switch owns the state but has not swapped anything yet.
    obj, sw = st.obj, st._active
    phase = sw.phase if sw is not None and entering is None else None
    plain, pathed = _split(st, phase)
    if ops.all_bound(obj, plain) and all(paths.get(obj, n, None) is w for n, w in pathed):
        return
    # Slow path: name the offender. Entering a phase that swaps X accepts X already bound to
    # its twin (a hand-written hook swapped it): the restore target stays the bind-time
    # original, so a repeated swap can never record the twin as "the original". A tensor is
    # accepted only as the very view that was bound: same address, shape, strides, dtype
    # (an expand or a transpose at the same address reads other elements).
    twins = st.plan.phases[entering].resolve if entering is not None else {}
    hidden = _hidden(st, phase)
    for name, want in st._expected(phase):
        if name in hidden:
            continue
        try:
            cur = paths.get(obj, name)
        except (AttributeError, IndexError, KeyError, TypeError):
            raise SwitchError("declared attribute was deleted", buffer=name, expected="the bound attribute",
                              found="no attribute", fix=f"do not del {type(obj).__qualname__}.{name}; set it "
                              "back to the bound tensor, or bind() the object again") from None
        if name in twins and cur is (st.binding.tensors.get(twins[name]) if name in st.binding.tensors
                                     else st.binding.objects.get(twins[name])):
            continue
        if cur is want:
            continue
        if isinstance(want, torch.Tensor):
            if (isinstance(cur, torch.Tensor) and cur.data_ptr() == want.data_ptr() and cur.shape == want.shape
                    and cur.stride() == want.stride() and cur.dtype == want.dtype and cur.device == want.device):
                continue
            found = (f"{tuple(cur.shape)} strides {cur.stride()} at {cur.data_ptr():#x}"
                     if isinstance(cur, torch.Tensor) else type(cur).__name__)
            raise SwitchError("attribute was rebound behind graphctl's back", buffer=name,
                              expected=f"{tuple(want.shape)} strides {want.stride()} at {want.data_ptr():#x} "
                                       "(bound)", found=found,
                              fix="static buffers must keep their address and layout: write in place with "
                                  "state.write(), or call graphctl.bind() again after reallocating")
        raise SwitchError("attribute was rebound behind graphctl's back", buffer=name,
                          expected="the object bound at bind()", found="another object",
                          fix="rebind through the spec (Swap) or call graphctl.bind() again")

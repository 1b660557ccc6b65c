"""Writes through graphctl: ``write`` (in place, with write-through recompute of every derived
buffer), ``pad`` (the padding policies of a batch's tail) and the debug ``check``. Each write
or pad is all or nothing: checked first, then applied under one held-interrupt section with an
undo copy in the ``write`` arena slots, and rolled back if anything raises. ``BoundState``
(``graphctl.state.bound``) delegates to these; they know a state only through its attributes."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from graphctl import ops
from graphctl.errors import StaleBufferError, SwitchError, did_you_mean
from graphctl.knobs import knobs
from graphctl.state import chains, paths
from graphctl.state.core import StateCore
from graphctl.state.interrupts import deferred
from graphctl.state.spec import BufferDecl, OpCall
from graphctl.state.validate import byte_range

__all__ = ["write", "write_many", "pad", "check"]

_KNOBS = knobs.live()  # a plain dict lookup on every write


def write_group(st: StateCore, names: tuple[str, ...]) -> tuple[list[tuple[list, list]], tuple[str, ...]]:
    """The undo copy of a write or pad: per device, the tensors it may change and their
    ``write`` slots (one fused copy each: a fused op never mixes host and device memory), and
    the ``Stable`` ones among them (never cloned, so a failed write cannot roll them back)."""
    key = (st._active.phase if st._active is not None else None, names)
    g = st.binding.write_groups.get(key)
    if g is None:
        by_dev: dict[torch.device, tuple[list, list]] = {}
        stable = []
        for n in names:
            t = paths.get(st.obj, n)
            held = next(e for e in st.binding.tensors if st.binding.tensors[e] is t)
            if not st.plan.buffers[held].switched:  # Stable scratch, Persistent state: never cloned
                stable.append(n)
                continue
            statics, slots = by_dev.setdefault(t.device, ([], []))
            statics.append(t)
            slots.append(st.binding.arena["write", held])
        g = st.binding.write_groups[key] = (list(by_dev.values()), tuple(stable))
    return g


@contextlib.contextmanager
def all_or_nothing(st: StateCore, what: str, names: tuple[str, ...]) -> Iterator[None]:
    """Own the state, hold interrupts, keep an undo copy of ``names``; roll back on any raise."""
    with deferred(), st._owned(what):
        groups, stable = write_group(st, names)
        for statics, slots in groups:
            ops.copy_(slots, statics, validate=False)
        try:
            yield
        except BaseException as exc:
            failures: list[tuple[str, BaseException]] = [
                (n, RuntimeError("Stable buffers are never cloned, so a failed write cannot roll them back"))
                for n in stable]
            for statics, slots in groups:
                try:
                    ops.copy_(statics, slots, validate=False)
                except BaseException as err:
                    failures.append((f"{what} rollback", err))
            if failures:
                st._poison(failures)
                exc.add_note(f"graphctl: {what} could not be rolled back fully; state poisoned")
            raise


def sharing(st: StateCore, name: str) -> tuple[str, ...]:
    """Entries bound to the same tensor as ``name`` right now (a swapped attribute and its
    twin inside a switch): a write through any of them changes the inputs of all."""
    sw = st._active
    if sw is None or not sw.resolve:
        return (name,)
    held = sw.resolve.get(name, name)
    return tuple(e for e in st.binding.tensors if sw.resolve.get(e, e) == held) or (name,)


def write(st: StateCore, name: str, value: torch.Tensor) -> None:
    """See ``BoundState.write``."""
    write_many(st, {name: value})


def write_many(st: StateCore, values: Mapping[str, torch.Tensor]) -> None:
    """See ``BoundState.write_many``: every value checked, then one held section, one undo copy,
    the writes, and each derived buffer of any of them recomputed once, in dependency order."""
    st._begin_use("write()")
    if not isinstance(values, Mapping) or not values:
        raise SwitchError("write_many() needs a non-empty mapping", buffer=None,
                          expected="{buffer name: tensor, ...}", found=type(values).__name__,
                          fix="pass a dict, e.g. state.write_many({'seq_lens': a, 'kv_lens': b})")
    sw = st._active
    if sw is not None and st._owner != threading.get_ident():
        raise st._busy("write()")
    items = []
    for name, value in values.items():
        d = st.plan.buffers.get(name)
        if d is None:
            kind = "an object entry" if name in st.plan.objects else "not declared" + did_you_mean(
                name, st.plan.buffers)
            raise SwitchError("write() target is not a declared buffer", buffer=name, expected="a buffer entry",
                              found=kind, fix="declare it with spec.buffer(...); objects are rebound with Swap")
        if d.derive is not None:
            raise SwitchError("write() to a derived buffer", buffer=name, expected="a write to one of its inputs",
                              found=f"Recompute(inputs={list(d.derive.inputs)})",
                              fix="write its inputs; graphctl recomputes it from them")
        if sw is not None and name not in st.plan.mutable:
            raise SwitchError("write() inside a switch to a buffer not declared mutable", buffer=name,
                              expected="mutable=True", found="mutable=False",
                              fix="declare mutable=True so the switch snapshots and restores it")
        if sw is not None and sw.phase == "refresh":
            raise SwitchError("write() inside a refresh switch", buffer=name,
                              expected="no writes (nothing is snapshotted for them)", found="a write",
                              fix="write before the replay, or use phase='replay'")
        items.append((name, d, value))
    st._check_bindings()  # every input a recompute reads must still be the bound tensor
    expected = st._expected(sw.phase if sw is not None else None)
    targets = []
    for name, d, value in items:
        target = expected[st.binding.index[name]][1]
        check_value(st, name, d, target, value)
        targets.append(target)
    if _KNOBS["check_lengths"]:
        for name, _, value in items:
            check_lengths(st, name, value)
    check_one_storage(st, tuple(values))
    names = tuple(values)
    deps = st.plan.closure(tuple(dict.fromkeys(x for n in names for x in sharing(st, n))))
    what = f"write('{names[0]}')" if len(names) == 1 else f"write_many({', '.join(names)})"
    for i, ((name, d, value), target) in enumerate(zip(items, targets)):
        if overlaps(value, target):  # a view of the buffer itself (write("lens", m.lens[1:])): copy from a copy
            items[i] = (name, d, value.clone())
    with all_or_nothing(st, what, names + deps), torch.no_grad():
        for (_, d, value), target in zip(items, targets):
            ax = d.axis_dim if d.axis is not None else 0
            n = value.shape[ax] if value.dim() else 1
            if d.axis is not None and n < target.shape[ax]:
                target.narrow(ax, 0, n).copy_(value)
                d.padding.apply(target.narrow(ax, n, target.shape[ax] - n),
                                target.narrow(ax, n - 1, 1) if n else None, ax)
            else:
                target.copy_(value)
        chains.recompute(st, deps)  # one replayed CUDA graph where sound (state/chains.py)


def overlaps(value: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether ``value`` shares bytes with ``target`` (a copy between them would read what it writes)."""
    if value.device != target.device or value.untyped_storage().data_ptr() != target.untyped_storage().data_ptr():
        return False
    if value.data_ptr() == target.data_ptr() and value.shape == target.shape and value.stride() == target.stride():
        return False  # the buffer itself (or the same view): a copy onto itself, which torch allows
    (lo, hi), (tlo, thi) = byte_range(value), byte_range(target)
    return lo < thi and tlo < hi


def check_lengths(st: StateCore, name: str, value: torch.Tensor) -> None:
    """Under ``GRAPHCTL_CHECK_LENGTHS``: a value an OpCall token map reads as lengths has none negative."""
    for derived, d in st.plan.buffers.items():
        fn = d.derive.fn if d.derive is not None else None
        if isinstance(fn, OpCall) and name in fn.length_inputs(d.recompute.inputs):
            bad = ops.reference.first_negative(value)  # a host sync on a GPU: the knob's documented cost
            if bad is not None:
                raise SwitchError("write() value holds a negative length", buffer=name,
                                  expected=f"lengths >= 0 ({fn.op} of '{derived}' reads them)",
                                  found=f"{bad[1]} at index {bad[0]}",
                                  fix="write non-negative lengths (0 for a request with no tokens)")


def check_one_storage(st: StateCore, names: tuple[str, ...]) -> None:
    """Two entries of one ``write_many`` bound to one tensor right now (a swapped attribute and its
    twin inside a switch) would leave the outcome to dict order: refused, naming both."""
    sw = st._active
    if sw is None or not sw.resolve or len(names) < 2:
        return
    held: dict[str, str] = {}
    for n in names:
        h = sw.resolve.get(n, n)
        if h in held:
            raise SwitchError("write_many() gives one storage two values", buffer=n,
                              expected="one value per tensor",
                              found=f"'{held[h]}' and '{n}' are one tensor inside this '{sw.phase}' switch",
                              fix=f"write only one of '{held[h]}' and '{n}'")
        held[h] = n


def check_value(st: StateCore, name: str, d: BufferDecl, target: torch.Tensor, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise SwitchError("write() value is not a tensor", buffer=name, expected="torch.Tensor",
                          found=type(value).__name__, fix="wrap it with torch.as_tensor on the buffer's device")
    if value.dtype != target.dtype:
        raise SwitchError("write() value has another dtype", buffer=name, expected=target.dtype, found=value.dtype,
                          fix=f"convert it first (value.to({target.dtype})); graphctl never casts silently")
    if value.device != target.device:
        raise SwitchError("write() value is on another device", buffer=name, expected=target.device,
                          found=value.device, fix="stage it on the buffer's device first")
    ok = value.dim() == target.dim()
    if ok:
        for i, (v, t) in enumerate(zip(value.shape, target.shape)):
            if v != t and not (d.axis is not None and i == d.axis_dim and v < t):
                ok = False
    if not ok:
        rule = (f"{tuple(target.shape)} or fewer rows along dim {d.axis_dim} ('{d.axis}')"
                if d.axis is not None else f"{tuple(target.shape)} (no axis declared)")
        raise SwitchError("write() value has the wrong shape", buffer=name, expected=rule,
                          found=tuple(value.shape), fix="write at most the buffer's extent; padding fills the tail")


def pad(st: StateCore, counts: Mapping[str, int], ends: Mapping[str, int] | None = None) -> None:
    """See ``BoundState.pad``."""
    st._begin_use("pad()")
    if st._active is not None:
        if st._owner != threading.get_ident():
            raise st._busy("pad()")
        raise SwitchError("pad() inside a switch", expected="pad before entering the switch",
                          found=f"active phase {st._active.phase}", fix="pad, then switch")
    st._check_bindings()
    work = []
    for name, d, t in st.binding.padded:
        if d.axis is not None and d.axis in counts:
            n = counts[d.axis]
            if not isinstance(n, int) or not 0 <= n <= t.shape[d.axis_dim]:
                raise SwitchError("pad() count outside the buffer", buffer=name,
                                  expected=f"an int, 0 <= {d.axis} <= {t.shape[d.axis_dim]}", found=n,
                                  fix="pass the live count, at most the bucket size")
            end = min(t.shape[d.axis_dim], ends.get(d.axis, t.shape[d.axis_dim])) if ends else t.shape[d.axis_dim]
            if end > n and d.padding.kind != "keep":
                work.append((name, d, t, n, end))
    if not work:
        return
    touched = tuple(w[0] for w in work)
    deps = st.plan.closure(touched)
    with all_or_nothing(st, "pad()", touched + deps), torch.no_grad():
        for _, d, t, n, end in work:
            d.padding.apply(t.narrow(d.axis_dim, n, end - n), t.narrow(d.axis_dim, n - 1, 1) if n else None,
                            d.axis_dim)
        for dep in deps:
            st._recompute(dep)


def check(st: StateCore) -> None:
    """See ``BoundState.check``."""
    st._begin_use("check()")
    err = first_stale(st)
    if err is not None:
        raise err


def stale_at_exit(st: StateCore, sw: Any) -> Exception | None:
    """Under ``GRAPHCTL_CHECK_STALE``, at a switch's exit before its restore: a derived buffer
    no longer equal to ``fn(inputs)`` (an input written in place inside the switch, e.g.
    ``meta.seq_lens.fill_(1)``, which the restore would hide). Returned, never raised here."""
    try:
        err = first_stale(st)
    except Exception as exc:  # a Recompute fn that raised in the check: reported after the restore, which runs
        exc.add_note("raised by GRAPHCTL_CHECK_STALE's check at a switch's exit; the switch was restored")
        return exc
    if err is not None:
        err.add_note(f"found at the exit of the '{sw.role}' switch ({sw.phase}), before its restore")
    return err


def first_stale(st: StateCore) -> StaleBufferError | None:
    """The first derived buffer that differs from ``fn(inputs)`` recomputed into scratch, as an error."""
    for name in st.plan.order:
        live = paths.get(st.obj, name)
        scratch = st.binding.scratch.get(name)
        if scratch is None or scratch.shape != live.shape or scratch.device != live.device:
            scratch = st.binding.scratch[name] = torch.empty_like(live)
        st._recompute(name, out=scratch)
        a, b = live.reshape(-1).view(torch.uint8), scratch.reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            es = live.element_size()
            idx = int((a != b).nonzero()[0]) // es
            inputs = list(st.plan.buffers[name].recompute.inputs)
            return StaleBufferError("derived buffer is stale", buffer=name,
                                   expected=f"fn({', '.join(inputs)})[{idx}] = {scratch.reshape(-1)[idx].item()}",
                                   found=live.reshape(-1)[idx].item(), index=idx,
                                   fix=f"an input of '{name}' was written behind graphctl's back: "
                                       "write inputs with state.write()")
    return None

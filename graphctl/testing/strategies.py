"""Hypothesis strategies for random backends: specs with random dtypes, shapes, axes, action
mixes and acyclic dependency graphs, and a live object that matches each spec.

A drawn :class:`Case` is self-contained (its own metadata type and :class:`Registry`), so
examples never collide in the global registry."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st

from graphctl.state import CopyInPlace, Pad, Recompute, Registry, Stable, StateSpec, Swap
from graphctl.state.spec import BufferDecl, ObjectDecl

__all__ = ["Case", "cases", "random_tensor", "combine", "DTYPES"]

DTYPES = (torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
          torch.float64)


@dataclasses.dataclass
class Case:
    """A metadata object, the registry holding its spec, and how to draw values for it."""

    obj: Any
    spec: StateSpec
    registry: Registry
    gen: torch.Generator
    device: torch.device = torch.device("cpu")
    native: bool = True  # the machines drive the native switch table (what users get) or the Python steps

    def value(self, name: str, rows: int | None = None) -> torch.Tensor:
        """A fresh random value for buffer ``name`` (``rows`` along its axis, if given)."""
        t = getattr(self.obj, name)
        shape = list(t.shape)
        if rows is not None:
            decl = self.spec.entries[name]
            assert isinstance(decl, BufferDecl)  # only buffers have rows
            shape[decl.axis_dim] = rows
        return random_tensor(shape, t.dtype, self.gen, t.device)


def random_tensor(shape, dtype: torch.dtype, gen: torch.Generator, device=None) -> torch.Tensor:
    """Random contents (never all zeros for non-empty shapes) on the CPU, then moved."""
    shape = tuple(shape)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(7).to(dtype)
    elif dtype == torch.uint8:
        t = torch.randint(1, 200, shape, generator=gen, dtype=torch.int64).to(dtype)
    else:
        t = torch.randint(-100, 100, shape, generator=gen, dtype=torch.int64).to(dtype)
    return t.to(device) if device is not None else t


def combine(out: torch.Tensor, *inputs: torch.Tensor) -> None:
    """A capturable, allocation-free derived-buffer function: ``out = ((x0*3 + x1)*3 + x2)...``."""
    out.copy_(inputs[0])
    for x in inputs[1:]:
        out.mul_(3).add_(x)


_PADS = st.sampled_from([Pad.zero(), Pad.fill(-7), Pad.clamp(0, 50), Pad.clamp(-3), Pad.keep(), Pad.edge(),
                         Pad.arange(3)])


@st.composite
def cases(draw: Callable, device: str = "cpu", max_plain: int = 5) -> Case:
    """Draw a random spec and an object matching it."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    n = draw(st.integers(0, 9))
    shape = (n,) if draw(st.booleans()) else (n, draw(st.integers(1, 4)))
    dims = ("N",) if len(shape) == 1 else ("N", "M")
    cls = type(f"RandomMetadata{seed}", (), {})
    obj = cls()
    spec = StateSpec(f"random-{seed}")
    tensors: list[str] = []  # names usable as Recompute inputs
    refreshed: set[str] = set()

    def alloc(name: str, dtype: torch.dtype, host: bool = False) -> torch.Tensor:
        t = random_tensor(shape, dtype, gen, "cpu" if host else dev)
        if host and dev.type == "cuda":
            t = t.pin_memory()
        setattr(obj, name, t)
        return t

    for i in range(draw(st.integers(1, max_plain))):
        name = f"b{i}"
        dtype = draw(st.sampled_from(DTYPES))
        host = dev.type == "cuda" and draw(st.booleans())
        axis = draw(st.sampled_from([None, "seq"]))
        pad = draw(_PADS) if axis else None
        if pad is not None and pad.unfit(dtype) is not None:  # bind refuses what the dtype cannot hold
            pad = Pad.clamp(0, 50) if pad.kind == "clamp" else Pad.fill(7)
        action = draw(st.sampled_from(["none", "swap", "copy", "copy_fn", "stable"]))
        mutable = action != "stable" and draw(st.booleans())
        aliases: tuple[str, ...] = ()
        base = alloc(name, dtype, host)
        if n >= 2 and draw(st.booleans()):
            aliases = (f"v{i}",)
            setattr(obj, f"v{i}", base[: n - 1])
        draft: Swap | CopyInPlace | Stable | None = None
        if action == "swap":
            twin = f"d{i}"
            alloc(twin, dtype, host)
            refresh = None
            if draw(st.booleans()):
                alloc(f"src_d{i}", dtype, host)
                refresh = CopyInPlace(source=f"src_d{i}")
                refreshed.add(twin)
            spec.buffer(twin, shape=dims, dtype=dtype, readers={"draft"}, host=host, refresh=refresh,
                        mutable=draw(st.booleans()))
            tensors.append(twin)
            draft = Swap(twin=twin)
        elif action in ("copy", "copy_fn"):
            src = f"src_b{i}"
            alloc(src, dtype, host)
            draft = CopyInPlace(source=src if action == "copy" else _getter(src))
        elif action == "stable":
            draft = Stable()
        spec.buffer(name, shape=dims, dtype=dtype, axis=axis, pad=pad, mutable=mutable, host=host,
                    aliases=aliases, draft=draft)
        tensors.append(name)

    for i in range(draw(st.integers(0, 2))):
        name = f"o{i}"
        setattr(obj, name, object())
        draft = None
        if draw(st.booleans()):
            setattr(obj, f"do{i}", object())
            spec.object(f"do{i}")
            draft = Swap(twin=f"do{i}")
        spec.object(name, draft=draft)

    for i in range(draw(st.integers(0, 3))):
        # combine() needs its inputs on the derived buffer's device: no host mirrors on CUDA
        pool = [t for t in tensors if not (dev.type == "cuda" and _host(spec.entries[t]))]
        if not pool:
            break
        inputs = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
        name = f"r{i}"
        # anything recomputed from a replay refresh must be read by draft segments only
        feeds_refreshed = any(x in refreshed for x in inputs)
        readers = {"draft"} if feeds_refreshed else draw(st.sampled_from([{"target", "draft"}, {"target"}, {"draft"}]))
        alloc(name, torch.float32)
        spec.buffer(name, shape=dims, dtype=torch.float32, readers=readers, derive=Recompute(inputs=inputs, fn=combine))
        if feeds_refreshed:
            refreshed.add(name)
        tensors.append(name)

    registry = Registry()
    registry.register(cls, spec)
    plan = spec._plan
    for name in plan.order:  # start consistent: derived = fn(inputs)
        rc = plan.buffers[name].derive
        rc.fn(getattr(obj, name), *(getattr(obj, x) for x in rc.inputs))
    return Case(obj=obj, spec=spec, registry=registry, gen=gen, device=dev, native=draw(st.booleans()))


def _getter(attr: str) -> Callable[[Any], torch.Tensor]:
    def source(obj: Any) -> torch.Tensor:
        return getattr(obj, attr)

    source.__name__ = f"get_{attr}"
    return source


def _host(decl: BufferDecl | ObjectDecl) -> bool:
    return isinstance(decl, BufferDecl) and decl.host

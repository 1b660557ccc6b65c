"""Timings and coverage of a captured runner, through its public surface only.

:func:`measure` times the whole graphed call and the eager forward per bucket, each at its own
size (the example's items, repeated when the bucket holds more); every declared buffer and side
effect is restored before each timed call, outside the timing, so a forward that advances a
bounded cache never runs off its end however many iterations are timed. :func:`coverage` says
what serves each batch size: a bucket, an eager fallback, or an error.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from graphctl.errors import ReplayError, noted
from graphctl.graphs.capture.bucket import BucketGraph
from graphctl.graphs.capture.inputs import Buckets, StaticInput
from graphctl.state.snapshot import Snapshot

__all__ = ["Measurable", "measure", "coverage", "median_us"]


class Measurable(Protocol):
    """What :func:`measure` and :func:`coverage` use of a runner (``GraphRunner`` has it)."""

    fn: Callable[..., Any]
    buckets: Buckets

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    @property
    def inputs(self) -> tuple[StaticInput, ...]: ...
    @property
    def example_items(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def fallbacks(self) -> dict[str, int]: ...
    def example_arguments(self) -> dict[str, Any]: ...
    def assemble(self, values: dict[str, Any]) -> tuple[tuple, dict]: ...
    def guard_all(self) -> Snapshot: ...
    def record(self, bucket: int) -> BucketGraph: ...
    @property
    def captured(self) -> tuple[int, ...]: ...


def measure(runner: Measurable, iters: int = 20) -> None:
    """Fill each bucket record's ``replay_us`` and ``eager_us`` (see the module docstring)."""
    arguments = runner.example_arguments()
    n = runner.example_items
    with runner.guard_all() as given:
        for b in runner.captured:
            cap = runner.record(b)
            args, kwargs = runner.assemble({**arguments, **tiled(runner.inputs, arguments, n, b)})
            before = cap.replays
            with noted(f"graphctl: measure() of bucket {b}, graphed call"):
                cap.replay_us = median_us(runner.device, lambda: runner(*args, **kwargs), iters, given.restore)
            if cap.replays - before < iters:  # every timed call must have replayed this bucket
                raise ReplayError(f"measure() of bucket {b} did not replay it", expected=f"{iters} replays",
                                  found=f"{cap.replays - before}", fix="report this: the bucket picked for "
                                  f"a batch of {b} is {runner.buckets.pick(b)}")
            with noted(f"graphctl: measure() of bucket {b}, eager forward"):
                cap.eager_us = median_us(runner.device, lambda: runner.fn(*args, **kwargs), iters, given.restore)



def coverage(runner: Measurable, sizes: Iterable[int] | None = None) -> dict[int, str]:
    """Batch size -> ``"bucket B"``, ``"eager: <reason>"`` (a fallback) or ``"error: <message>"``,
    calling the runner on the example's first ``n`` items (sizes past the example's are skipped)."""
    arguments = runner.example_arguments()
    items = runner.example_items
    sizes = range(1, min(items, runner.buckets.largest) + 1) if sizes is None else sizes
    out: dict[int, str] = {}
    with runner.guard_all() as given:  # the caller's state (and side effects) back after every call
        for n in sizes:
            if n > items:
                continue  # the example cannot make a batch this large
            head = {si.name: arguments[si.name].narrow(si.dim, 0, n * si.per_item) for si in runner.inputs}
            args, kwargs = runner.assemble({**arguments, **head})
            before = runner.fallbacks
            try:
                runner(*args, **kwargs)
            except ReplayError as exc:
                out[n] = f"error: {str(exc).splitlines()[0]}"
                continue
            finally:
                given.restore()
            new = [r for r, c in runner.fallbacks.items() if c > before.get(r, 0)]
            out[n] = f"eager: {new[0]}" if new else f"bucket {runner.buckets.pick(n)}"
    return out


def median_us(device: torch.device, fn: Callable[[], Any], iters: int, reset: Callable[[], None]) -> float:
    """Median µs of ``fn`` over ``iters`` calls, ``reset`` before each (outside the timing): CUDA
    events on a CUDA device, the host clock elsewhere."""
    reset()
    fn()  # settle caches and lazy work
    samples = []
    if device.type == "cuda":
        for _ in range(iters):
            reset()  # queued before the start event: not timed
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3)
    else:
        for _ in range(iters):
            reset()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    reset()
    samples.sort()
    return samples[len(samples) // 2]


def tiled(inputs: Sequence[StaticInput], arguments: dict[str, Any], n: int, b: int) -> dict[str, torch.Tensor]:
    """The example's static inputs at ``b`` items: its first ``b`` items, or its ``n`` items
    repeated whole when ``b > n``."""
    out = {}
    for si in inputs:
        t = arguments[si.name]
        if b <= n:
            out[si.name] = t.narrow(si.dim, 0, b * si.per_item)
        else:
            idx = torch.arange(b * si.per_item, device=t.device) % (n * si.per_item)
            out[si.name] = t.index_select(si.dim, idx)
    return out

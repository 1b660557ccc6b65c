"""Verify mode: for each bucket, the eager forward and the graph replay on the same fresh random
inputs, outputs and input padding poisoned before the replay, compared output by output.

``runner.verify()`` returns one :class:`VerifyResult` per bucket; a failing one names the first
mismatching output (its pytree path), the first mismatching index, and the two values. Random
inputs follow the capture example: integers drawn in the example's ``[min, max]`` (token ids
stay in the vocabulary), floats with its mean and spread. Each bucket is checked at ``n`` equal
to the bucket and at an ``n`` strictly inside it, above the next smaller bucket (so padding is
live), wherever such an ``n`` exists.
Both runs start from the same state: every non-``Stable`` buffer and every restored side effect
is put back between them. Then every write is compared too (``runner.written(n)``: the mutable
declared buffers' live rows, and the side effects the write tracker found, whole): a mismatch
there is named ``write <path> (<op> at <file:line>)``. That is how a padded lane writing live
memory where eager writes nothing (a padded slot index of 0) fails verify even when every
output agrees.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from graphctl.errors import DeclarationError, noted

__all__ = ["Mismatch", "Verifiable", "VerifyResult", "verify"]


class Verifiable(Protocol):
    """What :func:`verify` uses of a runner (``GraphRunner`` has it): the forward, the call
    itself, the example, the static inputs and outputs to poison, a guard of the caller's state."""

    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    @property
    def captured(self) -> tuple[int, ...]: ...
    @property
    def inputs(self) -> Sequence[Any]: ...  # StaticInput: name, dim, per_item
    def example_arguments(self) -> dict[str, Any]: ...
    def assemble(self, values: dict[str, Any]) -> tuple[tuple, dict]: ...
    def guard_all(self) -> Any: ...  # a Snapshot: a context manager with restore()
    def outputs(self, bucket: int) -> list[torch.Tensor]: ...
    def static_input(self, name: str) -> torch.Tensor: ...
    def written(self, n: int) -> list[tuple[str, str, torch.Tensor]]: ...  # (name, who writes it, tensor)
    def pad_state(self, n: int) -> None: ...  # the bound state describes a batch of n (rows past n padded)

_POISON = {True: float("nan"), False: -(2**30)}


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    output: str  # pytree path of the output, e.g. "[0]" or ".drafts"
    index: tuple[int, ...]
    expected: Any
    found: Any


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyResult:
    bucket: int
    n: int
    outputs: int
    mismatch: Mismatch | None  # an output (or, with writes="error", a write) that differs: not ok
    write: Mismatch | None = None  # with writes="warn": the first write that differs (ok is unaffected)
    variant: str = ""  # a variant runner's result: its variant values ("k=3")

    @property
    def ok(self) -> bool:
        return self.mismatch is None

    def __str__(self) -> str:
        at = f"{self.variant} " if self.variant else ""
        if self.ok:
            text = f"{at}bucket {self.bucket} (n={self.n}): {self.outputs} outputs equal"
            if self.write is not None:
                w = self.write
                text += (f"; warning: {w.output} differs first at index {w.index}: eager {w.expected}, replay "
                         f"{w.found} (a padded lane writing memory eager leaves alone; harmless only if it is "
                         "scratch nobody reads)")
            return text
        m = self.mismatch
        assert m is not None  # not ok: a mismatch is named
        what = m.output if m.output.startswith("write ") else f"output {m.output}"
        return (f"{at}bucket {self.bucket} (n={self.n}): {what} differs first at index {m.index}: "
                f"eager {m.expected}, replay {m.found}")


def _like(example: torch.Tensor, rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    # drawn on the CPU with the CPU generator, in explicit dtypes, then moved: never from the
    # global defaults (torch.set_default_device("cuda") or a float64 default must not matter)
    shape = list(example.shape)
    shape[dim] = rows
    if example.dtype.is_floating_point:
        std = float(example.float().std()) if example.numel() > 1 else 1.0
        v = torch.randn(shape, generator=gen, device="cpu", dtype=torch.float32) * (std or 1.0)
        v = v + float(example.float().mean())
    elif example.dtype == torch.bool:
        v = torch.randint(0, 2, shape, generator=gen, device="cpu").bool()
    else:
        lo, hi = int(example.min()), int(example.max())
        v = torch.randint(lo, hi + 1, shape, generator=gen, device="cpu", dtype=torch.int64)
    return v.to(example.dtype).to(example.device)


def _first_difference(want: torch.Tensor, got: torch.Tensor, rtol: float, atol: float) -> tuple | None:
    if want.shape != got.shape:
        return (), tuple(want.shape), tuple(got.shape)
    if want.dtype.is_floating_point:
        a, b = want.double(), got.double()
        bad = ~(torch.isclose(a, b, rtol=rtol, atol=atol) | (torch.isnan(a) & torch.isnan(b)))
    else:
        bad = want != got
    if not bool(bad.any()):
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return idx, want[idx].item(), got[idx].item()


def verify(runner: Verifiable, *, gen: torch.Generator | None = None, rtol: float = 1e-5, atol: float = 1e-5,
           writes: str = "warn", inside: bool = True) -> tuple[VerifyResult, ...]:
    """See the module docstring. ``writes``: ``"warn"`` (a differing write is reported in
    ``VerifyResult.write``, ``ok`` unaffected: graphctl cannot tell a reserved scratch slot from
    live memory), ``"error"`` (it fails the result), ``"off"`` (outputs only). ``inside=False``:
    only ``n`` equal to each bucket, for a forward that cannot run eagerly on fewer items than
    its state holds (a Hugging Face decode step over a whole-batch cache)."""
    if writes not in ("warn", "error", "off"):
        raise DeclarationError("unknown verify(writes=...)", expected="'warn', 'error' or 'off'", found=repr(writes),
                               fix="writes='error' fails a result whose writes differ; 'warn' reports them")
    arguments = runner.example_arguments()  # raises CaptureError when nothing is captured
    gen = gen or torch.Generator(device="cpu").manual_seed(0)
    sizes = runner.captured
    results = []
    for i, b in enumerate(sizes):
        lo = sizes[i - 1] + 1 if i else 1
        # n == b, and an n strictly inside the bucket (padding live) wherever one exists
        ns = [b] if lo >= b or not inside else [int(torch.randint(lo, b, (1,), generator=gen, device="cpu")), b]
        for n in ns:
            lives = {si.name: _like(arguments[si.name], n * si.per_item, si.dim, gen) for si in runner.inputs}
            args, kwargs = runner.assemble({**arguments, **lives})
            with runner.guard_all() as state:
                # both runs see a state of n items, as after a caller's prepare for n: the example's state
                # may describe more items than n (live rows past the bucket that the replay would read)
                runner.pad_state(n)
                fix = ("; if the forward cannot run on fewer items than its bucket, verify(inside=False) checks "
                       "n = the bucket only" if n < b else "")
                with torch.no_grad(), noted(f"graphctl: verify() of bucket {b} at n={n}, the eager forward{fix}"):
                    want, _ = tree_flatten_with_path(runner.fn(*args, **kwargs))
                want = [(p, t.clone() if isinstance(t, torch.Tensor) else t) for p, t in want]
                watched = [(name, who, t, t.clone()) for name, who, t in runner.written(n)] if writes != "off" else []
                state.restore()
                runner.pad_state(n)
                for t in runner.outputs(b):
                    t.fill_(_POISON[t.dtype.is_floating_point])
                for si in runner.inputs:
                    static = runner.static_input(si.name)
                    tail = static.narrow(si.dim, n * si.per_item, static.shape[si.dim] - n * si.per_item)
                    tail.fill_(_POISON[tail.dtype.is_floating_point] if tail.dtype != torch.bool else True)
                with noted(f"graphctl: verify() of bucket {b} at n={n}, the graphed call"):
                    got, _ = tree_flatten_with_path(runner(*args, **kwargs))
                got = [(p, t.clone() if isinstance(t, torch.Tensor) else t) for p, t in got]
                # every write compared too, in the same restored state: a padded lane that writes live
                # memory where eager writes nothing differs here even when every output agrees
                after = [(name, who, t.clone(), w) for name, who, t, w in watched]
            mismatch = None
            for (path, w), (_, g) in zip(want, got):
                if not isinstance(w, torch.Tensor):
                    continue
                diff = _first_difference(w, g, rtol, atol)
                if diff is not None:
                    mismatch = Mismatch(keystr(path) or "<output>", *diff)
                    break
            write = None
            for name, who, g, w in after if mismatch is None else ():
                diff = _first_difference(w, g, rtol, atol)
                if diff is not None:
                    write = Mismatch(f"write {name} ({who})", *diff)
                    break
            if writes == "error" and write is not None:
                mismatch, write = write, None
            results.append(VerifyResult(b, n, len(want), mismatch, write))
    return tuple(results)

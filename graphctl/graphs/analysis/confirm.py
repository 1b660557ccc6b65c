"""Settling the audit's *possible* dangling findings by experiment.

A possible finding is a word inside a kernel's struct parameter (or a library's packed argument
buffer) that points into a block the caching allocator lists as free. The argument bytes cannot
say whether the kernel dereferences that word, so :func:`confirm` asks the graph instead, once
per freed block:

1. the caller's state is put back (one snapshot, taken before the audit so that its copies
   were allocated before the freed blocks were listed), the block is filled with ``0x00`` and
   the graph is replayed; again with ``0x00`` (a control: a graph whose replays differ on
   identical memory cannot be judged bitwise); then with ``0xFF``;
2. after each replay the block's bytes are read back (a write into freed memory is a dangling
   write whatever the outputs say), then the outputs and everything the run may write are
   fingerprinted (``graphctl.ops.fingerprint``, one launch).

- outputs or writes differ between the two poisons, or the block no longer holds the poison:
  **confirmed**, the finding becomes an error with that evidence;
- both identical, the block untouched: **dropped**, kept in ``Audit.dropped`` with the
  evidence (the replay's results do not depend on those bytes: a stale word the kernel never
  dereferences, or one it reads and ignores);
- the control differs, the block was reallocated before it could be poisoned, or the backend
  cannot poison device memory: it **stays possible**, with the reason.

Only memory the allocator lists as free is written, between a synchronize and a replay on
one thread; nothing of the caller's is touched except through the snapshot. A graph that does
dereference such a word as an index may read far out of bounds when poisoned with ``0xFF``: the
confirm run is a debugging step, run it where a failed process costs nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphctl import ops
from graphctl.graphs.analysis.audit import Audit, Finding, audit_graph, param_tensors

__all__ = ["audit_runner", "confirm", "POISONS"]

POISONS = (0x00, 0x00, 0xFF)  # the second 0x00 is the determinism control


def confirm(audit: Audit, graph: Any, *, replay: Callable[[], None], observed: Callable[[], Sequence[torch.Tensor]],
            restore: Callable[[], None], sync: Callable[[], None]) -> Audit:
    """``audit`` with each possible finding confirmed (an error), dropped (``Audit.dropped``) or
    left possible with the reason; ``graph`` needs ``poison(start, nbytes, byte)``, ``peek(start,
    nbytes)`` and ``memory_regions()`` (the CUDA backend's graphs have them)."""
    possible = audit.possible
    if not possible:
        return audit
    regions = dict.fromkeys(f.region for f in possible)  # one verdict per freed block, in finding order
    verdicts = {r: _settle(r, graph, replay, observed, restore, sync) for r in regions}
    restore()
    sync()
    kept: list[Finding] = []
    dropped = list(audit.dropped)
    for f in audit.findings:
        if f.severity != "possible":
            kept.append(f)
            continue
        verdict, why = verdicts[f.region]
        if verdict == "confirmed":
            kept.append(dataclasses.replace(f, severity="error", evidence=f"confirmed: {why}"))
        elif verdict == "dropped":
            dropped.append(dataclasses.replace(f, evidence=f"dropped: {why}"))
        else:
            kept.append(dataclasses.replace(f, evidence=f"undecided: {why}"))
    return dataclasses.replace(audit, findings=tuple(kept), dropped=tuple(dropped))


def _fingerprint(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """One fingerprint launch per device (state may keep pinned host mirrors beside device buffers)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t.contiguous())
    return [ops.fingerprint(ts).cpu().tolist() for _, ts in sorted(by_device.items(), key=lambda kv: str(kv[0]))]


def _free(region: tuple[int, int], graph: Any) -> bool:
    start, end = region
    return any(r.kind == "freed" and r.start <= start and end <= r.end for r in graph.memory_regions())


def _settle(region: tuple[int, int] | None, graph: Any, replay: Callable[[], None],
            observed: Callable[[], Sequence[torch.Tensor]], restore: Callable[[], None],
            sync: Callable[[], None]) -> tuple[str, str]:
    if region is None or not graph.can_poison:  # only CUDA graphs hold device memory to poison
        return "possible", "this backend cannot poison device memory"
    start, end = region
    prints, intact = [], []
    for byte in POISONS:
        restore()
        sync()
        if not _free(region, graph):
            return "possible", "the block was reallocated before it could be poisoned"
        graph.poison(start, end - start, byte)
        sync()
        replay()
        sync()
        back = graph.peek(start, end - start)  # before anything allocates again
        intact.append(back.count(byte) == len(back))
        prints.append(_fingerprint(observed()))
    if prints[0] != prints[1]:
        return "possible", "two replays on identical memory differ (a nondeterministic graph cannot be judged bitwise)"
    if not all(intact):
        return "confirmed", f"the replay writes into the freed block of {end - start} B"
    if prints[0] != prints[2]:
        return "confirmed", (f"the replay's outputs or writes change with the freed block's contents (poisoned 0x00 "
                             f"vs 0xFF, {end - start} B)")
    return "dropped", (f"outputs and writes bitwise equal with the freed block ({end - start} B) poisoned 0x00 and "
                       "0xFF, and the replay wrote nothing there")


def audit_runner(runner: Any, params: Any, poison: bool, replay: Callable[[int], None]) -> dict[int, Audit]:
    """``runner.audit()``: per bucket, :func:`audit_graph` against the regions the runner knows;
    with ``poison``, each possible finding replayed with its freed block poisoned
    (``analysis/confirm.py``), the caller's state put back after."""
    fn = runner.fn
    owner = fn.__self__ if inspect.ismethod(fn) else None  # a decorated module's method
    model = param_tensors(params if params is not None else runner.params if runner.params is not None
                          else owner if isinstance(owner, torch.nn.Module) else None)
    guard = runner.guard_all() if poison else None  # allocated before the freed blocks are listed
    plan = runner.state.plan if runner.state is not None else None
    out = {b: audit_graph(runner.graph(b), b, known=runner.known_tensors(b), segments=runner.segments(b),
                          workspaces=runner.workspaces, plan=plan, params=model) for b in runner.captured}
    if guard is None:
        return out
    with guard:
        return {b: confirm(a, runner.graph(b), replay=functools.partial(replay, b),
                           sync=runner.capture.backend.synchronize, observed=functools.partial(_observed, runner, b),
                           restore=guard.restore) for b, a in out.items()}


def _observed(runner: Any, bucket: int) -> list[torch.Tensor]:
    """What a replay of ``bucket`` leaves for the caller: its outputs and its writes."""
    return runner.outputs(bucket) + [t for *_, t in runner.written(bucket)]

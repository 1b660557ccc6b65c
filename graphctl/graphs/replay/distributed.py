"""Several ranks, one decision: the bucket every rank replays, whether they all fall back, and
whether a switch went through on every rank, agreed through ``torch.distributed`` (NCCL on GPUs,
gloo on CPUs) with one small all-reduce each.

Why: a captured forward of a tensor-parallel model holds collectives. If one rank replays
bucket 8 while another replays bucket 4, or one falls back to eager while the others replay,
or one rank's switch fails while the others go on into the forward, the collectives pair up
wrongly and the ranks hang or exchange garbage. TensorRT-LLM agrees the batch size across
ranks for attention data parallelism for the same reason.

- :class:`Agreement` ``agree(n, ok)``: one all-reduce (MAX) of ``[n, not ok]``; returns the
  largest batch any rank has and whether every rank can be served. The runner pads its own
  inputs to the bucket of that largest batch.
- :func:`agreed_switch`: a :meth:`BoundState.switch` whose entry is agreed: after the local
  apply (which restores itself on failure), an all-reduce of the success flag; when any rank
  failed, every rank restores and raises :class:`~graphctl.errors.SwitchError` naming the
  ranks that failed, before any rank reaches the forward's collectives. Not for the
  ``capture`` phase (a capture cannot hold a host-side all-reduce); the runner uses it around
  replay.

Limits: a rank that raises *inside* the forward while the others wait in a collective is not
recoverable here (that is the collective's timeout); graphctl agrees before the forward runs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from graphctl.errors import SwitchError

__all__ = ["Agreement", "agreed_switch"]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


class Agreement:
    """Small all-reduces over ``group`` (a ``torch.distributed`` process group, or None for the
    default group). Tensors live where the group's backend wants them: CUDA for NCCL."""

    def __init__(self, group: Any = None) -> None:
        dist = _dist()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")

    def agree(self, n: int, ok: bool) -> tuple[int, bool]:
        """``(max n over ranks, every rank ok)``."""
        dist = _dist()
        buf = torch.tensor([n, 0 if ok else 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        n_max, bad = buf.tolist()
        return int(n_max), bad == 0

    def failed_ranks(self, ok: bool) -> list[int]:
        """The ranks whose ``ok`` was False (one all-reduce of a per-rank flag vector)."""
        dist = _dist()
        buf = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        buf[self.rank] = 0 if ok else 1
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        return [r for r, v in enumerate(buf.tolist()) if v]


@contextlib.contextmanager
def agreed_switch(state: Any, role: str, agreement: Agreement, phase: str = "auto") -> Iterator[Any]:
    """``state.switch(role, phase)`` entered on every rank or on none (see the module docstring)."""
    sw = state.switch(role, phase)
    failure: BaseException | None = None
    try:
        sw.__enter__()
    except BaseException as exc:  # the local switch already undid what it applied
        failure = exc
    failed = agreement.failed_ranks(failure is None)
    if failed:
        if failure is None:
            sw.__exit__(None, None, None)  # restore ours: a peer could not switch
        err = SwitchError(f"'{role}' switch failed on rank(s) {failed}; every rank restored its state",
                          expected="the switch applied on every rank", found=f"failure on rank(s) {failed}"
                          + (f" (here: {type(failure).__name__}: {failure})" if failure is not None else ""),
                          fix="fix the failing rank's refresh source or buffers; no rank entered the forward")
        raise err from failure
    try:
        yield sw
    except BaseException as exc:
        if not sw.__exit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        sw.__exit__(None, None, None)

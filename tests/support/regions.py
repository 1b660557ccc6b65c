"""The Toy MTP step (``support.graphs``) with an ``@graphctl.eager`` region placed before the draft
switch, inside it (``in_switch=True``) or after it: the shapes of piecewise capture that issue 51
found wrong, for the CPU tests (tests/regressions/test_regions.py) and the GPU ones (tests/cuda)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import graphctl
from graphctl import StaticInput
from support.graphs import Toy

WHERE = ("before", "inside", "after")


def regioned(toy: Toy, where: str, region: Callable[[torch.Tensor], Any], buckets=(2, 4)) -> Any:
    """A runner of the Toy step with ``region`` (an ``@graphctl.eager`` function of one tensor) at
    ``where``; ``toy.forward`` is replaced by it (so ``toy.eager`` and the checks use it)."""
    def fwd(tokens, positions, meta):
        k1, T = toy.k + 1, tokens.shape[0]
        req = meta.req_idx_per_token[:T].long().clamp(0, toy.S - 1)
        h = toy.E[tokens] + positions[:, None].float() * 0.125
        h = torch.tanh(h @ toy.W) + meta.kv_lens[req].float()[:, None] * 0.01
        last = h.view(T // k1, k1, toy.H)[:, -1]
        if where == "before":
            last = region(last)
        with toy.state.switch("draft"):
            n = T // k1
            toy.state.write("kv_lens", meta.kv_lens[:n] + 1)  # mutable: the recorded switch restores it
            d = last + meta.block_offsets[:n, :1].float() * 0.001 + meta.slot_mapping[:n, None].float() * 1e-4
            if where == "inside":
                d = region(d)
            d = torch.tanh(d @ toy.W)
        if where == "after":
            d = region(d)
        return h, d

    toy.forward = graphctl.graphed(fwd, buckets=list(buckets), state=toy.state, backend=toy.forward.backend_name,
                                   inputs=[StaticInput("tokens", per_item=toy.k + 1),
                                           StaticInput("positions", per_item=toy.k + 1)], progress=False)
    return toy.forward


def contents(toy: Toy) -> dict[str, torch.Tensor]:
    """Every declared buffer but Stable scratch, cloned: what a stopped replay must leave as it found."""
    return {n: toy.state.tensor(n).clone() for n in toy.state.restorable_names()}


def unchanged(toy: Toy, before: dict[str, torch.Tensor]) -> list[str]:
    """The declared buffers whose contents differ from ``before``."""
    return [n for n, t in before.items() if not torch.equal(toy.state.tensor(n), t)]


def region_of(where: str, body: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """``body`` as an eager region that may sit at ``where`` (inside the switch: ``in_switch``)."""
    return graphctl.eager(in_switch=where == "inside")(body)

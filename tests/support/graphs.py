"""A small one-model MTP step over the mini metadata family, graphed with ``@graphed``, and
checks shared by the emulated tests (tests/unit, CPU) and the CUDA tests (tests/cuda).

The target part gathers per-token metadata through ``req_idx_per_token``; the draft part
runs inside ``state.switch("draft")``: it reads the swapped ``block_offsets`` (the draft twin,
refreshed from the draft KV manager before every replay), writes ``kv_lens`` through the state
(so ``slot_mapping`` is recomputed in-graph) and produces one value per request."""
from __future__ import annotations

import torch

import graphctl
from graphctl import StaticInput, bind
from support.mini import MiniMetadata, make_registry

POISON = {torch.float32: float("nan"), torch.int64: -(2**40), torch.int32: -(2**30)}


class Toy:
    def __init__(self, device, gen: torch.Generator, *, S: int = 16, k: int = 2, H: int = 8,
                 buckets=(1, 2, 4, 8, 16), backend: str = "emulated", fallback: str = "error") -> None:
        self.device, self.gen, self.S, self.k, self.H = torch.device(device), gen, S, k, H
        self.meta = MiniMetadata(gen, S=S, B=3, k=k, device=device)
        self.state = bind(self.meta, registry=make_registry())
        self.E = torch.randn(100, H, generator=gen).to(device)
        self.W = torch.randn(H, H, generator=gen).to(device)
        self.forward = graphctl.graphed(
            self._forward, buckets=list(buckets), state=self.state, backend=backend, fallback=fallback,
            inputs=[StaticInput("tokens", per_item=k + 1), StaticInput("positions", per_item=k + 1)], progress=False)

    def _forward(self, tokens, positions, meta):
        k1 = self.k + 1
        T = tokens.shape[0]
        req = meta.req_idx_per_token[:T].long().clamp(0, self.S - 1)  # padded tokens map past the last request
        h = self.E[tokens] + positions[:, None].float() * 0.125
        h = torch.tanh(h @ self.W) + meta.kv_lens[req].float()[:, None] * 0.01
        last = h.view(T // k1, k1, self.H)[:, -1]  # one row per request
        with self.state.switch("draft"):
            n = T // k1
            self.state.write("kv_lens", meta.kv_lens[:n] + 1)  # mutable: restored at switch exit
            draft = last + meta.block_offsets[:n, :1].float() * 0.001 + meta.slot_mapping[:n, None].float() * 1e-4
            draft = torch.tanh(draft @ self.W)
        return h, draft

    # ------------------------------------------------------------------------ helpers

    def batch(self, n: int):
        """Fresh random inputs for n requests, with the metadata prepared for them."""
        T = n * (self.k + 1)
        tokens = torch.randint(1, 100, (T,), generator=self.gen).to(self.device)
        positions = torch.randint(0, 500, (T,), generator=self.gen).to(self.device)
        self.state.write("seq_lens", torch.full((n,), self.k + 1, dtype=torch.int32, device=self.device))
        self.state.write("kv_lens", torch.randint(1, 900, (n,), generator=self.gen, dtype=torch.int32).to(self.device))
        pool = self.meta.draft_kv_cache_manager.pool_indices
        pool.copy_(torch.randint(0, 1000, pool.shape, generator=self.gen, dtype=torch.int32).to(self.device))
        return tokens, positions

    def eager(self, tokens, positions):
        with torch.no_grad():
            h, d = self.forward.fn(tokens, positions, self.meta)
        return h.clone(), d.clone()

    def poison(self, n: int) -> None:
        """Poison every static output and the padding of every static input before a replay."""
        f = self.forward
        b = f.buckets.pick(n)
        for t in f.outputs(b):
            t.fill_(POISON[t.dtype])
        for name in ("tokens", "positions"):
            f.static_input(name)[n * (self.k + 1):].fill_(POISON[torch.int64])


def check_replay_matches_eager(toy: Toy, sizes) -> None:
    """For each n: fresh inputs, eager reference first, poison, replay, compare outputs and padding."""
    for n in sizes:
        tokens, positions = toy.batch(n)
        want_h, want_d = toy.eager(tokens, positions)
        if toy.forward.captured:
            toy.poison(n)
        h, d = toy.forward(tokens, positions, toy.meta)
        h, d = h.clone(), d.clone()
        assert h.shape == want_h.shape and d.shape == want_d.shape, (n, h.shape, want_h.shape)
        torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5, msg=f"target output, n={n}")
        torch.testing.assert_close(d, want_d, rtol=1e-5, atol=1e-5, msg=f"draft output, n={n}")
        b = toy.forward.buckets.pick(n)
        rows = slice(n * (toy.k + 1), b * (toy.k + 1))
        for name in ("tokens", "positions"):
            tail = toy.forward.static_input(name)[rows]
            assert torch.equal(tail, torch.zeros_like(tail)), f"{name} padding stale after n={n}"
        assert torch.equal(toy.meta.seq_lens[n:], torch.zeros_like(toy.meta.seq_lens[n:])), n


def check_capture_failure_restores(toy_factory, gen) -> None:
    """A forward raising inside its draft switch during capture: CaptureError caused by the
    original error, state bitwise restored, no graph kept; a fixed forward captures after."""
    toy = toy_factory()
    tokens, positions = toy.batch(3)
    fail = {"on": False}
    inner = toy.forward.fn

    def flaky(tokens, positions, meta):
        with toy.state.switch("draft"):
            toy.state.write("kv_lens", meta.kv_lens + 7)
            if fail["on"] and graphctl.state.phase.capturing(toy.device):
                raise ValueError("boom inside the draft body")
        return inner(tokens, positions, meta)

    runner = graphctl.graphed(flaky, buckets=[2, 4], state=toy.state, backend=toy.forward.backend_name,
                              inputs=[StaticInput("tokens", per_item=toy.k + 1),
                                      StaticInput("positions", per_item=toy.k + 1)], progress=False)
    before = {n: toy.state.tensor(n).clone() for n in toy.state.plan.buffers}
    offsets, mgr = toy.meta.block_offsets, toy.meta.kv_cache_manager
    fail["on"] = True
    try:
        runner.capture_all(tokens, positions, toy.meta)
    except graphctl.CaptureError as e:
        assert isinstance(e.__cause__, ValueError) and "boom" in str(e.__cause__), repr(e.__cause__)
    else:
        raise AssertionError("capture of a raising forward did not fail")
    assert runner.captured == ()
    assert toy.meta.block_offsets is offsets and toy.meta.kv_cache_manager is mgr
    assert toy.state.active_phase is None and toy.state.poisoned is None
    for n, t in before.items():
        assert torch.equal(toy.state.tensor(n), t), f"{n} not restored after the failed capture"
    fail["on"] = False
    runner.reset()
    runner.capture_all(tokens, positions, toy.meta)
    assert runner.captured == (2, 4)

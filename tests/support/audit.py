"""Planted bugs for the pointer and segment audits, shared by the emulated tests (tests/unit,
CPU) and the CUDA tests (tests/cuda): each builds a graphed forward with one bug and returns
the audit of its bucket."""
from __future__ import annotations

import torch

import graphctl
from graphctl import StaticInput
from graphctl.graphs.analysis.audit import Audit
from support.graphs import Toy


def dangling_temporary(device: str, backend: str, gen: torch.Generator, drop: bool, confirm: bool = False) -> Audit:
    """A forward adding a temporary allocated outside the capture (hence outside the pool);
    ``drop``: the caller frees it after capture, as TensorRT-LLM #16290's did; ``confirm``: the
    audit settles possible findings by poisoned replays."""
    holder = {"tmp": torch.randn(8, 4, generator=gen).to(device)}
    w = torch.randn(4, 4, generator=gen).to(device)

    @graphctl.graphed(buckets=[8], backend=backend, progress=False, params={"w": w})
    def f(x):
        return (x + holder["tmp"][: x.shape[0]]) @ w

    f.capture_all(torch.randn(8, 4, generator=gen).to(device))
    if drop:
        del holder["tmp"]  # its block goes back to the caching allocator; the graph still reads it
    return f.audit(confirm=confirm)[8]


def target_reads_refreshed(device: str, backend: str, gen: torch.Generator) -> Audit:
    """The target segment reads the draft twin, which is refreshed in place before every
    replay (TensorRT-LLM #16887)."""
    toy = Toy(device, gen, backend=backend)
    st = toy.state

    def fwd(tokens, positions, meta):
        bad = meta.draft_block_offsets[: tokens.shape[0] // 3, 0].float() * 2  # the draft twin, read by the target
        with st.switch("draft"):
            d = meta.block_offsets[: tokens.shape[0] // 3, 0].float() * 3
        return bad + d

    f = graphctl.graphed(fwd, buckets=[4], state=st, backend=backend, progress=False,
                         inputs=[StaticInput("tokens", per_item=3), StaticInput("positions", per_item=3)])
    f.capture_all(*toy.batch(3), toy.meta)
    return f.audit()[4]


def stale_token_map(device: str, backend: str, gen: torch.Generator, *, via_state: bool = False,
                    compiled: bool = False):
    """The draft step writes ``seq_lens`` in place (``fill_``, not ``state.write``) and then reads
    ``req_idx_per_token``, derived from it: the stale-token-map class (issue 29). ``via_state``:
    the correct write, for the clean twin; ``compiled``: the read runs inside a compiled function
    (``aot_eager``: one recorded call on the emulated backend). Returns ``(runner, toy, audit)``."""
    toy = Toy(device, gen, backend=backend)
    st = toy.state

    def head(req, h):
        return h * (req[:, None].float() + 1)

    read = torch.compile(head, backend="aot_eager", fullgraph=True) if compiled else head

    def fwd(tokens, positions, meta):
        n = tokens.shape[0] // 3
        h = positions[:, None].float() * 0.5
        with st.switch("draft"):
            if via_state:
                st.write("seq_lens", torch.ones(n, dtype=torch.int32, device=tokens.device))
            else:
                meta.seq_lens[:n].fill_(1)  # the map of (k+1) tokens a request is now stale
            d = read(meta.req_idx_per_token[:n], h[:n])
        return d

    f = graphctl.graphed(fwd, buckets=[4], state=st, backend=backend, progress=False,
                         inputs=[StaticInput("tokens", per_item=3), StaticInput("positions", per_item=3)])
    f.capture_all(*toy.batch(4), toy.meta)
    return f, toy, f.audit()[4]


def engine_audits(device: str, backend: str, gen: torch.Generator, buckets=(2, 4, 8),
                  confirm: bool = False) -> dict[int, Audit]:
    """The reference engine graphed at ``buckets``, audited with its weights and caches as params."""
    from graphctl.models import EngineConfig, MTPEngine

    eng = MTPEngine(EngineConfig(draft_len=3, max_seqs=max(buckets)), device=device)
    m, st = eng.meta, eng.state
    n = min(5, max(buckets))
    m.prepare(st, torch.full((n,), 4, dtype=torch.int32),
              torch.randint(4, 40, (n,), generator=gen, dtype=torch.int32))
    f = graphctl.graphed(eng.step, buckets=list(buckets), state=st, backend=backend, progress=False,
                         params=eng.named_tensors(), inputs=[StaticInput("input_ids", per_item=4)])
    f.capture_all(torch.randint(0, eng.cfg.vocab, (4 * n,), generator=gen).to(device), m)
    return f.audit(confirm=confirm)

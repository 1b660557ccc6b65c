"""A write's derived-buffer recompute replayed from one CUDA graph (``graphctl/state/chains.py``,
issue 32's host gap): eager the first time, captured the second, replayed after; the maps it
leaves equal an eager recompute in every family; what a graph cannot hold runs op by op."""
from __future__ import annotations

import logging

import pytest
import torch

from graphctl import Recompute, StateSpec, bind, knobs
from graphctl.families import FAMILIES, make_family
from graphctl.state import chains
from support.mini import MiniMetadata, make_registry, make_spec, slots

FAMILY_NAMES = sorted(FAMILIES)


def _prepare(meta, state, gen, k: int, seqs: int) -> None:
    n = int(torch.randint(1, seqs + 1, (1,), generator=gen))
    meta.prepare(state, torch.randint(1, k + 2, (n,), generator=gen, dtype=torch.int32),
                 torch.randint(k + 1, 24, (n,), generator=gen, dtype=torch.int32))


def test_on_the_cpu_every_chain_runs_op_by_op(gen):
    # Regression: issue 32, a graph must never be attempted off CUDA (the CPU path stays what it was).
    meta, state = make_family("paged", seqs=4, blocks=3, draft_len=2, seed=3)
    for _ in range(3):
        _prepare(meta, state, gen, 2, 4)
    assert chains.graphs_of(state) == {}
    state.check()


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_replayed_chains_leave_the_maps_an_eager_recompute_leaves(gen, family):
    # Regression: issue 32, prepare's eager recompute (about forty launches) was most of the host gap per step.
    seqs, k = 5, 3
    seed = int(torch.randint(0, 99, (1,), generator=gen))
    try:  # two identical states: one replays its chains, its twin recomputes op by op
        meta, state = make_family(family, seqs=seqs, blocks=4, draft_len=k, seed=seed, device="cuda")
        twin, twin_state = make_family(family, seqs=seqs, blocks=4, draft_len=k, seed=seed, device="cuda")
    except ValueError as exc:
        pytest.skip(str(exc))
    for i in range(6):  # a new batch size and new lengths each time: a replay that kept the last maps differs
        g_state = gen.get_state()
        _prepare(meta, state, gen, k, seqs)
        gen.set_state(g_state)
        with knobs.scope(graphed_recompute=False):
            _prepare(twin, twin_state, gen, k, seqs)
        for name in state.plan.order:
            assert torch.equal(getattr(meta, name), getattr(twin, name)), (i, name)
        state.check()  # and each equals its own fn recomputed into scratch
    kinds = {type(g).__name__ for g in chains.graphs_of(state).values()}
    assert kinds == {"CUDAGraph"}, kinds
    assert chains.graphs_of(twin_state) == {}


@pytest.mark.cuda
def test_the_knob_off_and_a_capture_in_progress_run_op_by_op(gen):
    meta, state = make_family("paged", seqs=4, blocks=3, draft_len=2, seed=5, device="cuda")
    with knobs.scope(graphed_recompute=False):
        for _ in range(3):
            _prepare(meta, state, gen, 2, 4)
    assert chains.graphs_of(state) == {}
    _prepare(meta, state, gen, 2, 4)
    _prepare(meta, state, gen, 2, 4)  # captured, replayed
    seq = torch.randint(1, 4, (4,), generator=gen, dtype=torch.int32).cuda()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # inside someone's capture the chain is recorded into it, op by op
        state.write("seq_lens", seq)
    meta.req_idx_per_token.fill_(-7)
    g.replay()
    state.check()


@pytest.mark.cuda
def test_a_chain_that_syncs_with_the_host_falls_back_once_said(gen, caplog):
    # Regression: issue 32, a user's Recompute fn that reads a host value cannot be captured: it must keep working.
    def synced_slots(out, offsets, kv_lens):
        if int(kv_lens.sum().item()) >= 0:  # a host sync: illegal while capturing
            slots(out, offsets, kv_lens)

    spec = StateSpec("mini-sync", extends=make_spec())
    spec.buffer("slot_mapping", shape=("S",), dtype=torch.int64, override=True,
                derive=Recompute(inputs=["block_offsets", "kv_lens"], fn=synced_slots))
    meta = MiniMetadata(torch.Generator().manual_seed(1), device="cuda")
    state = bind(meta, registry=make_registry(spec=spec))
    with caplog.at_level(logging.WARNING, logger="graphctl"):
        for _ in range(4):
            kv = torch.randint(1, 99, (3,), generator=gen, dtype=torch.int32).cuda()
            meta.slot_mapping.fill_(-7)
            state.write("kv_lens", kv)
            state.check()
    assert list(chains.graphs_of(state).values()) == ["eager"]
    assert sum("cannot be captured" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.cuda
def test_under_a_dispatch_mode_the_chain_runs_op_by_op(gen):
    # Regression: issue 32, a replayed chain is no dispatcher op: the emulated recorder and the write tracker would
    # not see the recompute at all (a recorded forward that writes lengths would replay without its maps).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    meta, state = make_family("paged", seqs=4, blocks=3, draft_len=2, seed=7, device="cuda")
    for _ in range(3):
        _prepare(meta, state, gen, 2, 4)  # captured and replayed by now
    with Seen() as seen:
        _prepare(meta, state, gen, 2, 4)
    assert any("cumsum" in op for op in seen.ops), seen.ops  # cu_seq_lens recomputed where the mode saw it
    state.check()

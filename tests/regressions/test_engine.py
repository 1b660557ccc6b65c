"""The known draft-switch bugs, each reproduced on the reference MTP engine and its paged
backend, each pinned by a test that names it first."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import CopyInPlace, DeclarationError, Recompute, StaleBufferError, StateSpec, StaticInput
from graphctl.families.paged import paged_spec, token_map_
from graphctl.models import EngineConfig, MTPEngine
from graphctl.state import seams
from support.engine import STEPS, acceptance


def _stale_map_spec(holder: dict) -> StateSpec:
    # req_idx_per_token declared with the wrong input: it reads seq_lens behind graphctl's back
    spec = StateSpec("paged-stale-map", extends=paged_spec(block_size=8))
    spec.buffer("req_idx_per_token", shape=("T",), dtype=torch.int32, override=True,
                derive=Recompute(["kv_cache_manager"], lambda out, _mgr: token_map_(out, holder["meta"].seq_lens)
                                 if "meta" in holder else out.zero_()))  # bind computes it before holder is set
    return spec


def _stale_engine(k: int, seqs: int, seed: int) -> MTPEngine:
    holder: dict = {}
    eng = MTPEngine(EngineConfig(draft_len=k, max_seqs=seqs, seed=seed), spec=_stale_map_spec(holder))
    holder["meta"] = eng.meta
    return eng


def test_stale_token_map_is_caught_and_costs_acceptance_as_batch_grows(gen):
    # Regression: TensorRT-LLM #16925, req_idx_per_token built for k+1 tokens/request reused at 1 in the draft loop.
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    eng = _stale_engine(3, 8, seed)
    with graphctl.knobs.scope(check_stale=True), pytest.raises(StaleBufferError, match="req_idx_per_token"):
        eng.generate(eng.prompts(8, torch.Generator().manual_seed(seed)), STEPS)
    by_bs = {}
    for bs in (1, 8):
        eng = _stale_engine(3, 8, seed)
        by_bs[bs] = acceptance(eng.generate(eng.prompts(bs, torch.Generator().manual_seed(seed)), STEPS))
    assert by_bs[1] == 4.0, by_bs  # one request: every token maps to request 0, the bug hides
    assert by_bs[8] < 4.0, by_bs  # the draft tokens read other requests' positions and KV


def test_refresh_of_a_buffer_the_target_reads_is_refused_at_declaration():
    # Regression: TensorRT-LLM #16887 review, a pre-replay in-place refresh corrupting the target segment.
    spec = StateSpec("paged-bad-refresh", extends=paged_spec(block_size=8))
    spec.buffer("block_table", shape=("S", "B"), dtype=torch.int32, readers={"target", "draft"}, override=True,
                refresh=CopyInPlace(source=lambda m: m.draft_kv_cache_manager.pool_block_ids()))
    with pytest.raises(DeclarationError, match="block_table"):
        graphctl.Registry().register(type("M", (), {}), spec)


@pytest.mark.parametrize("where", ["refresh source", "recompute after the swaps"])
def test_exception_inside_the_switch_restores_everything(where, gen):
    # Regression: draft_kv_cache_context mutating before its try, so a failure left the draft state bound.
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    eng = MTPEngine(EngineConfig(draft_len=3, max_seqs=8, seed=seed))
    m, st = eng.meta, eng.state
    m.prepare(st, torch.full((5,), 4, dtype=torch.int32), torch.randint(4, 60, (5,), generator=gen, dtype=torch.int32))
    before = {n: st.tensor(n).clone() for n in st.restorable_names()}  # Stable scratch excluded
    table, mgr = m.block_table, m.kv_cache_manager

    def boom(*_):
        raise RuntimeError(f"{where} failed")

    if where == "refresh source":
        m.draft_kv_cache_manager.pool_block_ids = boom
    else:
        seams.install(st, fault=lambda stage, step, when: boom() if (stage, step, when) == (
            "apply", "recompute(slot_mapping)", "before") else None)
    with pytest.raises(RuntimeError, match="failed"):
        with st.switch("draft"):
            raise AssertionError("the body must not run")
    assert m.block_table is table and m.kv_cache_manager is mgr and st.poisoned is None
    for n, t in before.items():
        assert torch.equal(st.tensor(n), t), n


def test_kv_lens_do_not_accumulate_across_warmup_and_capture(gen):
    # Regression: kv_lens_cuda += 1 in the draft loop accumulated across warmup and capture runs.
    eng = MTPEngine(EngineConfig(draft_len=3, max_seqs=8))
    m, st = eng.meta, eng.state
    kv = torch.randint(4, 60, (5,), generator=gen, dtype=torch.int32)
    m.prepare(st, torch.full((5,), 4, dtype=torch.int32), kv)
    before = {n: st.tensor(n).clone() for n in st.restorable_names()}  # Stable scratch excluded
    f = graphctl.graphed(eng.step, buckets=[2, 8], state=st, backend="emulated", warmup_iters=3, progress=False,
                         inputs=[StaticInput("input_ids", per_item=4)])
    f.capture_all(torch.randint(0, 96, (20,), generator=gen), m)
    for n, t in before.items():
        assert torch.equal(st.tensor(n), t), n
    assert torch.equal(m.kv_lens[:5], kv)


def test_refresh_past_the_pool_is_clamped(gen):
    # Regression: TensorRT-LLM #13124, draft block offsets past the pool read another pool's memory.
    eng = MTPEngine(EngineConfig(draft_len=3, max_seqs=8))
    m, st = eng.meta, eng.state
    pool = m.draft_kv_cache_manager
    pool.block_ids[0, :2] = torch.tensor([pool.num_blocks + 5, -3], dtype=torch.int32)
    with st.switch("draft"):
        assert m.block_table is m.draft_block_table
        assert int(m.block_table.max()) <= pool.num_blocks - 1 and int(m.block_table.min()) >= 0
        assert m.block_table[0, :2].tolist() == [pool.num_blocks - 1, 0]

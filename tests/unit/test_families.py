"""The backend families: each compiles, binds, switches and restores under the shipped state
machines (swap/restore and capture/replay), with valid random contents; plus what each family
adds: DSA's slot mappings follow the bound indexer offsets, DeepSeek-V4's pointer tables move to
the draft's pools eagerly and in a graph, unsupported configurations say why."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

import graphctl
from graphctl.families import FAMILIES, make_family, not_supported_reasons
from graphctl.families.dsa import expand_table_, slot_mapping_fp8_
from graphctl.testing import Case, GraphMachine, SwitchMachine


class BackendCase(Case):
    """Random values a real engine could hold: non-negative lengths, in-pool indices."""

    def value(self, name: str, rows: int | None = None) -> torch.Tensor:
        t = getattr(self.obj, name)
        shape = list(t.shape)
        if rows is not None:
            shape[self.spec.entries[name].axis_dim] = rows
        g = self.gen
        if name.endswith("seq_lens"):
            v = torch.randint(0, 4, shape, generator=g)
        elif name.endswith("kv_lens"):
            v = torch.randint(3, 24, shape, generator=g)
        elif name.endswith("ptrs"):
            v = torch.randint(0, 2**40, shape, generator=g)
        else:
            v = torch.randint(0, 4 * self.obj.kv_cache_manager.num_blocks, shape, generator=g)
        return v.to(t.dtype).to(t.device)


def _draw(data, name: str, device="cpu") -> BackendCase:
    seqs, blocks, k = data.draw(st.integers(2, 6)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    seed = data.draw(st.integers(0, 2**31 - 1))
    meta, state = make_family(name, seqs=seqs, blocks=blocks, draft_len=k, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed)
    n = data.draw(st.integers(1, seqs))
    meta.prepare(state, torch.randint(1, k + 2, (n,), generator=gen, dtype=torch.int32),
                 torch.randint(k + 1, 24, (n,), generator=gen, dtype=torch.int32))
    spec = FAMILIES[name].spec(block_size=8)
    registry = graphctl.Registry()
    registry.register(type(meta), spec)
    return BackendCase(obj=meta, spec=spec, registry=registry, gen=gen, device=torch.device(device))


def _machines(name: str):
    class Switches(SwitchMachine):
        def draw_case(self, data):
            return _draw(data, name)

    class Graphs(GraphMachine):
        def draw_case(self, data):
            return _draw(data, name)

    return Switches, Graphs


_FEW = settings(settings(), max_examples=max(5, settings().max_examples // 8))
for _name in FAMILIES:
    _sw, _gr = _machines(_name)
    globals()[f"TestSwitchMachine_{_name}"] = _sw.TestCase
    globals()[f"TestGraphMachine_{_name}"] = _gr.TestCase
    _sw.TestCase.settings = _gr.TestCase.settings = _FEW


def _prepared(name: str, gen, n=4, k=2, seqs=6, blocks=4):
    meta, state = make_family(name, seqs=seqs, blocks=blocks, draft_len=k, seed=int(torch.randint(0, 999, (1,),
                                                                                                   generator=gen)))
    meta.prepare(state, torch.full((n,), k + 1, dtype=torch.int32),
                 torch.randint(k + 1, 30, (n,), generator=gen, dtype=torch.int32))
    return meta, state


def test_dsa_slot_mappings_follow_the_bound_indexer_offsets(gen):
    meta, state = _prepared("dsa", gen)
    target_fp8 = meta.slot_mapping_fp8.clone()
    with state.switch("draft"):
        offsets = meta.indexer_k_cache_block_offsets
        assert offsets is meta.draft_indexer_k_cache_block_offsets
        assert torch.equal(offsets, meta.draft_kv_cache_manager.indexer_pool_indices())  # refreshed
        for part, scale in (("fp8", False), ("scale", True)):
            want = torch.empty_like(meta.slot_mapping_fp8)
            slot_mapping_fp8_(want, meta.token_positions, meta.req_idx_per_token, offsets, meta.scratch_i64,
                      meta.scratch_i32, block_size=8, scale_part=scale)
            assert torch.equal(getattr(meta, f"slot_mapping_{part}"), want), part
        want = torch.empty_like(meta.draft_block_table_expanded)
        expand_table_(want, meta.draft_block_table)
        assert meta.block_table_expanded is meta.draft_block_table_expanded and torch.equal(meta.block_table_expanded,
                                                                                           want)
        assert not torch.equal(meta.slot_mapping_fp8, target_fp8)  # the draft's pages differ from the target's
    assert torch.equal(meta.slot_mapping_fp8, target_fp8)


def test_deepseek_v4_pointer_tables_move_to_the_draft_pools_eagerly_and_in_a_graph(gen):
    meta, state = _prepared("deepseek_v4", gen)
    target_ptrs = meta.swa_buffer_ptrs.clone()
    draft_ptrs = meta.draft_kv_cache_manager.swa_ptrs
    assert not torch.equal(target_ptrs, draft_ptrs)
    with state.switch("draft"):
        assert torch.equal(meta.swa_buffer_ptrs, draft_ptrs)
        assert torch.equal(meta.sparse_mla_base_ptrs, meta.draft_kv_cache_manager.sparse_ptrs)
        assert meta.sliding_block_tables is meta.draft_sliding_block_tables

    def fwd(x, meta):  # a kernel that reads its pool base from the table at run time
        before = meta.swa_buffer_ptrs.clone()
        with state.switch("draft"):
            during = meta.swa_buffer_ptrs.clone()
        return x + 0 * before.sum(), before, during

    f = graphctl.graphed(fwd, buckets=[2], state=state, inputs=["x"], backend="emulated", progress=False)
    _, before, during = f(torch.randn(2, 3, generator=gen), meta)
    assert torch.equal(before, target_ptrs) and torch.equal(during, draft_ptrs)
    assert torch.equal(meta.swa_buffer_ptrs, target_ptrs)


def test_unsupported_configuration_says_why():
    assert not_supported_reasons("deepseek_v4") == []
    reasons = not_supported_reasons("deepseek_v4", draft_compress_ratios=[4, 128])
    assert len(reasons) == 1 and "SWA-only" in reasons[0]
    with pytest.raises(ValueError, match="SWA-only"):
        make_family("deepseek_v4", seqs=2, blocks=2, draft_len=1, draft_compress_ratios=[4])
    assert all(not_supported_reasons(n) == [] for n in ("paged", "trtllm", "dsa"))

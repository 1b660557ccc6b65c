"""Regression tests for the bug classes graphctl exists to make impossible (docs/architecture.md)."""
from __future__ import annotations

import pytest
import torch

from graphctl import BindError, CorruptedStateError, Recompute, Registry, StateSpec, Swap, bind
from graphctl.state import seams
from support.mini import MiniMetadata, make_registry


def test_token_map_follows_layout_change_to_one_token_per_request(gen):
    # TensorRT-LLM #16925: req_idx_per_token built for (k+1) tokens/request was reused at 1 token/request.
    m = MiniMetadata(gen, S=7, k=3)
    st = bind(m, registry=make_registry())
    target_map = m.req_idx_per_token.clone()
    with st.switch("draft", "eager"):
        st.write("seq_lens", torch.ones(7, dtype=torch.int32))
        want = torch.full_like(m.req_idx_per_token, -1)
        want[:7] = torch.arange(7, dtype=torch.int32)
        want[7:] = 7  # tokens past the last request map to S (searchsorted semantics), not to a live request
        assert torch.equal(m.req_idx_per_token, want)
    assert torch.equal(m.req_idx_per_token, target_map)


def test_restore_runs_when_the_draft_body_raises(gen):
    # nvbugs 6442074 / draft_kv_cache_context: a mutation before `try`, and restores on four exception types
    # only, left later forwards on the draft KV cache.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    mgr, offs = m.kv_cache_manager, m.block_offsets
    for exc in (RuntimeError, torch.cuda.OutOfMemoryError, KeyboardInterrupt, SystemExit):
        with pytest.raises(exc):
            with st.switch("draft", "eager"):
                raise exc("draft forward failed")
        assert m.kv_cache_manager is mgr and m.block_offsets is offs and st.poisoned is None


def test_repeated_swap_keeps_first_original(gen):
    # TensorRT-LLM's save dict overwritten by a second prepare: the "original" saved was the draft twin.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    orig = m.block_offsets
    m.block_offsets = m.draft_block_offsets  # a hand-written hook already swapped it
    with st.switch("draft", "eager"):
        assert m.block_offsets is m.draft_block_offsets
    assert m.block_offsets is orig


def test_missing_declaration_is_an_error_not_a_skip(gen):
    # TensorRT-LLM #11858, #19138: hasattr checks silently skipped the draft switch for a new metadata class.
    class NewBackendMetadata:
        pass

    with pytest.raises(BindError, match="no spec registered"):
        bind(NewBackendMetadata(), registry=make_registry())

    class Subclass(MiniMetadata):  # subclasses inherit their base's declarations through the MRO
        pass

    st = bind(Subclass(gen), registry=make_registry())
    assert "block_offsets" in st.plan.buffers


def test_kv_lens_increments_do_not_accumulate_across_warmups(gen):
    # kv_lens_cuda += 1 in the draft loop accumulated over warmup and capture runs.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())
    start = m.kv_lens.clone()
    for _ in range(3):  # warmup, warmup, capture
        with st.switch("draft", "eager"):
            for _ in range(4):
                m.kv_lens.add_(1)
    assert torch.equal(m.kv_lens, start)
    assert torch.equal(m.kv_lens_runtime, start[:-1])


def test_swap_repoints_declared_runtime_views(gen):
    # The DSA hook rebinds slot_mapping_*_fullkv aliases to the draft tensors and must point them back.
    class M:
        pass

    spec = StateSpec("alias")
    spec.buffer("t", aliases=("t_runtime",))
    spec.buffer("kv", aliases=("kv_runtime",), draft=Swap(twin="t"))
    reg = Registry()
    reg.register(M, spec)
    m = M()
    m.kv, m.t = torch.arange(6.0), torch.arange(6.0) + 100
    m.kv_runtime, m.t_runtime = m.kv[1:4], m.t[:2]
    st = bind(m, registry=reg)
    with st.switch("draft", "eager"):
        assert torch.equal(m.kv_runtime, m.t[1:4]) and m.kv_runtime.data_ptr() == m.t[1:].data_ptr()
    assert m.kv_runtime.data_ptr() == m.kv[1:].data_ptr()


def test_failed_restore_is_loud_and_permanent(gen):
    # A stale save broke every later forward silently; graphctl poisons the state instead.
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry())

    def fail(stage, step, when):
        if stage == "restore" and step.startswith("snapshot"):
            raise RuntimeError("copy failed")

    with seams.hooks(st, fault=fail), pytest.raises(CorruptedStateError) as ei:
        with st.switch("draft", "eager"):
            m.kv_lens.add_(1)
    assert "kv_lens" in str(ei.value)
    for use in (lambda: st.write("seq_lens", m.seq_lens.clone()), st.check,
                lambda: st.switch("draft", "eager").__enter__()):
        with pytest.raises(CorruptedStateError):
            use()


def test_derived_inputs_may_be_swapped_objects_and_recompute_reads_the_twin(gen):
    # Slot mappings must be rebuilt from *the currently bound* offsets (DSA on_update_kv_lens).
    class M:
        pass

    spec = StateSpec("x")
    spec.buffer("d_offs", readers={"draft"})
    spec.buffer("offs", draft=Swap(twin="d_offs"))
    spec.buffer("lens")
    spec.buffer("slots", derive=Recompute(["offs", "lens"], lambda out, o, n: torch.add(o, n, out=out)))
    reg = Registry()
    reg.register(M, spec)
    m = M()
    m.offs, m.d_offs = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    m.lens, m.slots = torch.randn(5, generator=gen), torch.full((5,), float("nan"))
    st = bind(m, registry=reg)
    st.write("lens", m.lens.clone())
    with st.switch("draft", "eager"):
        assert torch.equal(m.slots, m.d_offs + m.lens)
    assert torch.equal(m.slots, m.offs + m.lens)

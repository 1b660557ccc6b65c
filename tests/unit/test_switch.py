"""Semantics of a bound state's switch and write, on the mini DSA-flavoured family."""
from __future__ import annotations

import pytest
import torch

import graphctl
from graphctl import CorruptedStateError, NestedSwitchError, bind
from graphctl.state import seams
from graphctl.testing import AllocationTracker
from support.mini import MiniMetadata, make_registry, slots


@pytest.fixture
def meta(gen):
    return MiniMetadata(gen)


@pytest.fixture
def state(meta):
    return bind(meta, registry=make_registry())


def snap(meta):
    return {k: v.clone() for k, v in vars(meta).items() if isinstance(v, torch.Tensor)}


def assert_same(meta, before):
    for k, v in before.items():
        assert torch.equal(getattr(meta, k), v), k


def test_eager_switch_applies_every_action_and_restores(meta, state):
    before = snap(meta)
    orig_offsets, orig_mgr = meta.block_offsets, meta.kv_cache_manager
    with state.switch("draft", "eager"):
        assert meta.block_offsets is meta.draft_block_offsets
        assert meta.kv_cache_manager is meta.draft_kv_cache_manager
        # refresh: the draft twin now holds the draft manager's pool indices
        assert torch.equal(meta.draft_block_offsets, meta.draft_kv_cache_manager.pool_indices)
        assert torch.equal(meta.spec_positions, meta.draft_positions)
        # recompute from the swapped input
        want = torch.empty_like(meta.slot_mapping)
        slots(want, meta.draft_kv_cache_manager.pool_indices, meta.kv_lens)
        assert torch.equal(meta.slot_mapping, want)
        assert not torch.equal(meta.slot_mapping, before["slot_mapping"])
    assert meta.block_offsets is orig_offsets and meta.kv_cache_manager is orig_mgr
    assert_same(meta, before)


def test_capture_phase_skips_refresh_and_replay_phase_skips_swaps(meta, state):
    before = snap(meta)
    with state.switch("draft", "capture"):
        assert meta.block_offsets is meta.draft_block_offsets
        assert torch.equal(meta.draft_block_offsets, before["draft_block_offsets"])  # not refreshed
        assert torch.equal(meta.spec_positions, meta.draft_positions)  # draft copy recorded in-graph
    assert_same(meta, before)
    with state.switch("draft", "replay"):
        assert meta.block_offsets is not meta.draft_block_offsets
        assert torch.equal(meta.draft_block_offsets, meta.draft_kv_cache_manager.pool_indices)
        assert torch.equal(meta.spec_positions, before["spec_positions"])  # baked into the graph
    assert_same(meta, before)


def test_write_through_recomputes_token_map_at_new_layout(meta, state, gen):
    S = meta.seq_lens.numel()
    new = torch.randint(0, 4, (S,), generator=gen, dtype=torch.int32)
    meta.req_idx_per_token.fill_(-123)  # poison: a missed recompute cannot pass
    state.write("seq_lens", new)
    cum = torch.cumsum(new.to(torch.int64), 0)
    want = torch.searchsorted(cum, torch.arange(meta.req_idx_per_token.numel()), right=True).to(torch.int32)
    assert torch.equal(meta.req_idx_per_token, want)


def test_write_pads_tail_by_policy(meta, state, gen):
    S = meta.kv_lens.numel()
    n = S - 2
    value = torch.randint(1, 99, (n,), generator=gen, dtype=torch.int32)
    state.write("kv_lens", value)
    assert torch.equal(meta.kv_lens[:n], value) and torch.equal(meta.kv_lens[n:], torch.zeros(2, dtype=torch.int32))
    meta_before = meta.block_offsets.clone()
    offs = torch.randint(-50, 50, (n, meta.block_offsets.shape[1]), generator=gen, dtype=torch.int32)
    meta.block_offsets[n:].copy_(torch.randint(-50, -1, (2, meta.block_offsets.shape[1]), generator=gen,
                                               dtype=torch.int32))
    state.write("block_offsets", offs)
    assert torch.equal(meta.block_offsets[:n], offs)
    assert (meta.block_offsets[n:] == 0).all()  # clamp(0) of negative stale tail
    assert not torch.equal(meta_before, meta.block_offsets)


def test_mutable_writes_inside_switch_are_undone(meta, state, gen):
    before = snap(meta)
    with state.switch("draft", "eager"):
        state.write("seq_lens", torch.ones_like(meta.seq_lens))  # layout (k+1) -> 1 token per request
        assert torch.equal(meta.req_idx_per_token[: meta.seq_lens.numel()],
                           torch.arange(meta.seq_lens.numel(), dtype=torch.int32))
        meta.kv_lens.add_(1)  # the draft loop's in-graph kv_lens += 1
        assert torch.equal(meta.kv_lens_runtime, meta.kv_lens[:-1])
    assert_same(meta, before)


def test_body_exception_restores_and_propagates(meta, state):
    before = snap(meta)
    with pytest.raises(KeyError, match="boom"):
        with state.switch("draft", "eager"):
            state.write("kv_lens", torch.full_like(meta.kv_lens, 7))
            raise KeyError("boom")
    assert_same(meta, before)
    assert state.poisoned is None


def test_nested_switch_refused_and_outer_untouched(meta, state):
    before = snap(meta)
    with state.switch("draft", "eager") as outer:
        inside = snap(meta)
        with pytest.raises(NestedSwitchError):
            with state.switch("draft", "eager"):
                pass
        assert_same(meta, inside)
        assert state.active_phase == "eager" and outer.phase == "eager"
    assert_same(meta, before)


def test_failed_restore_poisons_state(meta, state):
    def hook(stage, step, when):
        if stage == "restore" and step == "swap(block_offsets)" and when == "before":
            raise RuntimeError("restore fault")

    with seams.hooks(state, fault=hook), pytest.raises(CorruptedStateError) as ei:
        with state.switch("draft", "eager"):
            pass
    assert "swap(block_offsets)" in ei.value.failures
    with pytest.raises(CorruptedStateError, match="block_offsets"):
        state.write("seq_lens", meta.seq_lens.clone())
    with pytest.raises(CorruptedStateError):
        state.switch("draft", "eager").__enter__()


def test_keyboard_interrupt_during_apply_undoes(meta, state):
    before = snap(meta)

    def hook(stage, step, when):
        if stage == "apply" and step.startswith("recompute") and when == "after":
            raise KeyboardInterrupt

    seams.install(state, fault=hook)
    with pytest.raises(KeyboardInterrupt):
        state.switch("draft", "eager").__enter__()
    assert_same(meta, before)
    assert meta.block_offsets is not meta.draft_block_offsets and state.active_phase is None


def test_switch_allocates_nothing(meta, state):
    cm = state.switch("draft", "eager")
    with AllocationTracker() as alloc:
        cm.__enter__()
        state.write("seq_lens", meta.seq_lens)  # in place, recompute included
        cm.__exit__(None, None, None)
    assert alloc.allocations == []


def test_stale_check_names_buffer_and_index(meta, state):
    meta.seq_lens[1] += 1  # behind graphctl's back
    with pytest.raises(graphctl.StaleBufferError) as ei:
        state.check()
    assert ei.value.buffer == "req_idx_per_token" and isinstance(ei.value.index, int)
    with graphctl.knobs.scope(check_stale=True):
        with pytest.raises(graphctl.StaleBufferError):
            state.switch("draft", "eager").__enter__()


def test_verify_restore_detects_tampering(meta, state):
    with graphctl.knobs.scope(verify_restore=True):
        with pytest.raises(CorruptedStateError, match="verify"):
            with state.switch("draft", "eager"):
                state.binding.arena["eager", "kv_lens"].add_(1)  # corrupt the snapshot itself
        assert state.poisoned is not None


def test_pad_applies_policies_and_recomputes(meta, state, gen):
    meta.seq_lens.copy_(torch.randint(1, 4, meta.seq_lens.shape, generator=gen, dtype=torch.int32))
    state.write("seq_lens", meta.seq_lens.clone())
    state.pad({"seq": 2})
    assert (meta.seq_lens[2:] == 0).all() and (meta.kv_lens[2:] == 0).all()
    state.check()


def test_snapshot_sizes_per_phase(state):
    assert "draft_block_offsets" in state.snapshot_names("replay")
    assert "block_offsets" not in state.snapshot_names("eager")  # swapped, not written
    assert "topk_scratch" not in state.snapshot_names("eager")  # Stable is never snapshotted
    # refresh snapshots only the refreshed twins; every other phase every restorable buffer
    assert state.snapshot_bytes("refresh") < state.snapshot_bytes("capture") == state.snapshot_bytes("eager")


def test_write_many_equals_writes_one_by_one_and_recomputes_once(gen):
    # Session 5: HF generate's prepare wrote two lengths one by one, recomputing their shared maps twice.
    from graphctl import Recompute, StateSpec
    from support.mini import make_spec, token_map

    calls = {"slots": 0}

    def counted_slots(out, offsets, kv_lens):
        calls["slots"] += 1
        slots(out, offsets, kv_lens)

    spec = StateSpec("mini-count", extends=make_spec())
    spec.buffer("slot_mapping", shape=("S",), dtype=torch.int64, override=True,
                derive=Recompute(inputs=["block_offsets", "kv_lens"], fn=counted_slots))
    S = 5
    seq = torch.randint(0, 4, (S,), generator=gen, dtype=torch.int32)
    kv = torch.randint(1, 99, (S - 2,), generator=gen, dtype=torch.int32)
    offs = torch.randint(0, 50, (S, 3), generator=gen, dtype=torch.int32)
    seed = int(torch.randint(0, 999, (1,), generator=gen))
    a, b = MiniMetadata(torch.Generator().manual_seed(seed)), MiniMetadata(torch.Generator().manual_seed(seed))
    sa, sb = bind(a, registry=make_registry(spec=spec)), bind(b, registry=make_registry(spec=spec))
    for m in (a, b):
        m.req_idx_per_token.fill_(-7)  # poison: a missed recompute cannot pass
        m.slot_mapping.fill_(-7)
    sa.write("seq_lens", seq)
    sa.write("kv_lens", kv)
    sa.write("block_offsets", offs)
    calls["slots"] = 0
    sb.write_many({"seq_lens": seq, "kv_lens": kv, "block_offsets": offs})
    assert calls["slots"] == 1
    for name in ("seq_lens", "kv_lens", "block_offsets", "req_idx_per_token", "slot_mapping"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    want = torch.empty_like(b.req_idx_per_token)
    token_map(want, b.seq_lens)
    assert torch.equal(b.req_idx_per_token, want)
    sb.check()


@pytest.mark.parametrize("values,err", [
    (lambda m: {"seq_lens": torch.ones(5, dtype=torch.int32), "kv_lens": torch.ones(5, dtype=torch.int64)},
     "another dtype"),
    (lambda m: {"seq_lens": torch.ones(5, dtype=torch.int32), "slot_mapping": torch.ones(5, dtype=torch.int64)},
     "derived buffer"),
    (lambda m: {"seq_lens": torch.ones(5, dtype=torch.int32), "nope": torch.ones(5)}, "not a declared buffer"),
    (lambda m: {}, "non-empty mapping"),
    (lambda m: [("seq_lens", torch.ones(5, dtype=torch.int32))], "non-empty mapping"),
])
def test_write_many_checks_every_value_before_writing_any(meta, state, values, err):
    # Session 5: write_many is all or nothing: one bad value (last in the dict) and nothing was written.
    before = snap(meta)
    with pytest.raises(graphctl.SwitchError, match=err):
        state.write_many(values(meta))
    assert_same(meta, before)
    assert state.poisoned is None


def test_write_many_whose_recompute_raises_rolls_every_buffer_back(gen):
    # Session 5: a recompute failing after both values landed must roll back both, not only the last.
    from graphctl import Recompute, StateSpec
    from support.mini import make_spec

    calls = {"n": 0}

    def late(out, offsets, kv_lens):
        calls["n"] += 1
        if calls["n"] > 1:  # bind's own recompute passes; the write's fails
            raise RuntimeError("slots failed")
        slots(out, offsets, kv_lens)

    spec = StateSpec("mini-late", extends=make_spec())
    spec.buffer("slot_mapping", shape=("S",), dtype=torch.int64, override=True,
                derive=Recompute(inputs=["block_offsets", "kv_lens"], fn=late))
    m = MiniMetadata(gen)
    st = bind(m, registry=make_registry(spec=spec))
    before = snap(m)
    with pytest.raises(RuntimeError, match="slots failed"):
        st.write_many({"seq_lens": torch.ones(5, dtype=torch.int32), "kv_lens": torch.full((5,), 3, dtype=torch.int32)})
    assert_same(m, before)
    assert st.poisoned is None
